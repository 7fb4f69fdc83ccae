"""DDP in one line: a plain DDP script under `sluice launch`, with `register_comm_hook(None, sluice.torch.ddp_hook)`
added, trains to the same parameters as plain DDP (gloo), by allreduce and through the servers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "integration" / "scripts" / "ddp_train.py"

pytestmark = pytest.mark.slow


def _launch(tmp_path: Path, name: str, servers: int, *extra: str) -> list[float]:
    out = tmp_path / f"{name}.json"
    argv = [sys.executable, "-m", "sluice.launch.cli", "launch", "-w", "2", "-s", str(servers), *extra, "--",
            sys.executable, str(SCRIPT), "--out", str(out)]
    if name != "plain":
        argv.append("--sluice")
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return list(json.loads(out.read_text()))


@pytest.mark.timeout(300)
def test_ddp_with_sluices_hook_matches_plain_ddp(tmp_path: Path) -> None:
    plain = _launch(tmp_path, "plain", 0)
    by_allreduce = _launch(tmp_path, "allreduce", 0)
    through_servers = _launch(tmp_path, "servers", 1, "--set", "collective.mode=ps")
    np.testing.assert_allclose(by_allreduce, plain, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(through_servers, plain, rtol=1e-5, atol=1e-6)
    assert not np.allclose(plain, _initial())  # it trained


def _initial() -> list[float]:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 4))
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()
