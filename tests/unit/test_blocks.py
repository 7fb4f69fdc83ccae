"""How rows are split over ranks (worker/collective/blocks.py): reducescatter's blocks and alltoall's splits."""

from __future__ import annotations

import pytest

from sluice.errors import InvalidCallError
from sluice.worker.collective.blocks import alltoall_splits, block, block_rows


@pytest.mark.parametrize(("rows", "size", "want"), [
    (8, 2, [(0, 4), (4, 8)]),
    (7, 3, [(0, 3), (3, 5), (5, 7)]),  # the first rows % size ranks get one more (Horovod's test_*_uneven)
    (9, 4, [(0, 3), (3, 5), (5, 7), (7, 9)]),
    (2, 4, [(0, 1), (1, 2), (2, 2), (2, 2)]),  # fewer rows than ranks: the last get none
    (0, 3, [(0, 0)] * 3),
])
def test_blocks_cover_the_rows_in_order_as_evenly_as_they_can(rows: int, size: int,
                                                              want: list[tuple[int, int]]) -> None:
    got = [block(rows, r, size) for r in range(size)]
    assert [(s.start, s.stop) for s in got] == want
    assert [block_rows(rows, r, size) for r in range(size)] == [b - a for a, b in want]


def test_alltoall_splits_default_to_equal_blocks_the_rows_must_divide() -> None:
    assert alltoall_splits(None, 6, 3) == [2, 2, 2]
    assert alltoall_splits([], 4, 2) == [2, 2]  # Horovod's empty splits tensor
    assert alltoall_splits(None, 0, 2) == [0, 0]
    with pytest.raises(InvalidCallError, match="not an even multiple of the number of workers"):
        alltoall_splits(None, 5, 2)


def test_alltoall_splits_are_checked_as_horovod_checks_them() -> None:
    assert alltoall_splits([1, 0, 3], 5, 3) == [1, 0, 3]  # rows past the sum are not sent
    assert isinstance(alltoall_splits([True, 2], 3, 2)[0], int)
    with pytest.raises(InvalidCallError, match="Number of entries in splits does not equal number of workers"):
        alltoall_splits([1, 1, 1], 3, 2)
    with pytest.raises(InvalidCallError, match="Sum of splits entries is greater than the first dimension"):
        alltoall_splits([2, 2], 3, 2)
    with pytest.raises(InvalidCallError, match="must not be negative"):
        alltoall_splits([-1, 2], 3, 2)
    with pytest.raises(ValueError):  # InvalidCallError is Horovod's ValueError
        alltoall_splits([4], 3, 1)
