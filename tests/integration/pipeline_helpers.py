"""The pipeline test script's model trained in one process, and the check that stages' parameters match it."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests/integration/scripts/pipeline_train.py"
_spec = importlib.util.spec_from_file_location("pipeline_train", SCRIPT)
assert _spec is not None and _spec.loader is not None
job = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(job)


def reference_model(steps: int, batch: int, lr: float = 0.1, grow_at: int = -1, width: int = 32) -> torch.nn.Module:
    """The same model trained by one process on the whole batch of each step."""
    torch.set_num_threads(1)
    model = job.make_model(width=width)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        x, y = job.batch(step, batch * (2 if 0 <= grow_at <= step else 1))
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model


def reference(steps: int, batch: int, lr: float = 0.1, grow_at: int = -1, width: int = 32) -> list[np.ndarray]:
    return [p.detach().reshape(-1).numpy() for p in reference_model(steps, batch, lr, grow_at, width).parameters()]


def check_matches(results: list[dict[str, Any]], stages: int, want: list[np.ndarray], tolerance: float = 1e-6) -> None:
    """Every replica's parameters, in the model's order (chunk by chunk, each over the stages: chunk c of
    stage s is virtual stage c * P + s), within `tolerance` of `want`."""
    replicas = len(results) // stages
    for replica in range(replicas):
        mine = sorted((r for r in results if r["replica"] == replica), key=lambda r: r["stage"])
        got = [np.asarray(p, np.float32) for chunk in range(len(mine[0]["params"])) for r in mine
               for p in r["params"][chunk]]
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert float(np.abs(a - b).max()) <= tolerance, float(np.abs(a - b).max())
