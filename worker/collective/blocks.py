"""How rows are split over ranks, framework-free: reducescatter's blocks and alltoall's splits, as Horovod splits them.

Reducescatter gives rank r a block of the first dimension, the blocks as even as they can be and the
first `rows % size` ranks one row longer (Horovod's rule). Alltoall sends `splits[i]` rows to rank i:
no splits means equal blocks, which the rows must divide; otherwise one count per rank whose sum is
at most the rows (the rest are not sent). The errors are Horovod's, as InvalidCallError (a ValueError).
"""

from __future__ import annotations

from collections.abc import Sequence

from sluice.errors import InvalidCallError


def block(rows: int, rank: int, size: int) -> slice:
    """Rank `rank`'s rows of `rows` split over `size` ranks as Horovod's reducescatter splits them."""
    starts = [r * (rows // size) + min(r, rows % size) for r in range(size + 1)]
    return slice(starts[rank], starts[rank + 1])


def block_rows(rows: int, rank: int, size: int) -> int:
    """How many rows `block` gives rank `rank`."""
    return rows // size + (1 if rank < rows % size else 0)


def alltoall_splits(splits: Sequence[int] | None, rows: int, size: int) -> list[int]:
    """The rows alltoall sends to each rank: `splits` checked as Horovod checks them, or equal blocks when
    they are None or empty (Horovod's empty splits tensor)."""
    if splits is None or len(splits) == 0:
        if rows % size:
            raise InvalidCallError("splits not provided, but first dimension of tensor is not an even multiple "
                                   f"of the number of workers ({rows} rows, {size} workers).")
        return [rows // size] * size
    counts = [int(s) for s in splits]
    if len(counts) != size:
        raise InvalidCallError(f"Number of entries in splits does not equal number of workers ({len(counts)} "
                               f"entries, {size} workers).")
    if min(counts) < 0:
        raise InvalidCallError(f"alltoall splits must not be negative, got {counts}")
    if sum(counts) > rows:
        raise InvalidCallError(f"Sum of splits entries is greater than the first dimension of tensor "
                               f"({sum(counts)} > {rows}).")
    return counts
