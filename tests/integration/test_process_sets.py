"""Horovod's process sets on sluice.torch, in real jobs of 3 workers with 0 and 1 servers."""

from __future__ import annotations

import numpy as np
import pytest

from testbed.cluster import LocalCluster
from tests.integration.process_set_jobs import process_set_cases

pytestmark = pytest.mark.slow


@pytest.mark.timeout(150)
@pytest.mark.parametrize("servers", [0, 1])
def test_process_sets_as_horovods(servers: int) -> None:
    # with a server, gradients go through it: a set's rounds there count only the set's workers
    config = {"collective": {"stall_timeout": 10.0, **({"mode": "ps"} if servers else {})}}
    with LocalCluster(3, servers, config) as cluster:
        results = cluster.run(process_set_cases, timeout=120)
    for rank, out in enumerate(results):
        assert out["static"][:4] == [1, 2, None, [1, 2]], rank  # the clone of [0, 1] is left unregistered
        assert out["static"][4:] == [2, rank if rank < 2 else None, rank < 2, [0, 1, 2]], rank
        assert out["dynamic"] == [3, 4, {0: 0, 1: None, 2: 1}[rank], rank == 1], rank
        assert out["duplicate"].startswith("ValueError: Attempted to add a duplicate process set"), out["duplicate"]
        members = [0, 2] if rank in (0, 2) else [1]
        total = float(sum(r + 1 for r in members))
        assert out["sum"] == [total] * 3 and out["average"] == [total / len(members)] * 3, rank
        assert out["grouped"] == [[total] * 3, [2 * total] * 3], rank
        assert out["allgather"] == [r for r in members for _ in range(r + 1)], rank  # the set's rank order
        assert out["broadcast"] == [float(members[-1])] * 2, rank
        mine = members.index(rank)
        assert out["alltoall"] == [float(2 * mine + j + 10 * r) for r in members for j in range(2)], rank
        rows = [4 // len(members) + (i < 4 % len(members)) for i in range(len(members))]
        assert out["reducescatter"] == [[total] * 2] * rows[mine], rank
        assert out["grad"] == [total] * 2, rank  # the gradient is reduced over the same set
        assert out["object"] == {"from": members[-1]}, rank
        refused = out["object_refused"]
        assert refused.startswith("TypeError" if rank == 0 else "HorovodInternalError"), refused
        assert out["after_object"] == [3.0], rank
        assert out["job_after_odd"] == [3.0, 3.0], rank
        if rank != 1:
            error = out["set_error"]
            assert error.startswith("HorovodInternalError") and "process set 3 (ranks [0, 2])" in error, error
            assert out["after_set_error"] == [2.0, 2.0], rank
            assert out["bad_root"].startswith("ValueError: broadcast received invalid root rank 1"), out["bad_root"]
        assert out["foreign"].startswith("HorovodInternalError") and "not a member" in out["foreign"], out["foreign"]
        assert out["overlap_job"] == [3.0] and out["overlap_set"] == [float(sum(members))] * 4, rank
        want = out["reference_02"] if rank != 1 else out["reference_alone"]
        np.testing.assert_allclose(out["trained"], want, rtol=1e-6, err_msg=f"rank {rank}")
        assert out["through_servers"] == (servers == 1 and rank != 1), rank
        assert out["removed"] == [True, None, False, False], rank
        assert "does not exist" in out["after_remove"], out["after_remove"]
        assert out["last"] == [3.0], rank
    assert results[0]["trained"] == results[2]["trained"]  # bit for bit within the set
