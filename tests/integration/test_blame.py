"""`sluice launch` names the first cause of a failure first, and a SIGKILLed launcher leaves nothing behind."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from testbed.launch import Launch, _alive, _cmdline, _worker_rank
from testbed.launch import children as started_by

# A worker of a real Sluice job: push_pull until the job fails, or for as many steps as its rank is
# given in argv ("1=3": worker 1 stops after 3 steps and leaves the job); "grandchild" starts a
# subprocess in the worker's process group first.
STEPPER = """
import os, subprocess, sys, time
import numpy as np
from sluice.worker.node import WorkerNode
args = sys.argv[1:]
if "grandchild" in args:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    print("grandchild", child.pid, flush=True)
limits = dict(tuple(map(int, a.split("="))) for a in args if "=" in a)
node = WorkerNode()
client = node.ps
if "allreduce" not in args:
    client.declare([("w", (50000,), "float32", None)])
data, out = np.ones(50000, np.float32), np.zeros(50000, np.float32)
step = 0
while step < limits.get(client.rank, 1 << 30):
    if "allreduce" in args:
        node.collectives.allreduce(f"w.{step}", [data], "float32", "sum").wait()
    else:
        client.push_pull("w", data, out).wait()
    step += 1
    if step == 2:
        print("stepping", os.getpid(), flush=True)
    time.sleep(0.01)  # the machine may have two cores: leave some for the others
