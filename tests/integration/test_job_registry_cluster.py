"""Two launched jobs whose schedulers keep different per-host registries see each other through the served one.

On 127.0.0.1, with a registry directory per job standing for its host: what differs between hosts
for the registry is only which directory a scheduler writes and which address it reports to, and a
launched job here is the same processes and sockets as on the ssh testbed, at a fraction of its
start-up time (the test budget is 20 s).
"""

from __future__ import annotations

import bisect
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
THRESHOLDS_MIB, EARLY_ROUNDS = (1.0, 2.0), 2

WORKER = """
import json, subprocess, sys, time
from pathlib import Path
import numpy as np
from sluice.scheduler.jobs_registry import read_all, registry_dir
from sluice.scheduler.registry_client import query
from sluice.scheduler.registry_service import load_keys
from sluice.worker.node import WorkerNode
role, marks = sys.argv[1], Path(sys.argv[2])
node = WorkerNode()
c = node.ps
jobs = node.env.section("jobs")
keys = load_keys(jobs["registry_secret_file"], curve=True)
size = 65536 if role == "A" else 4096  # A pushes 256 KiB a round, B 16 KiB: B stays above A
c.declare([("g", (size,), "float32", None)])

def step():
    c.push_pull("g", np.ones(size, np.float32), np.zeros(size, np.float32)).wait()
    time.sleep(0.05)

def cluster():
    return [[j.job, j.level, j.rounds, j.attained_mib] for j in query(jobs["registry"], keys)[0]]

deadline = time.monotonic() + 40
while time.monotonic() < deadline:  # A: until the registry has it at the lowest level; B: until it has both
    step()
    seen = cluster()
    if (role == "A" and seen and seen[0][1] == 2) or (role == "B" and len(seen) == 2 and seen[1][2] > 0):
        break
print("SEEN " + json.dumps(seen), flush=True)
print("LOCAL " + json.dumps([j.job for j in read_all(registry_dir(jobs["registry_dir"]))[0]]), flush=True)
if role == "A":
    while not (marks / "b_looked").exists() and time.monotonic() < deadline:
        step()
    (marks / "a_done").touch()
else:
    listing = subprocess.run([sys.executable, "-m", "sluice.launch.cli", "jobs", "--registry", jobs["registry"],
                              "--registry-secret-file", jobs["registry_secret_file"], "--json"],
                             capture_output=True, text=True, timeout=20)
    print("CLI " + listing.stdout.strip(), flush=True)
    (marks / "b_looked").touch()
    while not (marks / "a_done").exists() and time.monotonic() < deadline:
        step()
    rounds, until = 0, time.monotonic() + 5  # past the registry's reply deadline after A's scheduler is gone
    while time.monotonic() < until:
        step()
        rounds += 1
    print(f"AFTER_LOSS {rounds}", flush=True)
node.close()
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _level(rounds: int, attained_mib: float) -> int:
    """The MLFQ rule of worker/job_priority.py, written out: early rounds at the top, then by bytes."""
    return 0 if rounds <= EARLY_ROUNDS else bisect.bisect_right(THRESHOLDS_MIB, attained_mib)


def _lines(output: str, tag: str) -> list[str]:
    return [line.split(tag + " ", 1)[1] for line in output.splitlines() if tag + " " in line]


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_jobs_on_two_hosts_see_each_other_through_the_served_registry_and_outlive_it(tmp_path: Path) -> None:
    script, marks, secret = tmp_path / "job.py", tmp_path / "marks", tmp_path / "registry.secret"
    script.write_text(WORKER)
    marks.mkdir()
    secret.write_text("0123456789abcdef0123456789abcdef\n")
    secret.chmod(0o600)
    endpoint = f"127.0.0.1:{_free_port()}"
    base = {**os.environ, "PYTHONPATH": str(ROOT), "SLUICE_JOBS_REGISTRY": endpoint,
            "SLUICE_JOBS_REGISTRY_SECRET_FILE": str(secret)}

    def launch(role: str, *sets: str) -> subprocess.Popen[str]:
        argv = [sys.executable, "-m", "sluice.launch.cli", "launch", "-w", "1", "-s", "1",
                "--set", "jobs.priorities=true", "--set", "transport.channels=3", "--set", "jobs.thresholds_mib=1,2",
                "--set", f"jobs.early_rounds={EARLY_ROUNDS}", *sets,
                "--", sys.executable, str(script), role, str(marks)]
        env = {**base, "SLUICE_JOBS_REGISTRY_DIR": str(tmp_path / f"host-{role}")}  # one registry dir per "host"
        return subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)

    a = launch("A")  # its scheduler binds the registry's port: it serves it
    b = None
    try:
        assert a.stdout is not None
        head = []
        for line in a.stdout:  # B starts once A is at its lowest level in the registry
            head.append(line)
            if "SEEN " in line:
                break
        b = launch("B", "--set", "jobs.registry_serve=false")
        out_b = b.communicate(timeout=60)[0]
        out_a = "".join(head) + a.stdout.read()  # not communicate(): it would miss what iteration buffered
        a.wait(timeout=30)
    finally:
        for job in (a, b):
            if job is not None and job.poll() is None:
                job.kill()
    assert a.returncode == 0 and b.returncode == 0, out_a[-3000:] + out_b[-3000:]
    assert "serving the cluster's job registry" in out_a, out_a[-3000:]
    seen_a, seen_b = json.loads(_lines(out_a, "SEEN")[0]), json.loads(_lines(out_b, "SEEN")[0])
    assert len(seen_a) == 1 and seen_a[0][1] == 2, out_a[-3000:]
    assert len(seen_b) == 2 and seen_b[0][0] == seen_a[0][0], out_b[-3000:]  # B sees A, oldest first
    for job, level, rounds, attained in seen_a + seen_b:
        assert level == _level(rounds, attained), (job, level, rounds, attained)
    assert seen_b[0][1] == 2 and seen_b[1][1] < 2, seen_b  # the newer, smaller job is above the older one
    for out, seen in ((out_a, seen_a), (out_b, seen_b)):  # each host's own directory has only its job
        assert json.loads(_lines(out, "LOCAL")[0]) == [seen[-1][0]], out[-3000:]
    assert [j["job"] for j in json.loads(_lines(out_b, "CLI")[0])] == [s[0] for s in seen_b]  # `sluice jobs --registry`
    assert out_b.count("has not answered") == 1, out_b[-3000:]  # A's end took the registry: logged once
    assert int(_lines(out_b, "AFTER_LOSS")[0]) > 10, out_b[-3000:]  # and B trained on without it
