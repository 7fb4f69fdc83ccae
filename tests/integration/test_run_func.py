"""`sluice.run(func, ...)` against Horovod's own tests of `horovod.run` (test/integration/test_interactiverun.py):
the return values by rank, and a failing rank ending the job at once with RuntimeError."""

from __future__ import annotations

import json
import subprocess
import sys
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
    # the launcher's configuration shown once: the first two runs were quiet (Horovod's default level, WARNING),
    # the third showed its INFO lines as its launch_args asked
    assert done.stdout.count("[launch] transport.channels") == 1
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
