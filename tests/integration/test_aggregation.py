"""Training through aggregation trees matches one process, across switches of trees too; a lost aggregator is named."""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from testbed.cluster import LocalCluster
from tests.integration import prefork
from tests.integration.training import train_distributed, train_single

STEPS, BATCH = 20, 32
#: with small chunks, the in-flight bound is set too: calibrating it with probes of a few KiB takes seconds
INFLIGHT = 4 << 20
ROOT = Path(__file__).resolve().parents[2]
prefork.torch_optimizers()  # once here, not in every forked worker

#: two weighted trees over 4 workers: racks {0, 1} and {2, 3}, each aggregating in one tree and
#: pushing straight to the servers in the other
TWO_LEVEL = [
    "0.6: worker-0>aggregator-0 worker-1>aggregator-0 worker-2>aggregator-1 worker-3>aggregator-1",
    "0.4: worker-0>aggregator-0 worker-1>aggregator-0",
]
#: a three-level tree: workers 2 and 3 under aggregator 1, which sits under aggregator 0 with workers 0 and 1
THREE_LEVEL = ["1: worker-0>aggregator-0 worker-1>aggregator-0 worker-2>aggregator-1 worker-3>aggregator-1 "
               "aggregator-1>aggregator-0"]
#: two sets the scheduler rotates through during the run (a re-plan every replan_s seconds)
ROTATING = [f"@0 {tree}" for tree in TWO_LEVEL] + [f"@1 {THREE_LEVEL[0]}"]


class CountRoutedPushes:
    """Hooks for train_distributed: how many pushes this worker sent up a tree."""

    def __init__(self, pause: float = 0.02) -> None:
        self.pause = pause

    def before_broadcast(self) -> None: ...

    def before_step(self) -> None:
        time.sleep(self.pause)  # with the rotating trees: let several switches land inside the run

    def finish(self) -> Any:
        from sluice.worker.torch.state import STATE

        assert STATE.node is not None
        return {"routed": STATE.node.ps._router.routed, "epoch": STATE.node.ps._router.epoch}


def _aggregation(trees: list[str], replan_s: float = 0.0) -> dict[str, Any]:
    return {"mode": "static", "trees": trees, "replan_s": replan_s}


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("optimizer_on", "optimizer", "trees", "replan_s"),
    [
        ("worker", "sgd", TWO_LEVEL, 0.0),
        ("worker", "adam", THREE_LEVEL, 0.0),
        ("server", "adam", TWO_LEVEL, 0.0),  # the servers' optimizer settings travel up the tree
        ("worker", "sgd", ROTATING, 0.15),  # re-planned again and again while training
        ("server", "sgd", ROTATING, 0.15),
    ],
)
def test_training_through_aggregation_trees_matches_single_process(
    optimizer_on: str, optimizer: str, trees: list[str], replan_s: float
) -> None:
    reference = train_single(STEPS, BATCH, optimizer)
    config = {"worker": {"optimizer_on": optimizer_on}, "collective": {"mode": "ps", "fusion_bytes": 256},
              "transport": {"chunk_bytes": 4096, "inflight_bytes": INFLIGHT},
              "aggregation": _aggregation(trees, replan_s)}
    with LocalCluster(4, 2, config, aggregators=2) as cluster:
        # rotating trees: 20 steps of 0.05 s or more, about 7 re-plans (a switch every 0.15 s) while training
        hooks = functools.partial(CountRoutedPushes, 0.05 if replan_s else 0.02)
        results = cluster.run(train_distributed, STEPS, BATCH, optimizer, hooks, timeout=120)
        assert cluster.wait() == [0] * (1 + 2 + 2 + 4)
    for other in results[1:]:
        assert other["digests"] == results[0]["digests"], "workers diverged after some step"
    for got, want in zip(results[0]["params"], reference, strict=True):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-6)
    assert all(r["extra"]["routed"] >= STEPS for r in results), [r["extra"] for r in results]  # one or more a step
    if replan_s:  # switched to new trees several times while training
        assert all(r["extra"]["epoch"] >= 3 for r in results), [r["extra"] for r in results]


