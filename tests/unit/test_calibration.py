"""Choosing chunk size and in-flight bound from measurements, and agreeing on one setting for the job."""

from __future__ import annotations

import pytest

from sluice.scheduler.calibration import (
    LOCAL_MAX_CHUNK,
    MAX_CHUNK,
    MAX_INFLIGHT,
    MIN_CHUNK,
    Limits,
    agree,
    choose_chunk,
    choose_inflight,
    inflight_candidates,
)

pytestmark = pytest.mark.timeout(10)

KiB, MiB = 1 << 10, 1 << 20


@pytest.mark.parametrize(
    ("bandwidth", "per_message", "chunk"),
    [
        (125e6, 30e-6, 256 * KiB),  # 1 Gbit/s, Python's per-message cost: 150 KB needed
        (125e6, 10e-6, MIN_CHUNK),  # 50 KB needed; never below the floor
        (125e6, 60e-6, 512 * KiB),  # the same link from a busier process
        (1.5e9, 30e-6, MAX_CHUNK),  # loopback: 1.8 MB needed
        (10e9, 30e-6, MAX_CHUNK),  # capped: preemption matters more than the last % of overhead
        (12.5e6, 50e-6, MIN_CHUNK),  # 100 Mbit/s
        (1.25e9, 5e-6, 256 * KiB),  # 10 Gbit/s with a fast path: 250 KB
        (125e6, 0.0, MIN_CHUNK),
    ],
)
def test_chunk_keeps_the_per_message_overhead_under_two_and_a_half_percent(
    bandwidth: float, per_message: float, chunk: int
) -> None:
    assert choose_chunk(bandwidth, per_message) == chunk


@pytest.mark.parametrize(
    ("bandwidth", "per_message", "chunk"),
    [
        (3e9, 30e-6, 4 * MiB),  # shared memory: 3.6 MB needed, a descriptor on the wire
        (10e9, 30e-6, LOCAL_MAX_CHUNK),  # capped
        (1.5e9, 10e-6, 1 * MiB),  # a fast path needs no more than the network's cap
        (125e6, 30e-6, 256 * KiB),  # what a network link needs stands
    ],
)
def test_servers_sharing_memory_allow_chunks_up_to_the_local_cap(bandwidth: float, per_message: float,
                                                                 chunk: int) -> None:
    assert choose_chunk(bandwidth, per_message, local=True) == chunk


@pytest.mark.parametrize(("bandwidth", "per_message"), [(0.0, 1e-5), (-1.0, 1e-5), (1e9, -1e-6)])
def test_chunk_rejects_impossible_measurements(bandwidth: float, per_message: float) -> None:
    with pytest.raises(ValueError):
        choose_chunk(bandwidth, per_message)


def test_inflight_candidates_double_from_one_chunk() -> None:
    assert inflight_candidates(MiB) == [MiB, 2 * MiB, 4 * MiB, 8 * MiB, 16 * MiB]
    assert inflight_candidates(128 * KiB)[:3] == [128 * KiB, 256 * KiB, 512 * KiB]
    assert inflight_candidates(128 * KiB)[-1] == MAX_INFLIGHT
    assert inflight_candidates(32 * MiB) == [MAX_INFLIGHT]


@pytest.mark.parametrize(
    ("trials", "reference", "local", "chosen"),
    [
        ([(256, 50.0)], 100.0, False, None),  # half the link: try more credit
        ([(256, 50.0), (512, 95.0)], 100.0, False, 512),
        ([(256, 91.0)], 100.0, False, 256),  # 90% is good enough: the smallest queue wins
        ([(256, 80.0), (512, 120.0)], 100.0, False, 512),  # a trial beat the reference: it becomes the bar
        ([(256, 100.0), (512, 200.0)], 100.0, False, 512),
        ([(1024, 99.0), (256, 98.0)], 100.0, False, 256),
        # between peers on one host, twice that: a margin for the servers' work in training
        ([(256, 50.0), (512, 95.0)], 100.0, True, 1024),
        ([(MAX_INFLIGHT, 99.0)], 100.0, True, MAX_INFLIGHT),  # never above the cap
        ([], 100.0, False, None),
    ],
)
def test_inflight_is_the_smallest_bound_reaching_ninety_percent(
    trials: list[tuple[int, float]], reference: float, local: bool, chosen: int | None
) -> None:
    assert choose_inflight(trials, reference, local) == chosen


@pytest.mark.parametrize(
    ("proposals", "agreed"),
    [
        ([Limits(MiB, 2 * MiB)], Limits(MiB, 2 * MiB)),
        ([Limits(128 * KiB, 256 * KiB), Limits(MiB, 2 * MiB)], Limits(128 * KiB, 2 * MiB)),
        ([Limits(MiB, 2 * MiB)] * 3 + [Limits(64 * KiB, 16 * MiB)], Limits(MiB, 2 * MiB)),  # one outlier
        ([Limits(MiB, 256 * KiB)], Limits(MiB, 2 * MiB)),  # at least two chunks in flight
        ([Limits(4 * MiB, 8 * MiB)] * 2, Limits(4 * MiB, 8 * MiB)),  # every worker shares its servers' memory
        ([Limits(4 * MiB, 8 * MiB), Limits(2 * MiB, 4 * MiB)], Limits(2 * MiB, 8 * MiB)),
        # a worker across a network keeps the network's cap, however many local workers outvote it
        ([Limits(4 * MiB, 8 * MiB)] * 3 + [Limits(MiB, 2 * MiB)], Limits(MAX_CHUNK, 8 * MiB)),
        ([Limits(4 * MiB, 8 * MiB)] * 3 + [Limits(256 * KiB, MiB)], Limits(MAX_CHUNK, 8 * MiB)),
    ],
)
def test_workers_agree_on_the_medians(proposals: list[Limits], agreed: Limits) -> None:
    assert agree(proposals) == agreed


def test_agreeing_needs_a_proposal() -> None:
    with pytest.raises(ValueError):
        agree([])


def test_limits_describe_and_travel_as_a_list() -> None:
    assert Limits(128 * KiB, MiB).describe() == "chunk 128 KiB, in-flight 1024 KiB"
    assert Limits(128 * KiB, MiB).as_list() == [128 * KiB, MiB]
