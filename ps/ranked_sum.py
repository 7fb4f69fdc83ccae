"""A round's sum of pieces (each the sum of some workers' pushes) in worker rank order, whatever the arrival order.

Float addition is not associative, so summing in arrival order would change results bit by bit
from run to run (issue 7 asks for bitwise-identical runs with the same seeds). A piece covers a set
of worker ranks: one worker's push, or an aggregator's partial sum of its subtree. Pieces are
disjoint, and the sum is taken in the order of their lowest ranks: ((p0 + p1) + p2) + ... A piece is
added at once when every expected rank below its lowest is already in the sum; any other is copied
aside until the gap before it fills. The first two pieces commute (a + b == b + a, bit for bit, for every number): the
piece holding the smallest expected rank e0 is p0, and one whose lowest rank is the next expected
rank e1 must be p1 (e1 is not in p0), so either may start the sum and the other is added with its
operands in p0 + p1 order. A server expects every rank (e0 = 0, e1 = 1); an aggregator the ranks of
its subtree. With one piece per worker this is exactly the rank order of single pushes: only an
out-of-order arrival costs a copy.
Integer sums need no order: integer addition is associative.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

#: dtypes whose sums depend on the order of addition
FLOAT_DTYPES = frozenset(("float32", "float64", "float16", "bfloat16"))


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(values: np.ndarray, out: np.ndarray) -> None:
    bits = values.view(np.uint32)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    np.right_shift(rounded, 16, out=rounded)
    out[...] = rounded


class SparePool:
    """Free stash buffers by (dtype, length), reused round after round: an out-of-order piece costs a
    copy and no allocation; together they hold at most the peak of pieces stashed at once."""

    def __init__(self) -> None:
        self._free: dict[tuple[str, int], list[np.ndarray]] = {}

    def copy_of(self, data: np.ndarray) -> np.ndarray:
        free = self._free.get((data.dtype.str, data.size))
        copy = free.pop() if free else np.empty_like(data)
        np.copyto(copy, data)
        return copy

    def give_back(self, array: np.ndarray) -> None:
        self._free.setdefault((array.dtype.str, array.size), []).append(array)


@dataclass
class RankedSum:
    """The sum of one round's pieces in `accum` (float32 for bfloat16 pieces), in lowest-rank order."""

    accum: np.ndarray
    dtype: str
    #: the ranks a complete sum holds, sorted (by default every rank: see expect())
    expected: Sequence[int] | None = None
    #: each expected rank -> the next one (None: every rank, so rank + 1)
    _after: dict[int, int] | None = None
    #: ranks already added into accum
    covered: set[int] = field(default_factory=set)
    #: the smallest expected rank not in `covered`
    low: int = 0
    #: lowest rank of the piece that started the sum (-1: empty)
    first: int = -1
    #: pieces that arrived before the gap below them filled: lowest rank -> (ranks, storage-dtype copy)
    stash: dict[int, tuple[Sequence[int], np.ndarray]] = field(default_factory=dict)

    def expect(self, ranks: Sequence[int]) -> None:
        """This round's sum holds exactly `ranks` (sorted): an aggregator's subtree. Call before take()."""
        if ranks is not self.expected:  # a tree's ranks are one tuple round after round: map them once
            self.expected = ranks
            self._after = dict(itertools.pairwise(ranks))
        self.low = ranks[0]

    def _next_expected(self, rank: int) -> int:
        return rank + 1 if self._after is None else self._after.get(rank, rank + 1)

    def take(self, ranks: Sequence[int], data: np.ndarray, spare: SparePool) -> None:
        """Add the piece covering sorted `ranks` now if its turn has come, else stash a copy.

        A copy, not a reference: the payload's memory (a ring slot, a frame) is the sender's again once
        the handler returns.
        """
        lowest = ranks[0]
        ordered = self.dtype in FLOAT_DTYPES
        if self.first < 0:
            if ordered and lowest != self.low and lowest != self._next_expected(self.low):
                self.stash[lowest] = (ranks, spare.copy_of(data))
                return
        elif ordered and lowest != self.low:  # (p0 after p1: low is still 0, so it passes here)
            self.stash[lowest] = (ranks, spare.copy_of(data))
            return
        self._add(ranks, data)
        while self.low in self.stash:  # the gap is filled: add what waited behind it, in order
            waiting_ranks, stashed = self.stash.pop(self.low)
            self._add(waiting_ranks, stashed)
            spare.give_back(stashed)

    def _add(self, ranks: Sequence[int], data: np.ndarray) -> None:
        wide = bf16_to_f32(data) if self.dtype == "bfloat16" else data
        if self.first < 0:
            np.copyto(self.accum, wide)
            self.first = ranks[0]
        elif ranks[0] == self.low and self.first > self.low:  # p1 came first: still p0 + p1, operands in
            np.add(wide, self.accum, out=self.accum)  # that order (a NaN's payload may still come from either:
            # numpy's one-element loop picks by aliasing, not by operand order)
            self.first = ranks[0]
        else:
            self.accum += wide
        self.covered.update(ranks)
        while self.low in self.covered:
            self.low = self._next_expected(self.low)

    def clear(self) -> None:
        """Ready for the next round (every piece was added, so the stash is empty)."""
        self.covered.clear()
        self.low = self.expected[0] if self.expected else 0
        self.first = -1