def _push_pull_rounds(rounds: int, pause: float, progress: Any = None) -> list[float]:
    """`progress`: a shared counter (multiprocessing.Value) of the rounds every worker completed."""
    from sluice.worker.node import WorkerNode

    node = WorkerNode()
    client = node.ps
    client.declare([("grad", (50_000,), "float32", None)])
    sums = []
    try:
        for step in range(rounds):
            out = np.zeros(50_000, np.float32)
            client.push_pull("grad", np.full(50_000, client.rank + step, np.float32), out).wait()
            sums.append(float(out[0]))
            if progress is not None:
                with progress.get_lock():
                    progress.value += 1
            time.sleep(pause)
    finally:
        node.close()
    return sums


def _rounds_with_queues(rounds: int) -> tuple[list[float], int]:
    """Rounds of a tensor of many chunks behind a one-chunk credit, so that pushes wait in the send queues when
    new trees are announced: the sums, and how many switches moved pushes of this worker's rounds in flight."""
    from sluice.worker.node import WorkerNode

    node = WorkerNode()
    client = node.ps
    client.declare([("grad", (400_000,), "float32", None)])
    sums = []
    try:
        for step in range(rounds):
            out = np.zeros(400_000, np.float32)
            client.push_pull("grad", np.full(400_000, client.rank + step, np.float32), out).wait()
            assert np.all(out == out[0]), f"round {step}: chunks summed differently"
            sums.append(float(out[0]))
    finally:
        node.close()
    return sums, len(client._router.moved_at)


@pytest.mark.timeout(90)
def test_pushes_moved_onto_new_trees_inside_a_round_are_summed_once() -> None:
    # 100 chunks a round, one in flight per peer: at ROUTES most still wait in the queues, and whole groups of
    # workers move theirs onto the new trees (worker/midround.py); every round must still sum every worker once
    config = {"transport": {"chunk_bytes": 16384, "inflight_bytes": 16384},
              "aggregation": _aggregation(ROTATING, 0.05)}
    with LocalCluster(4, 1, config, aggregators=2) as cluster:
        results = cluster.run(_rounds_with_queues, 30, timeout=60)
        assert cluster.wait() == [0] * (1 + 1 + 2 + 4)
    want = [float(sum(range(4)) + 4 * step) for step in range(30)]
    assert [sums for sums, _ in results] == [want] * 4
    assert sum(moved for _, moved in results) >= 1, results  # some switch moved pushes inside a round


@pytest.mark.timeout(90)
def test_numpy_rounds_through_a_three_level_tree_sum_every_worker_once() -> None:
    config = {"transport": {"chunk_bytes": 16384, "inflight_bytes": INFLIGHT},
              "aggregation": _aggregation(ROTATING, 0.05)}
    with LocalCluster(4, 1, config, aggregators=2) as cluster:
        results = cluster.run(_push_pull_rounds, 40, 0.01, timeout=60)
        assert cluster.wait() == [0] * (1 + 1 + 2 + 4)
    want = [float(sum(range(4)) + 4 * step) for step in range(40)]
    assert results == [want] * 4  # every round summed every worker exactly once, across the switches


@pytest.mark.timeout(90)
def test_a_killed_aggregator_fails_the_job_naming_it_within_the_heartbeat_bound() -> None:
    config = {"scheduler": {"heartbeat_interval": 0.2, "heartbeat_timeout": 2.0},
              "aggregation": _aggregation(TWO_LEVEL)}
    progress = mp.get_context("fork").Value("i", 0)
    with LocalCluster(4, 1, config, aggregators=2) as cluster:
        reports = cluster.start_workers(_push_pull_rounds, 10_000, 0.01, progress)
        deadline = time.monotonic() + 30
        while progress.value < 4 * 25 and time.monotonic() < deadline:  # training through the trees
            time.sleep(0.05)
        assert progress.value >= 4 * 25, f"{progress.value} rounds in 30 s"
        victim = cluster.aggregator_processes[1]
        killed_at = time.monotonic()
        os.kill(victim.pid, signal.SIGKILL)
        failures = cluster.collect(reports, 4, timeout=30)
        took = time.monotonic() - killed_at
        codes = cluster.wait(timeout=20)
    assert took < 2.0 + 5.0, f"the loss took {took:.1f} s to end the job"
    for status, error in failures.values():
        assert status == "error" and "aggregator 1" in error and "lost" in error, error
    assert all(code is not None for code in codes), "a process of the job is still running"


