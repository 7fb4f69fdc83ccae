"""Horovod's errors on sluice.torch, in real jobs of 2 and 3 workers with 0 and 1 servers: every error
raises on every rank at the same call, with Horovod's exception type, and the next collectives (an
unnamed one, a named one, the failed call's own name again) succeed on every rank."""

from __future__ import annotations

import numpy as np
import pytest

from testbed.cluster import LocalCluster
from tests.integration import prefork
from tests.integration.horovod_error_jobs import error_cases, join_cases, uneven_epochs, uneven_reference

prefork.torch_optimizers()  # once here, not in every forked worker

pytestmark = pytest.mark.slow

#: cases where the ranks disagree: Horovod's coordinator fails the op on every rank (HorovodInternalError)
DISAGREE = ("allreduce_shape", "allreduce_ndim", "allreduce_dtype", "allreduce_op", "allreduce_prescale",
            "allreduce_postscale", "allreduce_same_name_again",
            "grouped_allreduce_shape", "allgather_shape", "allgather_dtype", "broadcast_shape", "broadcast_dtype",
            "broadcast_root_mismatch", "alltoall_dtype", "alltoall_rank", "reducescatter_shape",
            "reducescatter_dtype", "optimizer_shape")
#: arguments no rank could run: ValueError at the call (reducescatter's Min: Horovod's RuntimeError, which
#: Sluice's InvalidCallError also is)
INVALID = ("broadcast_invalid_root", "alltoall_equal_split_length", "alltoall_splits_sum", "alltoall_splits_type",
           "alltoall_negative_splits", "reducescatter_scalar", "reducescatter_min")
#: rank 0 alone cannot run its call: ValueError there, HorovodInternalError on the others
ONE_RANK = ("one_rank_bad_splits", "one_rank_not_a_tensor", "one_rank_bad_root")


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("workers", "servers"), [(2, 0), (3, 0), (3, 1)])
def test_every_error_raises_on_every_rank_and_the_ranks_stay_in_step(workers: int, servers: int) -> None:
    with LocalCluster(workers, servers, {"collective": {"stall_timeout": 10.0}}) as cluster:
        results = cluster.run(error_cases, timeout=200)
    unnamed = [float(sum(range(1, workers + 1)))] * 3
    for rank, out in enumerate(results):
        expected = {case: "HorovodInternalError" for case in DISAGREE}
        expected.update({case: "ValueError" for case in INVALID})
        expected.update({case: "ValueError" if rank == 0 else "HorovodInternalError" for case in ONE_RANK})
        assert {case: out[case][0] for case in expected} == expected, f"rank {rank}"
        for case in expected:
            assert out[case][1:3] == [unnamed, [float(workers)] * 2], f"rank {rank}, after {case}"
        for case in ONE_RANK:  # the others' error names the rank that refused, and why
            assert rank == 0 or "rank 0 submitted nothing: it refused the call (InvalidCallError" in out[case][3], (
                rank, case, out[case][3])
        assert out["duplicate_name"] == ["ValueError", "[1.0, 1.0]", "[1.0, 1.0]"], f"rank {rank}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("workers", "servers"), [(2, 0), (3, 1)])
def test_join_gives_horovods_results_and_errors(workers: int, servers: int) -> None:
    with LocalCluster(workers, servers, {"collective": {"stall_timeout": 10.0}}) as cluster:
        results = cluster.run(join_cases, timeout=100)
    for first in range(workers):
        others = [r for r in range(workers) if r != first]
        total = sum(r + 1 for r in others)
        lasts = set()
        for rank, out in enumerate(results):
            got = out[f"first{first}"]
            lasts.add(got[0])
            if rank != first:  # the joined rank's zeros count in the average's divisor, as Horovod's
                mean = float(np.float32(total) * np.float32(1 / workers))  # Horovod's float32 average
                assert got[1:] == [[mean] * 4, [int(total / workers)] * 4, "HorovodInternalError",
                                   "HorovodInternalError"], f"rank {rank}, rank {first} joined first"
        assert len(lasts) == 1 and lasts != {first}, f"rank {first} joined first; last joiners {lasts}"
    assert [out["after"] for out in results] == [[float(workers)] * 2] * workers


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("servers", "optimizer_on", "mode"), [(0, "worker", "auto"), (1, "worker", "ps"),
                                                               (1, "server", "auto")])
def test_join_lets_uneven_workers_finish_and_train_on_every_route(servers: int, optimizer_on: str, mode: str) -> None:
    config = {"worker": {"optimizer_on": optimizer_on}, "collective": {"mode": mode, "stall_timeout": 10.0}}
    with LocalCluster(2, servers, config) as cluster:
        results = cluster.run(uneven_epochs, timeout=100)
    want = uneven_reference(optimizer_on)
    assert results[0]["lasts"] == results[1]["lasts"]  # join() names the same last rank everywhere
    if servers == 0:  # worker 0 joined last after the uneven epoch: its allreduces needed worker 1's join first
        assert results[0]["lasts"][0] == 0
    # (through the servers worker 0's last rounds need only the servers to know worker 1 joined, so worker 0's
    # join can reach the coordinator tree's root first, and be named as the first)
    for rank, out in enumerate(results):
        assert out["params"] == pytest.approx(want[rank], rel=1e-5, abs=1e-6), rank
