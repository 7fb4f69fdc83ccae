"""A script started by `sluice launch` trains like one process, on the CPU and (where present) on CUDA.

CUDA tensors go through pinned host staging buffers; the CUDA cases skip where no GPU is present.
"""

from __future__ import annotations

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


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("device", "optimizer_on"),
    [("cpu", "server"), pytest.param("cuda", "worker", marks=CUDA), pytest.param("cuda", "server", marks=CUDA)],
)
def test_launched_training_matches_single_process(tmp_path: Path, device: str, optimizer_on: str) -> None:
    steps, batch = 20, 32
    out = tmp_path / "params"
    command = [
        sys.executable, "-m", "sluice.launch.cli", "launch", "-w", "2", "-s", "1",
        "--set", f"worker.optimizer_on={optimizer_on}", "--",
        sys.executable, "-m", "tests.integration.cuda_job", str(out), str(steps), str(batch), device,
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    reference = train_single(steps, batch, "sgd")
    for rank in range(2):
        saved = np.load(f"{out}.{rank}.npz")
        for i, want in enumerate(reference):
            np.testing.assert_allclose(saved[f"p{i}"], want.numpy(), rtol=1e-4, atol=1e-5)