@pytest.mark.timeout(120)
def test_sluice_launch_starts_aggregators_and_the_job_trains_through_them(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(
        "import numpy as np\n"
        "from sluice.worker.node import WorkerNode\n"
        "node = WorkerNode()\n"
        "c = node.ps\n"
        "c.declare([('g', (1000,), 'float32', None)])\n"
        "for step in range(5):\n"
        "    out = np.zeros(1000, np.float32)\n"
        "    c.push_pull('g', np.ones(1000, np.float32), out).wait()\n"
        "    assert out[0] == 2.0, out[0]\n"
        "print('routed', c._router.routed, flush=True)\n"
        "node.close()\n"
    )
    trees = "1: worker-0>aggregator-0 worker-1>aggregator-0"
    done = subprocess.run(
        [sys.executable, "-m", "sluice.launch.cli", "launch", "-w", "2", "-s", "1", "-a", "1",
         "--set", "aggregation.mode=static", "--set", f"aggregation.trees={trees}", "--", sys.executable, str(script)],
        cwd=ROOT, capture_output=True, text=True, timeout=100, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[aggregator 0]" in done.stdout
    routed = [int(line.rsplit(" ", 1)[1]) for line in done.stdout.splitlines() if "routed" in line]
    assert len(routed) == 2 and all(r > 0 for r in routed), done.stdout[-2000:]


def _rounds_once_planned(rounds: int) -> dict[str, Any]:
    from sluice.worker.node import WorkerNode

    node = WorkerNode()
    client = node.ps
    client.declare([("grad", (20_000,), "float32", None), ("planned", (1,), "int32", None)])
    deadline = time.monotonic() + 30
    sums: list[float] = []
    planned = np.zeros(1, np.int32)
    while planned[0] < client.size:  # every worker counts the same votes, so all run the same rounds
        out = np.zeros(20_000, np.float32)
        client.push_pull("grad", np.full(20_000, client.rank + 1, np.float32), out).wait()
        sums.append(float(out[0]))
        vote = client._router.epoch >= 1 or time.monotonic() > deadline  # (the assertions name a missing plan)
        client.push_pull("planned", np.array([vote], np.int32), planned).wait()
    for _ in range(rounds):  # with the plan in force on every worker
        out = np.zeros(20_000, np.float32)
        client.push_pull("grad", np.full(20_000, client.rank + 1, np.float32), out).wait()
        sums.append(float(out[0]))
    routed, epoch = client._router.routed, client._router.epoch
    node.close()
    return {"sums": sums, "routed": routed, "epoch": epoch}


@pytest.mark.timeout(90)
def test_the_network_manager_plans_trees_from_the_racks_and_the_job_uses_them() -> None:
    racks = ["r0: worker-0+aggregator-0 worker-1+aggregator-1", "r1: worker-2+aggregator-2 worker-3+aggregator-3",
             "srv: server-0 server-1"]
    config = {"aggregation": {"mode": "plan", "racks": racks, "link_mbit": 100.0, "uplink_mbit": 50.0,
                              "uplinks": ["srv: 1000"], "time_limit": 2.0}}
    with LocalCluster(4, 2, config, aggregators=4) as cluster:
        results = cluster.run(_rounds_once_planned, 10, timeout=60)
        assert cluster.wait() == [0] * (1 + 2 + 4 + 4)
    for result in results:
        assert set(result["sums"]) == {10.0}  # 1 + 2 + 3 + 4, before and after the plan took over
        assert result["epoch"] == 1 and result["routed"] > 0, result
