"""The pure parts of the collective data plane: segment, chunk, ring, chain and tree schedules as literal
tables, and the dtype-aware sums (bfloat16 rounding, float16, integer averages)."""

from __future__ import annotations

import numpy as np
import pytest

from sluice.worker.collective.reduce import accumulate, bf16_to_f32, check_reducible, divide, f32_to_bf16
from sluice.worker.collective.schedule import RingSchedule, chain, chunk_elems, chunk_spans, heap_tree, split


# ---------------------------------------------------------------------------- schedules
@pytest.mark.parametrize(
    ("count", "parts", "spans"),
    [
        (10, 3, [(0, 4), (4, 3), (7, 3)]),  # not divisible: the first count % parts are one longer
        (12, 3, [(0, 4), (4, 4), (8, 4)]),
        (2, 4, [(0, 1), (1, 1), (2, 0), (2, 0)]),  # fewer elements than parts: empty tails
        (0, 2, [(0, 0), (0, 0)]),
        (5, 1, [(0, 5)]),
    ],
)
def test_split(count: int, parts: int, spans: list[tuple[int, int]]) -> None:
    assert split(count, parts) == spans


@pytest.mark.parametrize(
    ("start", "length", "elems", "spans"),
    [
        (4, 10, 4, [(4, 4), (8, 4), (12, 2)]),
        (0, 8, 4, [(0, 4), (4, 4)]),
        (7, 0, 4, []),
        (3, 1, 1024, [(3, 1)]),
    ],
)
def test_chunk_spans(start: int, length: int, elems: int, spans: list[tuple[int, int]]) -> None:
    assert chunk_spans(start, length, elems) == spans


def test_chunk_elems() -> None:
    assert chunk_elems(1 << 20, 4) == 262144
    assert chunk_elems(1 << 20, 2) == 524288
    assert chunk_elems(6, 4) == 1  # at least one element, whatever the chunk size
    assert chunk_elems(3, 8) == 1


# segments sent and received at each step of a 3-rank ring, per position: reduce-scatter (steps 0, 1),
# then allgather (steps 2, 3)
RING3 = {
    0: ([0, 2, 1, 0], [2, 1, 0, 2]),
    1: ([1, 0, 2, 1], [0, 2, 1, 0]),
    2: ([2, 1, 0, 2], [1, 0, 2, 1]),
}


@pytest.mark.parametrize("position", [0, 1, 2])
def test_ring_schedule_literal(position: int) -> None:
    schedule = RingSchedule.build(10, 3, position, 2)
    sends, receives = RING3[position]
    assert [schedule.send_segment(s) for s in range(schedule.steps)] == sends
    assert [schedule.recv_segment(s) for s in range(schedule.steps)] == receives
    assert schedule.segments == ((0, 4), (4, 3), (7, 3))
    assert schedule.chunks == (((0, 2), (2, 2)), ((4, 2), (6, 1)), ((7, 2), (9, 1)))
    assert schedule.messages == 8
    assert schedule.offsets == (0, 2, 4, 6, 8)


def test_ring_schedule_of_fewer_elements_than_ranks() -> None:
    schedule = RingSchedule.build(2, 4, 0, 1024)
    assert schedule.segments == ((0, 1), (1, 1), (2, 0), (2, 0))
    # from its predecessor position 0 gets segments 3, 2, 1 (reduce) and 0, 3, 2 (gather): 1 and 0 hold data
    assert schedule.offsets == (0, 0, 0, 1, 2, 2, 2)
    assert schedule.bytes_per_rank(4) == 8


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 7])
@pytest.mark.parametrize("count", [0, 1, 3, 10, 101])
def test_ring_schedule_sums_everything_everywhere(size: int, count: int) -> None:
    """Play the schedule with plain arrays: every rank ends with the sum, each message is what its
    receiver expects, and the sum of segment k runs along the ring from position k."""
    schedules = [RingSchedule.build(count, size, p, 3) for p in range(size)]
    data = [np.arange(count, dtype=np.int64) * 10 ** p for p in range(size)]
    for p in range(size):  # what p receives at each step is what its predecessor sends then
        pred = schedules[(p - 1) % size]
        assert [pred.send_segment(s) for s in range(pred.steps)] == \
            [schedules[p].recv_segment(s) for s in range(pred.steps)]
    for step in range(2 * (size - 1)):
        sent = [data[p][slice(*_span(schedules[p].segments[schedules[p].send_segment(step)]))].copy()
                for p in range(size)]
        for p in range(size):
            start, stop = _span(schedules[p].segments[schedules[p].recv_segment(step)])
            if step < size - 1:
                data[p][start:stop] += sent[(p - 1) % size]
            else:
                data[p][start:stop] = sent[(p - 1) % size]
    expected = np.arange(count, dtype=np.int64) * sum(10 ** p for p in range(size))
    for p in range(size):
        assert np.array_equal(data[p], expected)


def _span(span: tuple[int, int]) -> tuple[int, int]:
    return span[0], span[0] + span[1]


def test_chain_starts_at_the_root_and_follows_the_ring() -> None:
    assert chain([0, 2, 1, 3], 1) == [1, 3, 0, 2]
    assert chain([0, 1, 2], 0) == [0, 1, 2]
    assert chain([0], 0) == [0]


def test_heap_tree_over_the_ring_order() -> None:
    parent, children = heap_tree([0, 3, 1, 2, 4])
    assert parent == {0: None, 3: 0, 1: 0, 2: 3, 4: 3}
    assert children == {0: [3, 1], 3: [2, 4], 1: [], 2: [], 4: []}
    assert heap_tree([0]) == ({0: None}, {0: []})


