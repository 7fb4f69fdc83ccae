"""The SLURM test bed works: srun, salloc and sbatch run tasks, srun forwards stdin; what a killed srun leaves."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.integration.slurm_bed import SlurmBed

# A task that reads one line (the launcher's JSON header), answers, then reports when its stdin ends.
READ_HEADER = "import sys; print('got', input(), flush=True); print('eof after', len(sys.stdin.read()), flush=True)"
# A task that prints its pid and job id, then sleeps: the tests kill srun and watch what becomes of it.
SLEEPER = 'echo "$$ $SLURM_JOB_ID"; exec sleep 300'


class Lines:
    """The stdout of a running client, line by line, each read with a deadline."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.thread = threading.Thread(target=self._pump, args=(proc,), daemon=True)
        self.thread.start()

    def _pump(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def next(self, timeout: float) -> str:
        line = self.lines.get(timeout=timeout)
        assert line is not None, "the client closed its stdout early"
        return line


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _gone_within(pid: int, deadline_s: float) -> float | None:
    """Seconds until pid ended, or None if it still runs after deadline_s."""
    start = time.monotonic()
    while time.monotonic() - start < deadline_s:
        if not _alive(pid):
            return time.monotonic() - start
        time.sleep(0.01)
    return None


def _start_sleeper(slurm: SlurmBed) -> tuple[subprocess.Popen[str], int, str]:
    srun = subprocess.Popen(["srun", "-N1", "-n1", "sh", "-c", SLEEPER], env=slurm.env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    pid, job = Lines(srun).next(timeout=30).split()
    assert _alive(int(pid)), f"task {pid} of job {job} is not running"
    return srun, int(pid), job


@pytest.mark.timeout(90)
def test_slurm_bed_runs_tasks(slurm: SlurmBed) -> None:
    hosts = slurm.run(["srun", "-N1", "-n2", "hostname"], timeout=30).stdout.split()
    assert len(hosts) == 2 and len(set(hosts)) == 1, hosts

    out = slurm.root / "batch.out"
    slurm.run(["sbatch", "--wait", "-N1", "-n1", f"--output={out}", "--wrap", "echo batch ran on $SLURMD_NODENAME"],
              timeout=30)
    assert out.read_text().strip() == f"batch ran on {slurm.node}"

    task_env = slurm.run(["salloc", "-N1", "-n3", "srun", "-n1", "env"], timeout=30).stdout
    seen = dict(line.split("=", 1) for line in task_env.splitlines() if line.startswith("SLURM"))
    print("\n".join(f"{k}={v}" for k, v in sorted(seen.items())))
    assert seen["SLURM_JOB_NODELIST"] == slurm.node and seen["SLURM_JOB_CPUS_PER_NODE"] == "3"
    assert seen["SLURM_PROCID"] == "0" and seen["SLURM_NTASKS"] == "1"

    alloc_env = slurm.run(["salloc", "-N1", "-n3", "env"], timeout=30).stdout
    seen = dict(line.split("=", 1) for line in alloc_env.splitlines() if line.startswith("SLURM"))
    assert seen["SLURM_TASKS_PER_NODE"] == "3" and seen["SLURM_NTASKS"] == "3", seen


@pytest.mark.timeout(90)
def test_slurm_srun_forwards_stdin(slurm: SlurmBed) -> None:
    assert slurm.run(["srun", "-N1", "-n1", "cat"], timeout=30, input="hello\n").stdout == "hello\n"
    # srun gives its stdin to every task unless told --input=0: a header meant for one rank reaches all of them
    both = slurm.run(["srun", "-N1", "-n2", "-l", "cat"], timeout=30, input="hi\n").stdout
    assert sorted(both.splitlines()) == ["0: hi", "1: hi"], both
    one = slurm.run(["srun", "-N1", "-n2", "-l", "--input=0", "cat"], timeout=30, input="hi\n").stdout
    assert one.splitlines() == ["0: hi"], one

    # the header line must arrive while srun's stdin is still open, and closing it must end the task's stdin
    srun = subprocess.Popen(["srun", "-N1", "-n1", sys.executable, "-c", READ_HEADER], env=slurm.env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert srun.stdin is not None
        lines = Lines(srun)
        srun.stdin.write('{"rank": 0}\n')
        srun.stdin.flush()
        assert lines.next(timeout=30) == 'got {"rank": 0}'
        srun.stdin.close()
        assert lines.next(timeout=30) == "eof after 0"
        assert srun.wait(30) == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(srun.pid, signal.SIGKILL)
        srun.wait()


@pytest.mark.timeout(90)
def test_slurm_task_dies_with_srun(slurm: SlurmBed) -> None:
    # srun forks a shepherd that cancels the step when srun dies, however it dies: the task goes at once
    srun, task, job = _start_sleeper(slurm)
    try:
        srun.kill()
        took = _gone_within(task, 10.0)
        print(f"task of job {job} ended {took} s after srun was SIGKILLed")
        assert took is not None, f"task {task} of job {job} still runs 10 s after srun was SIGKILLed"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(srun.pid, signal.SIGKILL)
        srun.wait()
        slurm.run(["scancel", job], timeout=10, check=False)


@pytest.mark.timeout(90)
def test_slurm_task_outlives_srun_killed_with_its_shepherd(slurm: SlurmBed) -> None:
    # killing srun's whole process group (srun and its shepherd) leaves the task running: InactiveLimit is 0,
    # the default, so only scancel ends it. A launcher must scancel, not just kill its srun group.
    srun, task, job = _start_sleeper(slurm)
    try:
        os.killpg(srun.pid, signal.SIGKILL)
        srun.wait()
        assert _gone_within(task, 3.0) is None, f"task {task} of job {job} ended without a scancel"
        slurm.run(["scancel", job], timeout=10)
        took = _gone_within(task, 10.0)
        print(f"task of job {job} ended {took} s after scancel")
        assert took is not None, f"task {task} of job {job} still runs 10 s after scancel"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(srun.pid, signal.SIGKILL)
        srun.wait()
        slurm.run(["scancel", job], timeout=10, check=False)
