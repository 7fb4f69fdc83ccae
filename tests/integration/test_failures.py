"""A job with a lost or misconfigured worker ends with an error that names it, never a silent hang."""

from __future__ import annotations

import os
import re
import signal
import time
from typing import Any

import numpy as np
import pytest

from testbed.cluster import LocalCluster

HEARTBEAT_TIMEOUT = 3.0


def _train_until_stopped(stop_rank: int, stop_after: int) -> dict[str, Any]:
    from sluice.errors import SluiceError
    from sluice.worker.node import WorkerNode

    node = WorkerNode()
    client = node.ps
    client.declare([("w", (1000,), "float32", None)])
    data, out = np.ones(1000, np.float32), np.zeros(1000, np.float32)
    started = time.monotonic()
    try:
        for step in range(10_000):
            if client.rank == stop_rank and step == stop_after:
                os.kill(os.getpid(), signal.SIGSTOP)  # alive but silent: only heartbeats can tell
            client.push_pull("w", data, out).wait()
            started = time.monotonic()
    except SluiceError as exc:
        return {"error": str(exc), "waited": time.monotonic() - started}
    return {"error": None}


@pytest.mark.timeout(60)
def test_silent_worker_is_detected_and_named() -> None:
    config = {"scheduler": {"heartbeat_interval": 0.5, "heartbeat_timeout": HEARTBEAT_TIMEOUT}}
    with LocalCluster(3, 1, config) as cluster:
        results = cluster.start_workers(_train_until_stopped, 1, 5)
        reports = cluster.collect(results, 2, timeout=30)
        for rank in (0, 2):
            status, value = reports[rank]
            assert status == "ok" and value["error"], value
            assert "worker 1" in value["error"] and "heartbeat" in value["error"]
            assert value["waited"] < HEARTBEAT_TIMEOUT + 3.0
        exits = [p.exitcode for p in cluster.processes[:2] if (p.join(10) or True)]
        assert exits == [1, 1], "scheduler and server must exit with an error"


def _declare(shape: tuple[int, ...]) -> str:
    from sluice.errors import SluiceError
    from sluice.worker.node import WorkerNode

    node = WorkerNode()
    client = node.ps
    try:
        client.declare([("a", (4,), "float32", None), ("b", shape if client.rank == 2 else (3, 3), "float32", None)])
    except SluiceError as exc:
        return str(exc)
    return "declared"


@pytest.mark.timeout(60)
def test_mismatched_declaration_names_worker_and_tensor() -> None:
    with LocalCluster(3, 1) as cluster:
        errors = cluster.run(_declare, (3, 4))
    for error in errors:
        assert "worker 2" in error and "'b'" in error and "[3, 4]" in error, error


def _uneven_steps(steps_by_rank: dict[int, int]) -> dict[str, Any]:
    from sluice.errors import SluiceError
    from sluice.worker.node import WorkerNode

    node = WorkerNode()
    client = node.ps
    client.declare([("w", (5000,), "float32", None)])
    data, out = np.ones(5000, np.float32), np.zeros(5000, np.float32)
    done = 0
    try:
        for _ in range(steps_by_rank[client.rank]):
            client.push_pull("w", data, out).wait()
            done += 1
    except SluiceError as exc:
        return {"steps": done, "error": str(exc), "at": time.monotonic()}
    finally:
        node.close()
    return {"steps": done, "error": None, "at": time.monotonic()}


@pytest.mark.timeout(60)
def test_a_worker_that_left_early_fails_the_others_at_once() -> None:
    with LocalCluster(3, 2) as cluster:
        started = time.monotonic()
        results = cluster.run(_uneven_steps, {0: 5, 1: 3, 2: 5})
    assert [r["steps"] for r in results] == [3, 3, 3]
    assert results[1]["error"] is None
    for rank in (0, 2):
        error = results[rank]["error"]
        # worker 0 may leave too before worker 2's last push lands; worker 1 is named first either way
        named = "worker 1 has left the job" in error or "(worker 1 first)" in error
        assert error and named and "round 4" in error, error
        assert results[rank]["at"] - started < 20  # long before the 120 s operation timeout


def _uneven_allreduces(steps_by_rank: dict[int, int]) -> dict[str, Any]:
    """As _uneven_steps, through the collective engine (the default route on one host): sluice.torch's
    allreduce, each step named."""
    import torch

    import sluice.torch as hvd

    hvd.init()
    done = 0
    try:
        for step in range(steps_by_rank[hvd.rank()]):
            hvd.allreduce(torch.ones(5000), name=f"w.{step}")
            done += 1
    except hvd.HorovodInternalError as exc:
        return {"steps": done, "error": str(exc), "at": time.monotonic()}
    finally:
        hvd.shutdown()
    return {"steps": done, "error": None, "at": time.monotonic()}


@pytest.mark.timeout(60)
def test_a_worker_that_left_early_fails_the_others_collectives_at_once_naming_it() -> None:
    with LocalCluster(3, 0) as cluster:
        started = time.monotonic()
        results = cluster.run(_uneven_allreduces, {0: 5, 1: 3, 2: 5})
    assert [r["steps"] for r in results] == [3, 3, 3]
    assert results[1]["error"] is None
    for rank in (0, 2):
        error = results[rank]["error"]
        assert error and "allreduce 'w.3'" in error and re.search(r"worker 1 \(on \S+\) has left the job", error), error
        assert "hvd.join()" in error, error  # what to do about it
        assert results[rank]["at"] - started < 20  # long before the 120 s operation timeout


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)  # as a crash in native code ends a process: no report, no goodbye


@pytest.mark.timeout(30)
def test_workers_that_die_without_a_report_fail_the_test_at_once_with_their_exit_codes() -> None:
    """The harness itself never waits out its timeout for workers that are gone (testbed/cluster.py collect)."""
    with LocalCluster(2, 0) as cluster:
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=re.escape(
                "workers exited without a report: worker 0 (exit code -9), worker 1 (exit code -9)")):
            cluster.run(_die, timeout=60)
        assert time.monotonic() - started < 10
