"""torchrun's multi-machine command line, `--nnodes 2 --node-rank K --master-addr ... --nproc-per-node 2 train.py`
run once per machine (here two launchers on 127.0.0.1): one job of four workers, and a failure on one machine ends
both launchers, naming the worker."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "integration" / "scripts" / "per_node.py"
pytestmark = pytest.mark.slow


def _launchers(tmp_path: Path, *script_args: str) -> list[subprocess.Popen[str]]:
    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)
    with socket.socket() as probe:  # the rendezvous port, and the workers' MASTER_PORT above it
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return [subprocess.Popen(
        [sys.executable, "-m", "sluice.launch.cli", "launch", "--nnodes", "2", "--node-rank", str(rank),
         "--master-addr", "127.0.0.1", "--master-port", str(port), "--nproc-per-node", "2", "--secret-file",
         str(secret), str(SCRIPT), *script_args],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (1, 0)]  # either may be first


def _finish(launchers: list[subprocess.Popen[str]], timeout: float) -> list[tuple[int, str, str]]:
    ended = []
    try:
        for launcher in launchers:
            out, err = launcher.communicate(timeout=timeout)
            ended.append((launcher.returncode, out, err))
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                launcher.kill()
                launcher.communicate()
    return ended


@pytest.mark.timeout(90)
def test_two_machines_launched_apart_run_one_job_with_torchruns_variables(tmp_path: Path) -> None:
    (code1, out1, err1), (code0, out0, err0) = _finish(_launchers(tmp_path), 60)
    assert code0 == 0 and code1 == 0, (out0 + err0)[-3000:] + (out1 + err1)[-3000:]
    results = sorted(line.split("RESULT ")[1] for line in (out0 + out1).splitlines() if "RESULT " in line)
    # rank, size, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK (machine), Sluice's sum, torch.distributed's sum
    assert results == ["0 4 0 2 0 6.0 6.0", "1 4 1 2 0 6.0 6.0", "2 4 0 2 1 6.0 6.0", "3 4 1 2 1 6.0 6.0"]
    assert "[worker 2] RESULT" in out1 and "[worker 0] RESULT" in out0  # each machine ran its own workers
    assert "[scheduler]" in out0 and "[scheduler]" not in out1


@pytest.mark.timeout(90)
def test_a_worker_failing_on_one_machine_ends_both_launchers_naming_it(tmp_path: Path) -> None:
    started = time.monotonic()
    (code1, _, err1), (code0, out0, err0) = _finish(_launchers(tmp_path, "fail"), 60)
    assert code1 == 1 and "worker 3 (pid " in err1 and "exited with code 1" in err1, err1[-3000:]
    assert "RuntimeError: rank 3 fails on purpose" in err1
    assert code0 != 0, (out0 + err0)[-3000:]  # machine 0's workers lost their peer: the launcher says who
    assert "worker 3" in out0 + err0 and "has left the job" in out0 + err0
    assert time.monotonic() - started < 45
