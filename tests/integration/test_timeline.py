"""The timeline: `sluice launch --timeline PATH` writes one valid Chrome trace whose events match what the run
did, per tensor and step in order; `hvd.start_timeline` writes each calling rank's own file."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from testbed.cluster import LocalCluster
from tests.integration import prefork, preloads

prefork.torch_workers()  # once here, not in each forked worker

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
PHASES = ["READY", "NEGOTIATE", "ALLREDUCE", "QUEUE", "PUSH", "SERVER", "SUM", "PULL", "APPLY"]


def _tracks(events: list[dict[str, Any]]) -> dict[tuple[int, int], str]:
    return {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}


@pytest.mark.timeout(150)
def test_launch_timeline_records_every_tensor_and_step_in_order(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    done = subprocess.run(
        [sys.executable, "-m", "sluice.launch.cli", "launch", *preloads.TORCH,
         "-w", "2", "-s", "2", "--timeline", str(path),
         "--set", "collective.mode=ps", "--set", "collective.fusion_bytes=65536", "--",
         sys.executable, str(ROOT / "examples" / "train_digits.py"), "--epochs", "1", "--target", "0"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"events in {path}" in done.stdout
    assert not Path(str(path) + ".parts").exists()  # merged, and the parts removed
    events = json.loads(path.read_text())  # valid JSON, a list of events
    names = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert names == {"worker 0", "worker 1", "server 0", "server 1"}
    tracks = _tracks(events)
    rounds: dict[tuple[str, str, int], list[dict[str, Any]]] = defaultdict(list)
    for event in events:
        if event.get("ph") in ("X", "i"):
            rounds[(str(event["pid"]), tracks[(event["pid"], event["tid"])], event["args"].get("step", -1))].append(
                event)
    groups = {track for (_, track, _) in rounds if track.startswith("fusion.ps.")}
    assert len(groups) >= 2  # the model's gradients travel in several fused groups
    params = {track for (_, track, _), slices in rounds.items() if any(e["name"] == "READY" for e in slices)}
    assert params == {f"{layer}.{kind}" for layer in (0, 2, 6, 8) for kind in ("weight", "bias")}  # the CNN
    steps = {step for (_, track, step) in rounds if track in groups}
    for (_, track, step), slices in rounds.items():
        kinds = [e["name"] for e in sorted(slices, key=lambda e: (e["ts"], PHASES.index(e["name"])))]
        if track in groups and "SUM" not in kinds:  # a worker's round: the four phases, back to back
            assert kinds == ["QUEUE", "PUSH", "SERVER", "PULL"], (track, step, kinds)
            ordered = sorted(slices, key=lambda e: e["ts"])
            for before, after in itertools.pairwise(ordered):
                assert after["ts"] >= before["ts"] + before["dur"] - 2.0  # each starts as the last ends (us)
            assert all(e["args"]["channel"] >= 0 and e["args"]["priority"] >= 0 for e in slices)
        elif track in params:  # a parameter's gradient: ready, then applied
            assert kinds == ["READY", "APPLY"], (track, step, kinds)
    for track in groups:  # every worker's every step has its round, and each server summed its chunks
        for step in steps:
            workers = [rounds[(p, track, step)] for p in {pid for (pid, t, s) in rounds if t == track and s == step}]
            sums = [e for slices in workers for e in slices if e["name"] == "SUM"]
            pulls = [e for slices in workers for e in slices if e["name"] == "PULL"]
            assert len(pulls) == 2 and sums, (track, step)
            assert max(s["ts"] + s["dur"] for s in sums) <= max(p["ts"] + p["dur"] for p in pulls) + 1.0


def _record(path: str) -> int:
    import torch

    import sluice.torch as hvd

    hvd.init()
    hvd.start_timeline(path)
    for step in range(3):
        hvd.allreduce(torch.ones(10) * step, name="metric")
    hvd.stop_timeline()
    return hvd.rank()


def test_start_timeline_writes_each_ranks_file(tmp_path: Path) -> None:
    with LocalCluster(2, 0) as cluster:
        cluster.run(_record, str(tmp_path / "tl.json"))
    for name in ("tl.json", "tl.rank1.json"):
        events = json.loads((tmp_path / name).read_text())
        allreduces = [e for e in events if e.get("name") == "ALLREDUCE"]
        negotiations = [e for e in events if e.get("name") == "NEGOTIATE"]
        assert len(allreduces) == len(negotiations) == 3
        assert {_tracks(events)[(e["pid"], e["tid"])] for e in allreduces} == {"metric"}
