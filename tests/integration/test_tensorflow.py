"""sluice.tensorflow: Horovod's TF 2 API on real workers (collectives, DistributedGradientTape, XLA)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from testbed.cluster import LocalCluster
from tests.integration import prefork  # noqa: F401 - imports the forked roles would make
from tests.integration.tf_error_jobs import tf_api_extras, tf_error_cases
from tests.integration.tf_jobs import STEPS, tape_training_only, tensorflow_api

# the `tensorflow` extra (the Makefile installs it). Not imported here: each forked worker imports it itself,
# so that no TF runtime state is ever forked
pytestmark = pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="needs the tensorflow extra")


def _assert_trains_like_one_process(result: dict[str, list[list[float]]], key: str) -> None:
    for got, want in zip(result[key], result["reference"], strict=True):
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_collectives_and_gradient_tape_on_two_workers(tmp_path: Path) -> None:
    priorities = tmp_path / "priorities.json"
    # small fusion buffers, so the MLP's gradients fill several balanced groups
    config = {"collective": {"fusion_bytes": 256}, "worker": {"priority_file": str(priorities)}}
    with LocalCluster(2, 0, config) as cluster:
        results = cluster.run(tensorflow_api, timeout=110)
        assert cluster.wait() == [0, 0, 0]
    for rank, out in enumerate(results):
        assert out["placement"] == [rank, 2, 0, 1]  # both on 127.0.0.1
        assert out["initialized"] and not out["initialized_after"]
        assert out["average"] == [0.5, 1.5, 2.5, 3.5, 4.5, 5.5]
        assert out["sum"] == [1.0, 3.0, 5.0, 7.0, 9.0, 11.0]
        assert out["scaled"] == [0.75, 2.25, 3.75, 5.25, 6.75, 8.25]  # x3 before the average, x0.5 after
        assert out["int_sum"] == [3, 6]
        assert out["fp16"] == "float32"  # decompressed to the tensor's own dtype
        assert out["grouped"] == [[1.0, 1.0], [[3.0, 3.0], [3.0, 3.0]]]
        assert out["allgather"] == [[0, 0], [1, 1], [1, 1]]
        assert out["broadcast"] == [1.0, 1.0, 1.0]
        assert out["in_graph"] == [[[1.0, 1.0], [0.0, 0.0, 1.0, 1.0], [0.0, 0.0]]] * 2  # traced once, run twice
        assert out["broadcast_variables"] == [[1.0, 1.0, 1.0], [1, 1]]
        assert out["broadcast_variables_in_graph"] == [0.0, 0.0]
        assert out["tape_isinstance"]
        assert out["tape_fp16"] == [[1.5, 1.5]]
        assert "jit_compile=False" in out["xla"], out["xla"]
        # one gradient reduction a step: the fp16 tape's, then the eager and the traced training's
        assert out["steps_timed"] == 2 * STEPS, out["steps_timed"]
        _assert_trains_like_one_process(out, "eager")
        _assert_trains_like_one_process(out, "graph")
    assert results[0]["graph"] == results[1]["graph"]  # bit for bit
    ranked = {e["name"]: e["priority"] for e in json.loads(priorities.read_text())["priorities"]}
    assert ranked == {"w1": 0, "b1": 1, "w2": 2, "b2": 3}  # first layers most urgent


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_gradient_tape_through_the_servers() -> None:
    config = {"collective": {"mode": "ps", "fusion_bytes": 256}}
    with LocalCluster(2, 1, config) as cluster:
        results = cluster.run(tape_training_only, timeout=110)
        assert cluster.wait() == [0, 0, 0, 0]
    for out in results:
        assert out["routes"] == ["ps"]
        _assert_trains_like_one_process(out, "graph")
    assert results[0]["graph"] == results[1]["graph"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_errors_raise_on_every_rank_with_horovods_tf_errors_and_the_ranks_stay_in_step() -> None:
    # 3 workers: the root and two children, whose descriptions meet at the root (a run with 2 workers repeated
    # these cases, 13 s of the suite, and covered nothing that 3 do not)
    workers = 3
    with LocalCluster(workers, 0, {"collective": {"stall_timeout": 10.0}}) as cluster:
        results = cluster.run(tf_error_cases, timeout=110)
    disagree = ("allreduce_shape", "allreduce_ndim", "allreduce_dtype", "allreduce_op", "allgather_shape",
                "allgather_dtype", "broadcast_shape", "broadcast_root_mismatch")
    for rank, out in enumerate(results):
        expected = {case: "FailedPreconditionError" for case in disagree}
        expected["broadcast_invalid_root"] = "ValueError"  # every rank's own check (Horovod's ValueError)
        expected["one_rank_scalar_allgather"] = "ValueError" if rank == 0 else "FailedPreconditionError"
        expected["graph_allreduce_shape"] = "UnknownError"  # a py_function's code for anything but ValueError
        assert {case: value[0] for case, value in out.items()} == expected, rank
        for case, (_, unnamed, traced) in out.items():
            assert unnamed == [float(sum(range(1, workers + 1)))] * 3, (rank, case)
            assert traced == [float(workers)] * 2, (rank, case)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_horovods_smaller_tf_names() -> None:
    with LocalCluster(2, 0) as cluster:
        results = cluster.run(tf_api_extras, timeout=110)
    for rank, out in enumerate(results):
        assert out["Min"] == [1.0, 3.0, -1.0] and out["Max"] == [2.0, 4.0, 0.0] and out["Product"] == [2.0, 12.0, 0.0]
        assert out["queries"] == [False, False, False, False, 0, False, False, False, False]
        assert out["ops"] == out["ops_traced"] == [rank, 2, rank, 2]  # one host: local rank is the rank
        assert out["broadcast_"] == [[1.0, 1.0], [1.0, 1.0]]  # the value returned, and the variable itself
        assert out["global_variables"].startswith("RuntimeError: hvd.broadcast_global_variables() does not support")
        assert out["mpi_threads"] == "ValueError"
    assert results[0]["join"] == results[1]["join"] in (0, 1)
