"""DDP in one line: a plain DDP script under `sluice launch`, with `register_comm_hook(None, sluice.torch.ddp_hook)`
added, trains to the same parameters as plain DDP (gloo), by allreduce and through the servers. Plain DDP, the
reference, runs the script in two processes spawned from the test with torchrun's variables (no Sluice in it)."""

from __future__ import annotations

import faulthandler
import json
import multiprocessing as mp
import os
import subprocess
import sys
import traceback
from pathlib import Path

import numpy as np
import pytest

from tests.integration import preloads
from tests.integration.script_workers import run_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "integration" / "scripts" / "ddp_train.py"

pytestmark = pytest.mark.slow


def _launch(tmp_path: Path, name: str, servers: int, *extra: str) -> list[float]:
    out = tmp_path / f"{name}.json"
    argv = [sys.executable, "-m", "sluice.launch.cli", "launch", *preloads.TORCH,
            "-w", "2", "-s", str(servers), *extra, "--",
            sys.executable, str(SCRIPT), "--out", str(out), "--sluice"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return list(json.loads(out.read_text()))


def _plain_rank(rank: int, port: int, out: str) -> None:
    """A spawned process: rank `rank` of plain DDP, as torchrun would start it."""
    # the store is the agent's, as under torchrun: rank 0 hosting it could exit while rank 1 still tears down
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")
    faulthandler.dump_traceback_later(80)  # a rank that hangs says where before the test kills it
    import torch

    torch.set_num_threads(1)  # as the launcher's OMP_NUM_THREADS for two workers on this machine
    code = 0
    try:
        run_script(str(SCRIPT), "--out", out)
    except BaseException:
        traceback.print_exc()
        code = 1
    os._exit(code)


def _plain(tmp_path: Path) -> list[float]:
    from datetime import timedelta

    from torch._C._distributed_c10d import TCPStore

    out = tmp_path / "plain.json"
    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)
    port = store.port
    # spawned, not forked: a fork of a test process whose torch already started its thread pools can hang
    ranks = [mp.get_context("spawn").Process(target=_plain_rank, args=(rank, port, str(out))) for rank in range(2)]
    for process in ranks:
        process.start()
    ranks[0].join(100)
    ranks[1].join(8 if ranks[0].exitcode == 0 else 1)  # the ranks end their training together
    hung = [p for p in ranks if p.exitcode is None]
    for process in hung:
        process.kill()
        process.join(5)
    del store
    # rank 1 of plain torch DDP has hung twice in the suite (2 of about 10 runs) after rank 0, which wrote the
    # parameters, passed the final barrier and exited: in gloo's teardown, not in the training this compares
    # (its stack: runpy.run_path, no frame of the script). It is waited for 8 s, then let go, and said
    assert ranks[0].exitcode == 0 and (ranks[1].exitcode == 0 or ranks[1] in hung), [p.exitcode for p in ranks]
    if hung:
        print("plain DDP: rank 1 still ran 8 s after rank 0 ended (gloo's teardown); killed", file=sys.stderr)
    return list(json.loads(out.read_text()))


@pytest.mark.timeout(300)
def test_ddp_with_sluices_hook_matches_plain_ddp(tmp_path: Path) -> None:
    plain = _plain(tmp_path)
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
