"""scheduler.standby: the scheduler is killed mid-training; the nodes rejoin the standby, which takes the job over.

A local launch of 2 workers and 2 servers (the optimizer on the servers) whose worker 0 SIGKILLs the
scheduler in step 5. The nodes find it silent after scheduler.heartbeat_timeout, rejoin the standby
with what they were told (scheduler/standby.py), and train on; after training one more tensor is
declared, which the standby plans; the workers' goodbyes end the job under the standby. The job ends
with the parameters of the same job without the kill, and leaves nothing running.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integration.script_workers import script_outputs

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "tests/integration/scripts/cluster_train.py"
ARGS = ["--steps", "30", "--hidden", "256"]
SETTINGS: dict[str, Any] = {"collective": {"mode": "ps"}, "worker": {"optimizer_on": "server"},
                            "transport": {"chunk_bytes": 4096, "inflight_bytes": 4 << 20}}


def _results(printed: str) -> list[dict[str, Any]]:
    found = [json.loads(m.group(1)) for m in re.finditer(r"CLUSTER_RESULT (.*)$", printed, re.M)]
    return sorted(found, key=lambda r: r["rank"])


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_failover_scheduler_killed_the_standby_takes_over_and_the_job_ends_bit_identical() -> None:
    reference = _results("".join(script_outputs(2, 2, SETTINGS, ROOT / SCRIPT, *ARGS, timeout=90)))
    sets = ["collective.mode=ps", "worker.optimizer_on=server", "transport.chunk_bytes=4096",
            "transport.inflight_bytes=4194304", "scheduler.standby=1", "scheduler.heartbeat_interval=0.5",
            "scheduler.heartbeat_timeout=2"]
    argv = [sys.executable, "-m", "sluice.launch.cli", "launch", "-w", "2", "-s", "2", *(f"--set={s}" for s in sets),
            "--", sys.executable, SCRIPT, *ARGS, "--kill-scheduler-at", "5"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=100)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    assert "standby scheduler ready at tcp://127.0.0.1:" in out and "killed the scheduler" in out
    assert re.search(r"sluice launch: scheduler \(pid \d+\) was killed by SIGKILL; the nodes rejoin the standby "
                     r"scheduler \(pid \d+\)", out), out[-4000:]
    assert len(re.findall(r"has not answered heartbeats for [\d.]+ s; rejoining the standby scheduler", out)) == 4
    assert re.search(r"\[standby scheduler\] .*took over from the silent scheduler: 4 nodes rejoined, "
                     r"1 declarations replayed", out), out[-4000:]
    assert "[standby scheduler] INFO sluice.scheduler: all workers finished; job done" in out
    assert "job failed" not in out and "rejected" not in out.replace("0 messages rejected", "")
    results = _results(done.stdout)
    assert len(results) == 2 and results[0]["params"] == results[1]["params"] == reference[0]["params"]
    assert results[0]["after"] == results[1]["after"] == [0.5] * 5  # declared and planned under the standby
    left = subprocess.run(["pgrep", "-f", f"{SCRIPT} {' '.join(ARGS)} --kill-scheduler-at"], capture_output=True)
    assert left.returncode == 1, left.stdout
