"""Job priorities ([jobs]) in a real job: traffic moves down the channels as bytes accrue; sums stay exact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

JOB = """
import json
import numpy as np
from sluice.worker.node import WorkerNode
node = WorkerNode()
c = node.ps
c.declare([("g", (65536,), "float32", None)])  # 256 KiB a push
levels = []
for step in range(12):
    out = np.zeros(65536, np.float32)
    c.push_pull("g", np.full(65536, c.rank + 1, np.float32), out).wait()
    assert out[0] == 3.0 and out[-1] == 3.0, out[0]
    levels.append(c.job_level.level)
stats = node.stats()
print("RESULT " + json.dumps({"levels": levels, "sent": stats["sent_bytes"], "received": stats["received_bytes"]}),
      flush=True)
node.close()
"""


@pytest.mark.timeout(120)
def test_a_jobs_pushes_move_down_the_channels_as_its_bytes_pass_the_thresholds(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    done = subprocess.run(
        [sys.executable, "-m", "sluice.launch.cli", "launch", "-w", "2", "-s", "1",
         "--set", "jobs.priorities=true", "--set", "jobs.early_rounds=2", "--set", "jobs.thresholds_mib=1,2",
         "--", sys.executable, str(script)],
        cwd=ROOT, capture_output=True, text=True, timeout=100, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in done.stdout.splitlines() if "RESULT " in line]
    assert len(results) == 2, done.stdout[-2000:]
    for result in results:
        # the level for the next round: 2 early rounds at the top; 1 MiB pushed after round 4, 2 MiB
        # after round 8 (256 KiB a round)
        assert result["levels"] == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2], result
        quarter = 65536 * 4
        # rounds 1-4 went on channel 0, 5-8 on channel 1, 9-12 on channel 2
        assert [round(b / quarter) for b in result["sent"]] == [4, 4, 4], result
        assert [round(b / quarter) for b in result["received"]] == [4, 4, 4], result  # the replies too


def test_more_levels_than_channels_fails_at_start_saying_what_to_set(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text("from sluice.worker.node import WorkerNode\nWorkerNode()\n")
    done = subprocess.run(
        [sys.executable, "-m", "sluice.launch.cli", "launch", "-w", "1", "-s", "1", "--set", "transport.channels=2",
         "--set", "jobs.priorities=true", "--set", "jobs.thresholds_mib=1,2", "--", sys.executable, str(script)],
        cwd=ROOT, capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode != 0
    assert "transport.channels = 3" in done.stdout + done.stderr, done.stdout[-2000:] + done.stderr[-2000:]

SEES_THE_OTHER = """
import json, os, sys, time
from pathlib import Path
import numpy as np
from sluice.scheduler.jobs_registry import read_all, registry_dir
from sluice.worker.node import WorkerNode
node = WorkerNode()
c = node.ps
where = registry_dir(node.env.section("jobs").get("registry_dir", ""))  # the job's config names it
c.declare([("g", (1024,), "float32", None)])
deadline, seen = time.monotonic() + 30, []
while time.monotonic() < deadline:  # push rounds until the registry shows both jobs with rounds done
    c.push_pull("g", np.ones(1024, np.float32), np.zeros(1024, np.float32)).wait()
    seen = [(j.job, j.rounds, j.priorities) for j in read_all(where)[0]]
    if len(seen) == 2 and all(rounds > 0 for _, rounds, _ in seen):
        break
    time.sleep(0.2)
print("SEEN " + json.dumps(seen), flush=True)
looked = Path(sys.argv[1])  # each job marks there that it has looked
(looked / str(os.getpid())).touch()
linger = time.monotonic() + 30  # stay listed (registry entries follow heartbeats) while the other job looks
while len(list(looked.iterdir())) < 2 and time.monotonic() < linger:
    c.push_pull("g", np.ones(1024, np.float32), np.zeros(1024, np.float32)).wait()
    time.sleep(0.2)
node.close()
"""


@pytest.mark.timeout(120)
def test_two_jobs_on_one_host_find_each_other_in_the_job_registry(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(SEES_THE_OTHER)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SLUICE_JOBS_REGISTRY_DIR": str(tmp_path / "registry")}
    looked = tmp_path / "looked"
    looked.mkdir()
    argv = [sys.executable, "-m", "sluice.launch.cli", "launch", "-w", "1", "-s", "1", "--set", "jobs.priorities=true",
            "--", sys.executable, str(script), str(looked)]
    jobs = [subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
            for _ in range(2)]
    outputs = [job.communicate(timeout=100)[0] for job in jobs]
    assert all(job.returncode == 0 for job in jobs), outputs
    seen = [json.loads(line.split("SEEN ", 1)[1]) for out in outputs for line in out.splitlines() if "SEEN " in line]
    assert len(seen) == 2 and all(len(s) == 2 for s in seen), outputs  # each saw both jobs
    assert seen[0] and sorted(j[0] for j in seen[0]) == sorted(j[0] for j in seen[1])
    assert all(j[2] is True for j in seen[0])
    listing = subprocess.run([sys.executable, "-m", "sluice.launch.cli", "jobs"], cwd=ROOT, capture_output=True,
                             text=True, env=env, timeout=30)
    assert "no Sluice jobs running" in listing.stdout, listing.stdout  # both withdrew at the end
