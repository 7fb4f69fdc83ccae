"""A round's sum of pieces in lowest-rank order: every arrival order gives the same bits, stash buffers are reused."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import pytest

from sluice.ps.ranked_sum import RankedSum, SparePool, bf16_to_f32, f32_to_bf16

Pieces = list[tuple[int, ...]]

#: float32 values that show the order of addition: 1e8 + 1 == 1e8, so (1e8 + 1) - 1e8 == 0, (1e8 - 1e8) + 1 == 1
VISIBLE = [1e8, 1.0, -1e8, 3.0, 0.25, -7.0]

#: pieces of the ranks 0..n-1 a server sums (each a sorted tuple of ranks: a worker's push or an aggregator's sum)
SERVER_PARTITIONS: list[Pieces] = [
    [(0,), (1,), (2,), (3,)],
    [(0, 1), (2, 3)],
    [(0, 2), (1,), (3,)],
    [(1, 2, 3), (0,)],
    [(0,), (1, 2), (3,)],
    [(0, 3), (1,), (2,)],
    [(0,), (1,), (2, 3)],
    [(0,), (1, 3), (2,)],
    [(0, 1, 2, 3)],
    [(0,), (1,), (2,), (3,), (4,)],
    [(0, 4), (1, 2), (3,)],
]

#: (an aggregator's subtree, pieces of it): ranks 0 and 1 are elsewhere
SUBTREE_PARTITIONS: list[tuple[tuple[int, ...], Pieces]] = [
    ((2, 3, 5), [(2,), (3,), (5,)]),
    ((2, 3, 5), [(2, 3), (5,)]),
    ((2, 3, 5), [(2, 5), (3,)]),
    ((2, 3, 5), [(3, 5), (2,)]),
    ((2, 3, 5), [(2, 3, 5)]),
    ((1, 4, 6, 7), [(1,), (4,), (6,), (7,)]),
    ((1, 4, 6, 7), [(1, 6), (4,), (7,)]),
    ((1, 4, 6, 7), [(4, 6, 7), (1,)]),
]


def by_lowest(pieces: Pieces) -> Pieces:
    return sorted(pieces, key=lambda ranks: ranks[0])


def float_values(pieces: Pieces) -> dict[tuple[int, ...], np.ndarray]:
    """One float32 vector per piece; column c gives the pieces (in lowest-rank order) a permutation of VISIBLE."""
    ordered = by_lowest(pieces)
    columns = list(itertools.permutations(VISIBLE[:max(len(ordered), 4)], len(ordered)))
    return {ranks: np.array([column[i] for column in columns], np.float32) for i, ranks in enumerate(ordered)}


def in_rank_order(values: dict[tuple[int, ...], np.ndarray]) -> np.ndarray:
    """((p0 + p1) + p2) + ... with pieces in lowest-rank order, computed by hand in float32."""
    ordered = [values[ranks] for ranks in by_lowest(list(values))]
    total = ordered[0].copy()
    for piece in ordered[1:]:
        total = (total + piece).astype(np.float32)
    return total


def arrival_sum(values: Sequence[np.ndarray]) -> np.ndarray:
    total = values[0].copy()
    for piece in values[1:]:
        total = total + piece
    return total


def run_round(total: RankedSum, spare: SparePool, order: Sequence[tuple[int, ...]],
              values: dict[tuple[int, ...], np.ndarray]) -> None:
    for ranks in order:
        total.take(ranks, values[ranks], spare)


def bits(array: np.ndarray) -> bytes:
    return array.tobytes()


def free_buffers(spare: SparePool) -> list[int]:
    return sorted(id(a) for free in spare._free.values() for a in free)


# ------------------------------------------------------------------------------------------ float32
@pytest.mark.parametrize("pieces", SERVER_PARTITIONS, ids=str)
def test_every_arrival_order_gives_the_rank_order_sum_bit_for_bit(pieces: Pieces) -> None:
    values = float_values(pieces)
    expected = in_rank_order(values)
    ranks = {r for piece in pieces for r in piece}
    naive = set()
    for order in itertools.permutations(pieces):
        total = RankedSum(np.zeros(expected.size, np.float32), "float32")
        run_round(total, SparePool(), order, values)
        assert bits(total.accum) == bits(expected), order
        assert total.covered == ranks and total.stash == {}, order
        assert total.low == max(ranks) + 1
        naive.add(bits(arrival_sum([values[r] for r in order])))
    if len(pieces) >= 3:  # the values do show the order: summing as they arrive would differ from run to run
        assert len(naive) > 1


@pytest.mark.parametrize(("expected_ranks", "pieces"), SUBTREE_PARTITIONS, ids=str)
def test_an_aggregators_subtree_completes_in_every_order(expected_ranks: tuple[int, ...], pieces: Pieces) -> None:
    values = float_values(pieces)
    expected = in_rank_order(values)
    for order in itertools.permutations(pieces):
        total = RankedSum(np.zeros(expected.size, np.float32), "float32")
        total.expect(expected_ranks)
        assert total.low == expected_ranks[0]
        run_round(total, SparePool(), order, values)
        assert total.covered == set(expected_ranks) and total.stash == {}, order
        assert bits(total.accum) == bits(expected), order


@pytest.mark.parametrize(
    ("expected_ranks", "order", "stashed_after"),
    [
        # a server: a piece waits only while a rank below it is missing; p1 may start the sum
        (None, [(3,), (2,), (1,), (0,)], [[3], [2, 3], [2, 3], []]),
        (None, [(1,), (3,), (0,), (2,)], [[], [3], [3], []]),
        (None, [(2, 3), (0, 1)], [[2], []]),
        (None, [(1, 2, 3), (0,)], [[], []]),
        # an aggregator of ranks 2, 3, 5: rank 3 is its "p1", rank 5 waits for both
        ((2, 3, 5), [(5,), (3,), (2,)], [[5], [5], []]),
        ((2, 3, 5), [(3,), (5,), (2,)], [[], [5], []]),
        ((2, 3, 5), [(3, 5), (2,)], [[], []]),
    ],
)
def test_what_waits_in_the_stash(expected_ranks: tuple[int, ...] | None, order: Pieces,
                                 stashed_after: list[list[int]]) -> None:
    total = RankedSum(np.zeros(2, np.float32), "float32")
    if expected_ranks is not None:
        total.expect(expected_ranks)
    spare = SparePool()
    for ranks, stashed in zip(order, stashed_after, strict=True):
        total.take(ranks, np.full(2, ranks[0], np.float32), spare)
        assert sorted(total.stash) == stashed, ranks


def test_a_stashed_piece_is_a_copy_not_the_senders_buffer() -> None:
    total, spare = RankedSum(np.zeros(3, np.float32), "float32"), SparePool()
    late = np.array([1.0, 2.0, 3.0], np.float32)
    total.take((2,), late, spare)
    late[:] = 99.0  # the sender's frame is reused once the handler returns
    total.take((0,), np.zeros(3, np.float32), spare)
    total.take((1,), np.zeros(3, np.float32), spare)
    assert total.accum.tolist() == [1.0, 2.0, 3.0]


@pytest.mark.parametrize("length", [2, 3, 16, 67])
def test_p1_first_still_adds_p0_plus_p1_with_nan_payloads(length: int) -> None:
    """p0 + p1 either way round: here even which NaN's payload survives does not depend on the arrival
    order (numpy's one-element loop may take either operand's: ranked_sum promises only the numbers)."""
    p0 = np.full(length, 0x7FC00001, np.uint32).view(np.float32)
    p1 = np.full(length, 0x7FC00002, np.uint32).view(np.float32)
    results = set()
    for order in ([(0,), (1,)], [(1,), (0,)]):
        total = RankedSum(np.zeros(length, np.float32), "float32")
        run_round(total, SparePool(), order, {(0,): p0, (1,): p1})
        results.add(bits(total.accum))
    assert len(results) == 1


# ------------------------------------------------------------------------------------------ other dtypes
@pytest.mark.parametrize("pieces", [[(0,), (1,), (2,), (3,)], [(0, 2), (1,), (3,)], [(1, 2, 3), (0,)]], ids=str)
def test_bfloat16_pieces_sum_in_float32_in_rank_order(pieces: Pieces) -> None:
    wide = float_values(pieces)
    stored = {}
    for ranks, values in wide.items():
        stored[ranks] = np.zeros(values.size, np.uint16)
        f32_to_bf16(values.copy(), stored[ranks])
    expected = in_rank_order({ranks: bf16_to_f32(b) for ranks, b in stored.items()})
    naive = set()
    for order in itertools.permutations(pieces):
        total = RankedSum(np.zeros(expected.size, np.float32), "bfloat16")
        run_round(total, SparePool(), order, stored)
        assert bits(total.accum) == bits(expected) and total.stash == {}, order
        naive.add(bits(arrival_sum([bf16_to_f32(stored[r]) for r in order])))
    assert len(naive) > 1 or len(pieces) < 3


@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_integer_pieces_are_never_stashed(dtype: str) -> None:
    pieces: Pieces = [(0, 2), (1,), (3,), (4,)]
    values = {ranks: np.array([ranks[0] * 1000 + 7, -(1 << 20), 3 * len(ranks)], dtype) for ranks in pieces}
    expected = sum(values.values())
    for order in itertools.permutations(pieces):
        total, spare = RankedSum(np.zeros(3, dtype), dtype), SparePool()
        for ranks in order:
            total.take(ranks, values[ranks], spare)
            assert total.stash == {}
        assert total.accum.tolist() == expected.tolist() and total.covered == {0, 1, 2, 3, 4}
        assert free_buffers(spare) == []


# ------------------------------------------------------------------------------------------ rounds
def test_stash_buffers_are_reused_round_after_round() -> None:
    pieces: Pieces = [(0,), (1,), (2,), (3,), (4,)]
    total, spare = RankedSum(np.zeros(24, np.float32), "float32"), SparePool()
    seen = []
    for round_ in range(10):
        values = {ranks: np.full(24, ranks[0] * 10 + round_, np.float32) for ranks in pieces}
        run_round(total, spare, list(reversed(pieces)), values)  # 4, 3 and 2 wait: three copies at the peak
        assert total.accum.tolist() == [sum(r * 10 + round_ for r in range(5))] * 24
        total.clear()
        seen.append(free_buffers(spare))
    assert len(seen[0]) == 3 and all(ids == seen[0] for ids in seen), "the pool grew or its buffers changed"


def test_the_pool_keeps_buffers_by_dtype_and_length() -> None:
    spare = SparePool()
    a = spare.copy_of(np.ones(4, np.float32))
    spare.give_back(a)
    assert spare.copy_of(np.ones(4, np.int32)) is not a and spare.copy_of(np.ones(5, np.float32)) is not a
    again = spare.copy_of(np.full(4, 2.0, np.float32))
    assert again is a and a.tolist() == [2.0] * 4


@pytest.mark.parametrize("expected_ranks", [None, (2, 3, 5)])
def test_clear_readies_the_next_round(expected_ranks: tuple[int, ...] | None) -> None:
    ranks = expected_ranks or (0, 1, 2)
    total, spare = RankedSum(np.zeros(24, np.float32), "float32"), SparePool()
    pieces = [(r,) for r in ranks]
    for round_ in range(3):
        if expected_ranks is not None:
            total.expect(expected_ranks)
        values = float_values(pieces)
        if round_ == 1:  # a different round's values: nothing of the previous sum may leak in
            values = {r: v * 2 for r, v in values.items()}
        run_round(total, spare, list(reversed(pieces)), values)
        assert bits(total.accum) == bits(in_rank_order(values))
        total.clear()
        assert (total.covered, total.first, total.low, total.stash) == (set(), -1, ranks[0], {})
        assert total.expected == expected_ranks  # the subtree stays: the next round of this chunk expects it too