# ---------------------------------------------------------------------------- sums
def bf16(*values: int) -> np.ndarray:
    return np.array(values, np.uint16)


@pytest.mark.parametrize(
    ("a", "b", "total"),
    [
        (0x3F80, 0x3F80, 0x4000),  # 1 + 1 = 2
        (0x3F80, 0x3B80, 0x3F80),  # 1 + 2**-8: a tie, rounds to the even 1.0
        (0x3F81, 0x3B80, 0x3F82),  # (1 + 2**-7) + 2**-8: a tie, rounds to the even 1 + 2**-6
        (0x3F80, 0x3BC0, 0x3F81),  # 1 + 1.5 * 2**-8: above the tie, rounds up
        (0x3F80, 0xBF80, 0x0000),  # 1 - 1
        (0x7F7F, 0x7F7F, 0x7F80),  # the largest finite doubled overflows to infinity
        (0x7F80, 0x3F80, 0x7F80),  # inf + 1
        (0xFF80, 0x3F80, 0xFF80),  # -inf + 1
        (0x7FC1, 0x3F80, 0x7FC0),  # NaN + 1: torch's quiet NaN
        (0xFFFF, 0x3F80, 0x7FC0),  # a NaN whose rounding would carry into the sign
        (0x0001, 0x0001, 0x0002),  # subnormals add exactly
    ],
)
def test_bfloat16_sum_rounds_to_nearest_even(a: int, b: int, total: int) -> None:
    dst = bf16(a)
    accumulate(dst, bf16(b), "bfloat16")
    assert hex(int(dst[0])) == hex(total)


def test_bfloat16_sum_matches_torch() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    a = rng.integers(0, 1 << 16, 100_000, dtype=np.uint16)
    b = rng.integers(0, 1 << 16, 100_000, dtype=np.uint16)
    expected = (torch.from_numpy(a.copy()).view(torch.bfloat16).float() + torch.from_numpy(b.copy())
                .view(torch.bfloat16).float()).bfloat16().view(torch.int16).numpy().view(np.uint16)
    dst = a.copy()
    accumulate(dst, b, "bfloat16")
    nan = np.isnan(bf16_to_f32(expected))
    assert np.array_equal(dst[~nan], expected[~nan])
    assert np.all(dst[nan] == 0x7FC0)


def test_bfloat16_conversion_round_trips() -> None:
    patterns = np.arange(1 << 16, dtype=np.uint16)
    out = np.empty_like(patterns)
    f32_to_bf16(bf16_to_f32(patterns), out)
    finite = ~np.isnan(bf16_to_f32(patterns))
    assert np.array_equal(out[finite], patterns[finite])  # a bfloat16 is exact in float32


@pytest.mark.parametrize(
    ("a", "b", "total"),
    [
        (1.0, 2.0**-11, 1.0),  # a tie: rounds to the even 1.0
        (1.0, 3 * 2.0**-11, 1.0 + 2.0**-9),  # a tie between 1 + 2**-10 and 1 + 2**-9: the even one
        (65504.0, 65504.0, np.inf),  # float16's largest doubled
        (2.0**-24, 2.0**-24, 2.0**-23),  # subnormals
    ],
)
def test_float16_sum_is_correctly_rounded(a: float, b: float, total: float) -> None:
    dst = np.array([a], np.float16)
    with np.errstate(over="ignore"):
        accumulate(dst, np.array([b], np.float16), "float16")
    assert dst[0] == np.float16(total)


def test_float16_sum_matches_float32_rounded_once() -> None:
    rng = np.random.default_rng(3)
    a = rng.standard_normal(10_000).astype(np.float16)
    b = (rng.standard_normal(10_000) * 1e-3).astype(np.float16)
    dst = a.copy()
    accumulate(dst, b, "float16")
    assert np.array_equal(dst, (a.astype(np.float32) + b.astype(np.float32)).astype(np.float16))


@pytest.mark.parametrize(
    ("dtype", "values", "count", "expected"),
    [
        ("int32", [-3, 3, 7], 2, [-2, 1, 3]),  # integers take the floor of the mean
        ("int64", [10, -10], 4, [2, -3]),
        ("float32", [3.0, -1.0], 2, [1.5, -0.5]),
        ("float16", [3.0, 1.0], 4, [0.75, 0.25]),
        ("float64", [1.0], 3, [1.0 / 3.0]),
    ],
)
def test_divide(dtype: str, values: list[float], count: int, expected: list[float]) -> None:
    array = np.array(values, np.dtype(dtype))
    divide(array, count, dtype)
    assert array.tolist() == pytest.approx(expected)


def test_bfloat16_average_divides_in_float32_and_rounds() -> None:
    array = bf16(0x4040, 0x3F80)  # 3.0, 1.0
    divide(array, 3, "bfloat16")
    assert array.tolist() == [0x3F80, 0x3EAB]  # 1.0, and 1/3 rounded to bfloat16


def test_integer_sums_wrap_like_numpy() -> None:
    dst = np.array([np.iinfo(np.int32).max], np.int32)
    accumulate(dst, np.array([1], np.int32), "int32")
    assert dst[0] == np.iinfo(np.int32).min


def test_check_reducible() -> None:
    check_reducible("bfloat16", "average")
    check_reducible("int8", "max")
    with pytest.raises(ValueError, match="bool"):
        check_reducible("bool", "sum")
    with pytest.raises(ValueError, match="median"):
        check_reducible("float32", "median")
