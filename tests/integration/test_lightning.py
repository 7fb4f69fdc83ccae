"""examples/train_lightning.py under `sluice launch -w 2 -s 1`: Lightning's Trainer with SluiceStrategy trains, the
ranks end with the same parameters, the loss falls, and only rank 0 speaks for the Trainer. The gradients go
through the server (collective.mode = "ps": a model this small would go by allreduce otherwise)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration import preloads

# found, not imported: importing Lightning would cost every test process that collects this module seconds
pytestmark = pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                                reason="Lightning is not installed: pip install 'sluice-ps[lightning]'")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_lightning_example_trains_under_sluice_launch(tmp_path: Path) -> None:
    out = tmp_path / "lightning"
    argv = [sys.executable, "-m", "sluice.launch.cli", "launch", *preloads.LIGHTNING,
            "-w", "2", "-s", "1", "--set", "collective.mode=ps",
            "--", sys.executable, str(ROOT / "examples" / "train_lightning.py"), "--epochs", "3", "--out", str(out)]
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads(out.with_name(f"{out.name}.rank{rank}.json").read_text()) for rank in range(2)]
    for rank, record in enumerate(records):
        assert (record["rank"], record["size"]) == (rank, 2)
        assert record["all_params"] == [records[0]["params"]] * 2  # every rank holds the same model
        losses = record["losses"]
        assert len(losses) == 3 and losses[-1] < losses[0] / 2, losses
    assert records[0]["losses"] == records[1]["losses"]  # logged with sync_dist: the mean over the ranks
    assert "[worker 0] GPU available" in done.stdout and "[worker 1] GPU available" not in done.stdout
