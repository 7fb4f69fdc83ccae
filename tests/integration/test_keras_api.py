"""sluice.keras and sluice.tensorflow.keras against horovod.keras and horovod.tensorflow.keras: every name, the
callbacks, the elastic state in memory (two workers, one job), and an elastic Keras job under `sluice launch
--elastic` that loses a worker and goes on from its last commit."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from testbed.cluster import LocalCluster
from tests.integration import (
    prefork,  # noqa: F401 - imports the forked roles would make
    preloads,
)
from tests.integration.elastic_dirs import assert_state_dir_removed
from tests.integration.keras_api_jobs import keras_names

# the `tensorflow` extra; TF is imported by the workers only, so that no TF runtime state is ever forked
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("keras") is None, reason="needs the tensorflow extra")]

ROOT = Path(__file__).resolve().parents[2]


def _close(got: Any, want: Any) -> None:
    np.testing.assert_allclose(np.array(got, dtype=np.float64), np.array(want, dtype=np.float64), rtol=1e-6)


@pytest.mark.timeout(120)
def test_every_keras_name_on_two_workers(tmp_path: Path) -> None:
    with LocalCluster(2, 0) as cluster:
        results = cluster.run(keras_names, str(tmp_path), timeout=110)
        assert cluster.wait() == [0, 0, 0]
    value_error = "InvalidCallError(ValueError)"
    for rank, out in enumerate(results):
        assert not any(out["missing"].values()), out["missing"]  # every name of Horovod's modules
        # queries and values, as Horovod's Keras functions give them (2 workers on one host)
        assert out["queries"] == [2, rank, 2, rank, 1, 0, 1] + [0] * 9 and out["queries_same"]
        assert out["mpi_threads_supported"] == value_error
        assert (out["average"], out["sum"], out["after_error"], out["tf_keras_sum"]) == ([1.5, 2.0], 3.0, [1.0], [1.0])
        assert out["op_with_average"] == value_error  # horovod.keras's average=True with op=: Horovod's ValueError
        assert out["adasum"] == [1.0, 1.0] and out["fp16"] == ["float32", 1.0]
        assert out["allgather"] == [[0], [0], [1]] and out["broadcast"] == [6.0]
        assert out["reducescatter"] == [[1.0 + 2 * rank], [2.0 + 2 * rank]]
        assert out["reducescatter_sum"] == [[3.0], [3.0]]
        # a disagreement fails on every rank as Horovod's TF ops do, and the next collective runs
        assert out["root_disagrees"] == "FailedPreconditionError" and out["after_disagreement"] == [2.0]
        assert out["broadcast_global_variables"] == "RuntimeError"  # Horovod's TF1 call, refused when eager
        assert out["global_set"] == [2, 0] and out["process_set"] == [1, rank == 0, True, None]
        assert out["version_check"] == [True, False, "ValueError"]
        assert out["timeline"]
        # the callbacks in fit: the broadcast (layer 0's kernel kept local), the averaged loss, the schedule
        start, initial = out["start"], out["initial"]
        assert start[0] == initial[0] and start[1:] == results[0]["initial"][1:]
        _close(out["rates"], [0.1, 0.1, 0.2, 0.2, 0.1, 0.1, 0.1, 0.1])
        assert out["loss"] == results[0]["loss"] and out["best_saved"]
        assert [out[k] for k in ("no_filepath", "bad_local", "no_initial_lr", "no_steps")] == ["ValueError"] * 4
        _close([out["smooth"], out["warmup"]], [0.15, 0.075])
        printed = "Epoch 1: finished gradual learning rate warmup to 0.075." if rank == 0 else ""
        assert out["warmup_printed"] == printed
        assert out["loaded"] == ["SGD", True, 8] and out["legacy_opts"] == value_error
        # the elastic state in memory, as Horovod's test_elastic_state has it
        other = [[[1.0, 2.0], [3.0, 4.0]], [0.0, 0.0]]
        assert out["synced"] == out["restored"] == [[[[1.0, 1.0], [1.0, 1.0]], [1.0, 1.0]], 20, 10]
        assert out["committed"] == [other, 21, 11]
        assert out["tensorflow_state"] == [[0.0, 3.0], 0] and out["run"] == [[0], {"rank": 0}, 7]
        assert (out["unbuilt"], out["not_plain"]) == ("ValueError", "TypeError")
        assert out["partial"] == "SGD" and out["same_modules"] == [True, True] and out["after_shutdown"] is False


def _said(output: str, what: str) -> list[dict[str, Any]]:
    return [json.loads(m.group(1)) for m in re.finditer(rf"^\[worker \d+\] ELASTIC_{what} (.*)$", output, re.M)]


@pytest.mark.timeout(150)
def test_elastic_keras_job_loses_a_worker_and_goes_on_from_its_last_commit() -> None:
    done = subprocess.run([sys.executable, "-m", "sluice.launch.cli", "launch", *preloads.KERAS,
                           "--elastic", "--min-workers", "2",
                           "-w", "3", "-s", "0", "--", sys.executable, "tests/integration/scripts/elastic_keras.py",
                           "--epochs", "3", "--die-epoch", "1", "--die-batch", "1", "--die-rank", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=140)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    assert re.search(r"worker 2 \(pid \d+\) was killed by SIGKILL.*; dropping worker 2 and re-forming the job",
                     output), output[-4000:]
    assert "[launch] re-forming the job: generation 1 with 2 workers" in output
    starts, (commit,), results = _said(output, "START"), _said(output, "COMMIT"), _said(output, "RESULT")
    first = [s for s in starts if s["generation"] == 0]
    assert len(first) == 3 and len({s["digest"] for s in first}) == 1  # different seeds, rank 0's state
    # the next generation starts where the lost worker's last commit was, with the rate for its size
    for start in (s for s in starts if s["generation"] == 1):
        assert (start["size"], start["epoch"], start["batch"], start["digest"]) == (2, 1, 1, commit["digest"])
        _close(start["lr"], 0.1)
    assert [(r["size"], r["epoch"], r["batch"]) for r in results] == [(2, 3, 0)] * 2
    assert results[0]["digest"] == results[1]["digest"]
    assert_state_dir_removed(output)