node.close()
"""
FAST_HEARTBEATS = ["--set", "scheduler.heartbeat_interval=0.5", "--set", "scheduler.heartbeat_timeout=3"]


@pytest.fixture
def stepper(tmp_path: Path) -> str:
    path = tmp_path / "stepper.py"
    path.write_text(STEPPER)
    return str(path)


def _start(launch: type[Launch], stepper: str, *worker_args: str, workers: int = 2,
           servers: int = 2) -> tuple[Launch, dict[str, int]]:
    """A running job of `workers` workers and `servers` servers; its processes by label ('server 0', 'scheduler')."""
    job = launch(["-w", str(workers), "-s", str(servers), *FAST_HEARTBEATS, "--", sys.executable, stepper,
                  *worker_args])
    for rank in range(workers):
        job.wait_line(rf"^\[worker {rank}\] stepping \d+$", timeout=45)
    found = {}
    for pid in job.snapshot():
        cmdline = _cmdline(pid)
        if "sluice.launch.cli scheduler" in cmdline:
            found["scheduler"] = pid
        elif "sluice.launch.cli server" in cmdline:
            found[f"server {_worker_rank(pid)}"] = pid
    assert len(found) == 1 + servers, found
    return job, found


def _headline(job: Launch) -> str:
    lines = [line for line in job.err if line.startswith("sluice launch: ")]
    assert lines, f"no report; stderr:\n{job.stderr()}"
    return lines[0]


@pytest.mark.timeout(90)
def test_stopped_server_is_named_not_the_scheduler(launch: type[Launch], stepper: str) -> None:
    job, pids = _start(launch, stepper)
    os.kill(pids["server 0"], signal.SIGSTOP)  # alive but silent: the scheduler declares it lost after 3 s
    assert job.finish(30) == 1
    headline = _headline(job)
    assert headline.startswith(f"sluice launch: server 0 (pid {pids['server 0']}) is stopped; "), job.stderr()
    assert "scheduler" in headline and "sent no heartbeat" in headline, headline
    assert "last lines of " in job.stderr()
    job.assert_none_left()


@pytest.mark.timeout(90)
def test_killed_server_is_named(launch: type[Launch], stepper: str) -> None:
    job, pids = _start(launch, stepper)
    os.kill(pids["server 1"], signal.SIGKILL)
    assert job.finish(30) == 1
    assert _headline(job) == (f"sluice launch: server 1 (pid {pids['server 1']}) was killed by SIGKILL "
                              "while workers were still running; stopping the job"), job.stderr()
    job.assert_none_left()


@pytest.mark.timeout(90)
def test_worker_that_left_early_is_named_not_the_one_it_failed(launch: type[Launch], stepper: str) -> None:
    job, _ = _start(launch, stepper, "1=3", workers=3)
    early = int(job.wait_line(r"^\[worker 1\] stepping (\d+)$").group(1))
    assert job.finish(30) == 1
    headline = _headline(job)
    # it exits a moment after its goodbye; on a busy machine the report may find it still closing
    assert re.match(rf"sluice launch: worker 1 \(pid {early}\) (exited with code 0|is still running); server [01] ",
                    headline), job.stderr()
    assert "round 4" in headline and "worker 1 has left the job" in headline, headline
    # the tail shows the worker that failed because of it
    assert re.search(r"^sluice launch: then worker [02] \(pid \d+\) exited with code 1$", job.stderr(), re.M)
    assert "can never complete" in job.stderr().split("last lines of worker", 1)[1]
    job.assert_none_left()


@pytest.mark.timeout(90)
def test_worker_that_left_an_allreduce_job_early_is_named(launch: type[Launch], stepper: str) -> None:
    job, _ = _start(launch, stepper, "1=3", "allreduce", workers=3, servers=0)
    early = int(job.wait_line(r"^\[worker 1\] stepping (\d+)$").group(1))
    assert job.finish(30) == 1
    headline = _headline(job)
    assert re.match(rf"sluice launch: worker 1 \(pid {early}\) (exited with code 0|is still running); worker [02] ",
                    headline), job.stderr()
    assert "allreduce 'w.3' waited for it" in headline and "has left the job" in headline, headline
    job.assert_none_left()


@pytest.mark.timeout(90)
def test_killed_scheduler_is_named(launch: type[Launch], stepper: str) -> None:
    job, pids = _start(launch, stepper)
    os.kill(pids["scheduler"], signal.SIGKILL)
    assert job.finish(30) == 1
    assert _headline(job) == (f"sluice launch: scheduler (pid {pids['scheduler']}) was killed by SIGKILL "
                              "while workers were still running; stopping the job"), job.stderr()
    job.assert_none_left()


def _group_members(groups: set[int]) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _alive(int(entry.name)):
            with contextlib.suppress(OSError, IndexError, ValueError):
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[2]) in groups:
                    found.add(int(entry.name))
    return found


def _segments(pids: set[int]) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if any(n.startswith(f"sluice-{pid}-") for pid in pids)]


@pytest.mark.timeout(90)
def test_killed_launcher_leaves_no_process_and_no_shared_memory(launch: type[Launch], stepper: str) -> None:
    job, _ = _start(launch, stepper, "grandchild")
    grandchildren = {int(job.wait_line(rf"^\[worker {r}\] grandchild (\d+)$").group(1)) for r in range(2)}
    direct = started_by(job.proc.pid)
    janitors = {p for p in direct if "sluice.launch.janitor" in _cmdline(p)}
    children = direct - janitors
    assert len(janitors) == 1 and len(children) == 1 + 2 + 2, [_cmdline(p) for p in direct]
    everything = children | grandchildren | janitors
    assert grandchildren <= _group_members(children)
    assert _segments(children), "the job should use shared memory"
    os.kill(job.proc.pid, signal.SIGKILL)
    job.finish(15)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and (
        _group_members(children) or [p for p in everything if _alive(p)] or _segments(children)
    ):
        time.sleep(0.1)
    assert not _group_members(children), [_cmdline(p) for p in _group_members(children)]
    assert not [p for p in everything if _alive(p)]
    assert not _segments(children), "shared memory left behind"
    while "its janitor killed" not in job.stderr() and time.monotonic() < deadline + 5:
        time.sleep(0.05)  # the janitor's note reaches the test's reader thread a moment after it exits
    assert "its janitor killed 5 process group(s)" in job.stderr()
