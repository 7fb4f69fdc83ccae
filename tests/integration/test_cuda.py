"""A script started by `sluice launch` trains like one process, on the CPU and (where present) on CUDA.

CUDA gradients stay on the device, each group's share copied to pinned host memory on a side stream
(worker/torch/device_hierarchy.py), or with collective.local_group = "sluice" all of them staged; the
other ops stage through pinned host memory. The CUDA cases skip where no GPU is present.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.integration.training import train_single

ROOT = Path(__file__).resolve().parents[2]


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


def _launch(tmp_path: Path, job: list[str], sets: list[str], workers: int = 2, servers: int = 1,
            timeline: Path | None = None) -> Path:
    """Run `python -m tests.integration.cuda_job OUT *job` on `workers` workers; OUT, its files' prefix."""
    out = tmp_path / "out"
    command = [sys.executable, "-m", "sluice.launch.cli", "launch", "-w", str(workers), "-s", str(servers)]
    for setting in sets:
        command += ["--set", setting]
    if timeline is not None:
        command += ["--timeline", str(timeline)]
    command += ["--", sys.executable, "-m", "tests.integration.cuda_job", str(out), *job]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def _matches_single_process(out: Path, steps: int, batch: int, workers: int = 2) -> list[dict[str, int]]:
    reference = train_single(steps, batch, "sgd")
    for rank in range(workers):
        saved = np.load(f"{out}.{rank}.npz")
        for i, want in enumerate(reference):
            np.testing.assert_allclose(saved[f"p{i}"], want.numpy(), rtol=1e-4, atol=1e-5)
    return [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in range(workers)]


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("device", "optimizer_on", "local_group"),
    [("cpu", "server", "auto"), pytest.param("cuda", "worker", "auto", marks=CUDA),
     pytest.param("cuda", "worker", "sluice", marks=CUDA), pytest.param("cuda", "server", "auto", marks=CUDA)],
)
def test_launched_training_matches_single_process(tmp_path: Path, device: str, optimizer_on: str,
                                                  local_group: str) -> None:
    steps, batch = 20, 32
    out = _launch(tmp_path, [str(steps), str(batch), device],
                  [f"worker.optimizer_on={optimizer_on}", f"collective.local_group={local_group}"])
    seen = _matches_single_process(out, steps, batch)
    # fused gradients on the device stay there (device-resident) unless told to stage in host memory
    resident = device == "cuda" and optimizer_on == "worker" and local_group == "auto"
    assert all((s["device_resident"] >= steps) == resident for s in seen), seen


@pytest.mark.timeout(180)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_local_group_gradients_stay_on_the_device_and_leave_during_backward(tmp_path: Path, device: str) -> None:
    """Two workers on one GPU, as two hosts would be (a local group of one each: NCCL puts no two ranks on one
    device): each fused group leaves the device on the side stream while backward still runs. On the CPU the
    same path (collective.local_group = "torch"), its copies made by the path's thread."""
    steps, batch, timeline = 20, 32, tmp_path / "trace.json"
    sets = ["collective.fusion_bytes=256"] + (["collective.local_group=torch"] if device == "cpu" else [])
    out = _launch(tmp_path, [str(steps), str(batch), device], sets, servers=0, timeline=timeline)
    seen = _matches_single_process(out, steps, batch)
    assert all(s["device_resident"] >= steps and (s["nccl_built"] > 0) == (device == "cuda") for s in seen), seen
    events = json.loads(timeline.read_text())
    for pid in {e["pid"] for e in events if e.get("name") == "process_name" and "worker" in e["args"]["name"]}:
        copies = sorted(e["ts"] for e in events if e["pid"] == pid and e.get("name") == "D2H")
        ready = sorted(e["ts"] for e in events if e["pid"] == pid and e.get("name") == "READY")
        assert len(copies) >= steps and ready
        # a copy out started before backward's last gradient of its step was ready: overlapped, not after
        assert any(any(c < r < c + 0.05e6 for r in ready) for c in copies), (copies[:5], ready[:5])


def expected_ops(rank: int, size: int) -> dict[str, list[float]]:
    """What cuda_job's `ops` must give on `rank` of `size` (x = arange(6) * (rank + 1) on each)."""
    x = [float(i) for i in range(6)]
    total = size * (size + 1) / 2
    return {
        "sum": [v * total for v in x], "average": [v * total / size for v in x], "min": x,
        "max": [v * size for v in x], "large": [total] * 4,
        "grouped": [v * total for v in x] + [2 * v * total for v in x], "in_place": [v * total for v in x],
        "allgather": [v * (r + 1) for r in range(size) for v in x[: r + 1]],
        "broadcast": [v * size for v in x],
        "alltoall": [float(2 * rank + i + 100 * s) for s in range(size) for i in range(2)],
        "reducescatter": [v * total for v in x[2 * rank: 2 * rank + 2]],
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_local_group_horovod_ops_on_device_tensors_give_device_tensors(tmp_path: Path, device: str) -> None:
    """Every Horovod op on the device's tensors: its result on that device, equal to the CPU arithmetic."""
    out = _launch(tmp_path, [device, "ops"], [], servers=0)
    for rank in range(2):
        got = json.loads(Path(f"{out}.{rank}.json").read_text())
        assert got["devices"] == [device]
        assert got["values"] == expected_ops(rank, 2), rank
