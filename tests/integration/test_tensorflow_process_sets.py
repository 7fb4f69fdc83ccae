"""Horovod's process sets on sluice.tensorflow and sluice.keras, in a real job of 3 workers."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from testbed.cluster import LocalCluster
from tests.integration import prefork  # noqa: F401 - imports the forked roles would make
from tests.integration.tf_process_set_jobs import keras_reference, tf_process_sets

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="needs the tensorflow extra")]


@pytest.mark.timeout(150)
def test_tensorflow_and_keras_process_sets() -> None:
    with LocalCluster(3, 0, {"collective": {"stall_timeout": 10.0}}) as cluster:
        results = cluster.run(tf_process_sets, timeout=130)
    for rank, out in enumerate(results):
        members = [0, 2] if rank != 1 else [1]
        total = float(sum(r + 1 for r in members))
        assert out["ids"] == [1, 2, 2, int(rank != 1)], rank
        assert out["sum"] == [total] * 3 and out["average"] == [total / len(members)] * 3, rank
        assert out["traced"] == [[total] * 3] * 2, rank
        assert out["allgather"] == [r for r in members for _ in range(r + 1)], rank
        assert out["broadcast"] == [float(members[-1])] * 2, rank
        mine = members.index(rank)
        assert out["alltoall"] == [2 * mine + j + 10 * r for r in members for j in range(2)], rank
        rows = 4 // len(members)
        assert out["reducescatter"] == [[total]] * rows, rank
        assert out["job"] == [3.0, 3.0], rank
        if rank != 1:
            assert "process set 1 (ranks [0, 2])" in out["set_error"], out["set_error"]
            assert out["after_error"] == [2.0, 2.0]
        assert out["tape"] == out["tape_traced"] == [total / len(members)] * 2, rank  # d(x.w)/dw, averaged
        np.testing.assert_allclose(out["keras"], keras_reference(members), rtol=1e-5, err_msg=f"rank {rank}")
        assert out["removed"] is True and out["last"] == [3.0], rank
