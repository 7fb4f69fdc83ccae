"""`sluice launch` inside a SLURM allocation: every role started by srun on the allocation's node (a one-node SLURM).

The bed (tests/integration/slurm_bed.py) runs munged, slurmctld and slurmd from Debian's packages.
`salloc -n 3 sluice launch -s 1 -- python train.py` reads the allocation (3 task slots: 3 workers),
starts the server and the workers as srun steps, and trains to the parameters of the same job
started without SLURM. Also: started as several tasks of one step (srun -n 2 sluice launch) it
refuses, saying to run it once; Ctrl-C leaves no step and no process behind.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.cluster_reference import cluster_train_params
from tests.integration.slurm_bed import SlurmBed

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "tests/integration/scripts/cluster_train.py"
LAUNCH = [sys.executable, "-m", "sluice.launch.cli", "launch"]


def _results(output: str) -> list[dict[str, Any]]:
    found = [json.loads(m.group(1)) for m in re.finditer(r"^\[worker \d+\] CLUSTER_RESULT (.*)$", output, re.M)]
    return sorted(found, key=lambda r: r["rank"])


def _bed_processes(slurm: SlurmBed, needle: bytes) -> list[int]:
    """Processes whose command line holds `needle` and that this bed's SLURM started (they carry its
    SLURM_CONF): not those of a job beside it on this machine."""
    marker, found = f"SLURM_CONF={slurm.conf}".encode() + b"\0", []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if needle in (entry / "cmdline").read_bytes() and marker in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
    return found


def _steps(slurm: SlurmBed) -> str:
    return slurm.run(["squeue", "-h", "-s", "-o", "%i %j"], timeout=20).stdout.strip()


@pytest.mark.timeout(240)
def test_slurm_allocation_runs_every_role_through_srun(slurm: SlurmBed) -> None:
    job = subprocess.run(["salloc", "-N1", "-n3", "--quiet", *LAUNCH, "-s", "1", "--", sys.executable, SCRIPT,
                          "--steps", "8"], env=slurm.env, cwd=ROOT, capture_output=True, text=True, timeout=200)
    output = job.stdout + job.stderr
    assert job.returncode == 0, output[-5000:] + "\n" + slurm.logs()[-3000:]
    assert re.search(r"\[launch\] hosts from SLURM job \d+; the scheduler runs here \(127\.0\.0\.1\); roles start "
                     r"with srun", output), output[-3000:]
    assert f"[launch]   {slurm.node} (this machine): workers 0-2, server 0" in output
    results = _results(job.stdout)
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert all(r["params"] == results[0]["params"] for r in results)
    assert [(r["local_rank"], r["local_size"]) for r in results] == [(0, 3), (1, 3), (2, 3)]
    expected = cluster_train_params(8, "sgd", workers=3)  # the same job started without SLURM
    assert max(abs(a - b) for a, b in zip(results[0]["params"], expected, strict=True)) < 1e-6
    assert _steps(slurm) == "", "steps of the job were left behind"


@pytest.mark.timeout(120)
def test_slurm_launcher_started_as_several_tasks_refuses(slurm: SlurmBed) -> None:
    job = subprocess.run(["srun", "-N1", "-n2", *LAUNCH, "-w", "1", "-s", "1", "--", "true"], env=slurm.env,
                         cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert job.returncode != 0
    assert "run `sluice launch` once, in the batch script or the salloc shell" in job.stderr


@pytest.mark.timeout(180)
def test_slurm_ctrl_c_leaves_no_step_and_no_process(slurm: SlurmBed) -> None:
    launcher = subprocess.Popen(["salloc", "-N1", "-n2", "--quiet", *LAUNCH, "-s", "1", "--", sys.executable,
                                 SCRIPT, "--steps", "100000"], env=slurm.env, cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while len(_steps(slurm).splitlines()) < 3:  # the server's and two workers' steps
            assert launcher.poll() is None and time.monotonic() < deadline, "the roles' steps did not start"
            time.sleep(0.3)
        time.sleep(3)  # training
        # salloc and the launcher, as a Ctrl-C at the terminal reaches both; only those of this test's
        # session (salloc's): a launcher of another job on this machine is not ours to interrupt
        sluice = subprocess.run(["pgrep", "-s", str(launcher.pid), "-f", "sluice.launch.cli launch"],
                                capture_output=True, text=True)
        for pid in sluice.stdout.split():
            subprocess.run(["kill", "-INT", pid], check=False)
        out, _ = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert "received SIGINT; stopping the job" in out, out[-3000:]
    deadline = time.monotonic() + 20
    while _steps(slurm) or _bed_processes(slurm, b"cluster_train.py"):
        assert time.monotonic() < deadline, f"left behind: steps {_steps(slurm)!r}"
        time.sleep(0.3)
