"""`sluice.run(func, ...)` against Horovod's own tests of `horovod.run` (test/integration/test_interactiverun.py):
the return values by rank, and a failing rank ending the job at once with RuntimeError; and what a caller interrupted
or killed outright leaves behind: nothing."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "integration" / "scripts" / "run_func.py"
pytestmark = pytest.mark.slow


def _script(*case: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *case], cwd=ROOT, capture_output=True, text=True, timeout=100)


@pytest.mark.timeout(120)
def test_run_returns_each_ranks_value_by_rank_as_horovods() -> None:
    done = _script("happy")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULTS "))
    assert json.loads(line.removeprefix("RESULTS ")) == [[[0, 4321]], [[0, 4321, 1, 4321, 2, 4321],
                                                                      "ret_val_of_rank_1", None],
                                                         [[0, 4321, 1, 4321]]]
    assert "--elastic: the workers' committed state" in done.stdout  # the third ran as an elastic job, its INFO
    # the launcher's lines shown once: the first two runs were quiet (Horovod's default level, WARNING), the third
    # showed its INFO lines as its launch_args asked
    assert done.stdout.count("[launch] scheduler ready at") == 1, done.stdout[-3000:]
    assert "np is deprecated, use num_proc instead" in done.stderr  # Horovod's warning for its old name
    assert "LEFT 0 folders" in done.stdout


@pytest.mark.timeout(120)
def test_a_failing_rank_raises_runtime_error_and_the_other_is_stopped() -> None:
    done = _script("failed")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RAISED after "))
    assert "one or more processes exited with non-zero status" in line
    assert "The first to do so: worker 1 (pid " in line and "exited with code 1" in line  # as Horovod names it
    assert float(line.split()[2]) < 60  # Horovod's bound: the sleeping worker is not waited for
    assert "[worker 1] RuntimeError: rank 1 fails on purpose" in done.stdout  # its traceback reached the caller
    assert "LEFT 0 folders" in done.stdout  # the function's folder is removed after a failure too


@pytest.mark.timeout(120)
def test_an_interrupt_of_the_caller_stops_the_job_and_leaves_no_worker() -> None:
    done = _script("interrupt", "4")  # SIGINT to the caller 4 s into a job of two workers sleeping 120 s
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("INTERRUPTED after "))
    assert float(line.split()[2]) < 30 and line.endswith(", 0 workers left"), line
    assert "sluice launch: received SIGINT; stopping the job" in done.stderr
    assert "LEFT 0 folders" in done.stdout


@pytest.mark.timeout(120)
def test_a_caller_killed_outright_leaves_no_worker_and_no_folder() -> None:
    caller = subprocess.Popen([sys.executable, str(SCRIPT), "killed"], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    assert caller.stdout is not None
    ours, pids, folders, lines = "", set(), set(), []
    try:
        for line in caller.stdout:  # until both workers run the function (the test's timeout bounds it)
            lines.append(line)
            if line.startswith("OURS "):
                ours = line.split()[1]
            if "WORKER " in line:  # "[worker R] WORKER PID FOLDER"
                pid, folder = line.split("WORKER ")[1].split()
                pids.add(int(pid))
                folders.add(folder)
                if len(pids) == 2:
                    break
        assert len(pids) == 2 and ours, "".join(lines[-40:])
        (folder,) = folders
        assert Path(folder).parent == Path(ours) and (Path(folder) / "task.pkl").exists()
        caller.kill()  # SIGKILL: no finally of run() runs
        caller.wait(10)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (Path(folder).exists() or any(_alive(pid) for pid in pids)):
            time.sleep(0.2)
        assert not Path(folder).exists(), "the killed caller's folder (its pickled function) was left behind"
        assert not any(_alive(pid) for pid in pids), "a worker of the killed caller is still running"
    finally:
        if caller.poll() is None:
            caller.kill()
        caller.stdout.close()
        if ours:
            shutil.rmtree(ours, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
