"""`sluice launch` end to end: exit codes, prefixed output, failure reports, and no process left behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testbed.launch import Launch, _alive, _cmdline, _worker_rank
from testbed.launch import children as started_by

ROOT = Path(__file__).resolve().parents[2]

# A worker that does not use Sluice: it starts a grandchild (which shares its stdout), prints both
# pids, then behaves as its first argument says.
WORKER = """
import os, subprocess, sys, time
mode, rank = sys.argv[1], int(os.environ["SLUICE_RANK"])
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print("pids", os.getpid(), child.pid, flush=True)
if mode == "exit0":
    print("bye from", rank, flush=True)
    sys.exit(0)
if mode == "exit3" and rank == 0:
    time.sleep(0.5)
    sys.exit(3)
time.sleep(60)
"""

# A worker of a real Sluice job: every worker adds rank + 1 into one tensor.
SLUICE_WORKER = """
import os
import numpy as np
from sluice.worker.node import WorkerNode
node = WorkerNode()
client = node.ps
fd = int(os.environ["SLUICE_SECRET_FD"])  # the job secret came through this pipe: read once, then closed
try:
    what = os.readlink(f"/proc/self/fd/{fd}")  # the number may be reused since, but not by a pipe
except OSError:
    what = "closed"
print("secret pipe", "still open" if what.startswith("pipe:") else "closed", flush=True)
print("secret in environ:", [k for k in os.environ if "SECRET" in k and k != "SLUICE_SECRET_FD"], flush=True)
print("curve", node.settings.curve, flush=True)
client.declare([("w", (1000,), "float32", None)])
out = np.zeros(1000, np.float32)
client.push_pull("w", np.full(1000, client.rank + 1, np.float32), out).wait()
print("sum", out[0], flush=True)
node.close()
"""


@pytest.fixture
def worker_script(tmp_path: Path) -> str:
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return str(path)


def _job(workers: int, servers: int, *extra: str) -> list[str]:
    return ["-w", str(workers), "-s", str(servers), *extra]


#: each worker started afresh, or forked from the preloader (launch/preload.py): the launcher must not tell apart
STARTS = pytest.mark.parametrize("start", [[], ["--preload", "sluice.worker.node"]], ids=["exec", "preload"])


@pytest.mark.timeout(60)
@STARTS
def test_workers_exit_zero(launch: type[Launch], worker_script: str, start: list[str]) -> None:
    job = launch([*_job(2, 1, "--grace", "1", "--set", "transport.aging_ms=900", *start), "--", sys.executable,
                  worker_script, "exit0"])
    job.worker_pids(2)
    job.snapshot()
    assert job.finish(30) == 0, job.stderr()
    out = job.stdout()
    assert "[worker 0] bye from 0" in out and "[worker 1] bye from 1" in out
    # the keys set, with where from, printed at start; not the defaults
    assert "[launch] transport.aging_ms = 900.0  # from --set transport.aging_ms=900" in out
    assert "transport.chunk_bytes" not in out
    assert re.search(r"^\[scheduler\] SLUICE_SCHEDULER_READY tcp://127\.0\.0\.1:\d+$", out, re.M)
    # these workers never register, so the scheduler waits for them until stopped after the grace
    assert "[launch] stopping scheduler" in out
    job.assert_none_left()


@pytest.mark.timeout(60)
@STARTS
def test_real_job_ends_by_itself(launch: type[Launch], tmp_path: Path, start: list[str]) -> None:
    script = tmp_path / "train.py"
    script.write_text(SLUICE_WORKER)
    job = launch([*_job(2, 2, *start), "--", sys.executable, str(script)])
    assert job.finish(45) == 0, job.stderr()
    out = job.stdout()
    assert "[worker 0] sum 3.0" in out and "[worker 1] sum 3.0" in out
    assert "stopping" not in out, out  # scheduler and servers left by themselves
    # CURVE was on, and the secret reached the workers only through the pipe, which is closed after use
    assert "[worker 0] curve True" in out and "[worker 1] curve True" in out
    assert out.count("secret pipe closed") == 2 and "secret in environ: []" in out


@pytest.mark.timeout(60)
@STARTS
def test_killed_worker_ends_the_job(launch: type[Launch], worker_script: str, start: list[str]) -> None:
    job = launch([*_job(3, 2, *start), "--", sys.executable, worker_script, "sleep"])
    pids = job.worker_pids(3)
    assert len(job.snapshot()) >= 1 + 2 + 3 * 2
    victim = pids[1][0]
    os.kill(victim, signal.SIGKILL)
    code = job.finish(15)
    assert code != 0
    assert f"worker 1 (pid {victim}) was killed by SIGKILL" in job.stderr()
    assert "pids" in job.stderr()  # its last lines
    job.assert_none_left()


@pytest.mark.timeout(60)
@STARTS
def test_worker_exit_code_is_returned(launch: type[Launch], worker_script: str, start: list[str]) -> None:
    job = launch([*_job(2, 1, *start), "--", sys.executable, worker_script, "exit3"])
    pids = job.worker_pids(2)
    job.snapshot()
    assert job.finish(15) == 3
    assert f"worker 0 (pid {pids[0][0]}) exited with code 3" in job.stderr()
    job.assert_none_left()


@pytest.mark.timeout(60)
def test_dead_server_ends_the_job(launch: type[Launch], worker_script: str) -> None:
    job = launch([*_job(2, 2), "--", sys.executable, worker_script, "sleep"])
    job.worker_pids(2)
    servers = [p for p in job.snapshot() if "sluice.launch.cli server" in _cmdline(p)]
    assert len(servers) == 2
    os.kill(servers[0], signal.SIGKILL)
    assert job.finish(15) == 1
    assert re.search(r"server [01] \(pid \d+\) was killed by SIGKILL while workers were still running",
                     job.stderr())
    job.assert_none_left()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("sig", "expected"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_stops_everything(launch: type[Launch], worker_script: str, sig: int, expected: int) -> None:
    job = launch([*_job(2, 1), "--", sys.executable, worker_script, "sleep"])
    job.worker_pids(2)
    job.snapshot()
    os.kill(job.proc.pid, sig)
    assert job.finish(10) == expected
    assert f"received {signal.Signals(sig).name}" in job.stderr()
    job.assert_none_left()


@pytest.mark.timeout(60)
@STARTS
def test_killed_launcher_takes_its_children(launch: type[Launch], worker_script: str, start: list[str]) -> None:
    job = launch([*_job(2, 1, *start), "--", sys.executable, worker_script, "sleep"])
    pids = job.worker_pids(2)
    grandchildren = {pair[1] for pair in pids.values()}
    direct = {p for p in started_by(job.proc.pid) if "sluice.launch.janitor" not in _cmdline(p)}
    if start:  # the workers are the preloader's children, which dies with the launcher, and they with it
        assert len(direct) == 1 + 1 + 1 and not {pair[0] for pair in pids.values()} & direct
        direct |= {pair[0] for pair in pids.values()}
    assert len(direct) == 1 + 1 + 2 + (1 if start else 0)
    os.kill(job.proc.pid, signal.SIGKILL)
    job.finish(10)
    # the kernel's parent-death signal reaches the direct children; their own children, in their
    # process groups, are killed by the launcher's janitor (launch/janitor.py)
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in direct | grandchildren) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in direct | grandchildren if _alive(p)]


@pytest.mark.timeout(60)
def test_config_error_exits_2(launch: type[Launch]) -> None:
    job = launch([*_job(1, 1, "--set", "transport.channels=99"), "--", sys.executable, "-c", "pass"])
    assert job.finish(30) == 2
    assert "sluice: error: invalid [transport] settings: transport.channels must be 1..8" in job.stderr()


@pytest.mark.timeout(30)
def test_role_without_environment_fails_clearly() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    result = subprocess.run([sys.executable, "-m", "sluice.launch.cli", "server"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=20)
    assert result.returncode == 1
    assert "sluice server: error: SLUICE_SCHEDULER is not set" in result.stderr


@pytest.mark.timeout(90)
def test_worker_killed_mid_training_ends_the_job_within_15_s(launch: type[Launch]) -> None:
    demo = str(ROOT / "examples" / "train_digits.py")
    job = launch([*_job(3, 2), "--", sys.executable, demo, "--epochs", "200"])
    job.wait_line(r"^\[worker 0\] epoch  1 ", timeout=60)
    pids = job.snapshot()
    victim = next(p for p in pids if "train_digits.py" in _cmdline(p) and _worker_rank(p) == 2)
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    code = job.finish(15)
    assert code != 0 and time.monotonic() - killed_at < 15
    assert f"worker 2 (pid {victim}) was killed by SIGKILL" in job.stderr()
    job.assert_none_left()
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"sluice-{victim}-")], "shared memory left behind"
