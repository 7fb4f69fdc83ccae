"""`sluice launch --elastic`: a job that loses a worker, or gains one, goes on from its last commit.

Real processes and `sluice launch`; the script is tests/integration/scripts/elastic_train.py
(Horovod's elastic shape, a learning rate that follows the size). The equivalence: a job that loses
worker 2 after step 10 ends with exactly the parameters of a job of 3 workers stopped after step 10
and continued by 2 workers from its state. Those two reference jobs run the same script in workers
forked from the test (script_workers.py): nothing in them is the launcher's to do. The TensorFlow
job replaced in place is tests/integration/scripts/elastic_keras.py, whose workers then run the
reference themselves.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integration import preloads
from tests.integration.elastic_dirs import assert_state_dir_removed
from tests.integration.script_workers import script_outputs

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "tests/integration/scripts/elastic_train.py"
KERAS_SCRIPT = "tests/integration/scripts/elastic_keras.py"
LAUNCH = [sys.executable, "-m", "sluice.launch.cli", "launch"]
#: the growing job's steps (it grows a few steps in)
GROW_STEPS = 100


def _run(argv: list[str], timeout: float = 150) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]]]:
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    starts = [json.loads(m.group(1)) for m in re.finditer(r"ELASTIC_START (.*)$", done.stdout, re.M)]
    results = [json.loads(m.group(1)) for m in re.finditer(r"ELASTIC_RESULT (.*)$", done.stdout, re.M)]
    return output, starts, sorted(results, key=lambda r: r["rank"])


def _reference(tmp_path: Path, first: int, then: int, switch: int, steps: int, servers: str) -> list[float]:
    saved = tmp_path / "state.pt"
    script_outputs(first, int(servers), {}, ROOT / SCRIPT, "--steps", str(steps), "--stop-at", str(switch - 1),
                   "--save", str(saved))
    printed = "".join(script_outputs(then, int(servers), {}, ROOT / SCRIPT, "--steps", str(steps), "--load",
                                     str(saved)))
    results = sorted((json.loads(m.group(1)) for m in re.finditer(r"ELASTIC_RESULT (.*)$", printed, re.M)),
                     key=lambda r: r["rank"])
    return list(results[0]["params"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("servers", ["0", "1"], ids=["allreduce", "ps"])
def test_elastic_job_that_loses_a_worker_ends_as_one_with_a_worker_fewer(tmp_path: Path, servers: str) -> None:
    # horovodrun's spelling: its --min-np alone makes the job elastic
    output, starts, results = _run([*LAUNCH, *preloads.TORCH, "--min-np", "2", "-np", "3", "-s", servers, "--",
                                    sys.executable, SCRIPT, "--steps", "20", "--die-at", "10", "--die-rank", "2"])
    assert re.search(r"sluice launch: worker 2 \(pid \d+\) was killed by SIGKILL.*; dropping worker 2 and "
                     r"re-forming the job \(--elastic\)", output), output[-4000:]
    assert "[launch] re-forming the job: generation 1 with 2 workers" in output
    assert [(s["generation"], s["size"], s["step"]) for s in starts if s["generation"] == 1] == [(1, 2, 11)] * 2
    assert [r["size"] for r in results] == [2, 2] and results[0]["params"] == results[1]["params"]
    assert results[0]["params"] == _reference(tmp_path, 3, 2, 11, 20, servers)
    assert_state_dir_removed(output)
    if preloads.TORCH:  # every generation's workers forked from the one preloader the first generation started
        assert len({s["ppid"] for s in starts}) == 1 and len(starts) == 5, starts


@pytest.mark.timeout(300)
def test_elastic_replace_in_place_keeps_the_survivors_processes_and_ends_as_the_same_job(tmp_path: Path) -> None:
    """--in-place: worker 2 dies after step 10; a new worker 2 starts in its slot and workers 0 and 1 re-form
    the job in their own processes, from commit 11: the job ends as 3 workers stopped after step 10 and
    continued by 3 workers from that state. Through a server here; by allreduce (the tree and rings made
    anew) in test_failover.py's lost host. The job has a standby scheduler, started again on its port with the
    next generation: worker 0 SIGKILLs the scheduler in step 15, and the new standby carries the job on. Workers 0
    and 2 allreduce over a process set each step (hvd.init(process_sets=...)): the survivor registers it again
    in place, the newcomer in its init, and the sums go on; workers 1 and 2 over one the training function adds
    (inside hvd.elastic.run): dropped at the re-forming, it is added again by the survivors and the newcomer."""
    servers = "1"
    standby = ["--set", "scheduler.standby=1", "--set", "scheduler.heartbeat_interval=0.5",
               "--set", "scheduler.heartbeat_timeout=4"]
    output, starts, results = _run([*LAUNCH, *preloads.TORCH,
                                    "--elastic", "--in-place", "-w", "3", "-s", servers, *standby, "--",
                                    sys.executable, SCRIPT, "--steps", "20", "--die-at", "10", "--die-rank", "2",
                                    "--kill-scheduler-at", "15", "--process-set"])
    ready = re.findall(r"^\[launch\] standby scheduler ready at (tcp://\S+)$", output, re.M)
    assert len(ready) == 2 and ready[0] == ready[1], output[-4000:]  # generation 1's, on generation 0's port
    primary = re.search(r"^\[launch\] scheduler ready at (tcp://\S+);", output, re.M)
    assert primary, output[-4000:]  # both generations' standbys watch the scheduler's port (generation 1's: the same)
    assert re.findall(r"it takes over if the scheduler at (\S+) falls silent", output) == [primary[1]] * 2, \
        output[-4000:]
    assert "killed the scheduler" in output and re.search(
        r"\[standby scheduler\] .*took over from the silent scheduler: 4 nodes rejoined", output), output[-4000:]
    assert re.search(r"sluice launch: worker 2 \(pid \d+\) was killed by SIGKILL.*; replacing worker 2 in place: the "
                     r"other workers keep their processes \(--in-place\)", output), output[-4000:]
    assert re.search(r"\[launch\] generation 1: worker 2 replaced in its slot and the scheduler and servers started "
                     r"again [\d.]+ s after the loss", output), output[-4000:]
    first = {s["rank"]: s["pid"] for s in starts if s["generation"] == 0}
    then = {s["rank"]: s["pid"] for s in starts if s["generation"] == 1}
    assert [(s["size"], s["step"]) for s in starts if s["generation"] == 1] == [(3, 11)] * 3
    assert then[0] == first[0] and then[1] == first[1] and then[2] != first[2]  # the survivors kept their process
    assert [r["size"] for r in results] == [3, 3, 3] and results[0]["params"] == results[2]["params"]
    assert results[0]["params"] == _reference(tmp_path, 3, 3, 11, 20, servers)
    # worker 0 summed all 20 steps over the set (steps 11.. after the re-form), the newcomer its 9 from commit 11
    assert results[0]["set_sums"] == [2.0] * 20 and results[2]["set_sums"] == [2.0] * 9, results
    assert results[1]["set_sums"] == []
    # the set the training function adds: dropped at the re-forming and added again by every worker, as in Horovod
    assert results[1]["odd_sums"] == [3.0] * 20 and results[2]["odd_sums"] == [3.0] * 9, results
    assert results[0]["odd_sums"] == []
    assert_state_dir_removed(output)


def _said(output: str, what: str) -> list[dict[str, Any]]:
    return [json.loads(m.group(1)) for m in re.finditer(rf"^\[worker \d+\] ELASTIC_{what} (.*)$", output, re.M)]


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None or importlib.util.find_spec("keras") is None,
                    reason="needs tensorflow and keras (the tensorflow extra)")
def test_elastic_replace_in_place_tensorflow_keeps_the_survivors_processes_and_ends_as_the_same_job() -> None:
    """--in-place with sluice.tensorflow.keras (model.fit and Horovod's elastic Keras callbacks): worker 2 dies
    after its commit of batch 1 of epoch 1; workers 0 and 1 re-form the job in their own processes, without
    tracing their step again, and all three start again from that commit. Then every worker runs, deliberately,
    the same sequence (3 workers fit from rank 0's start, stopped after that batch, and fit again from there):
    the job ends with exactly its variables."""
    output, starts, results = _run([*LAUNCH, *preloads.KERAS,
                                    "--elastic", "--in-place", "-w", "3", "-s", "0", "--", sys.executable,
                                    KERAS_SCRIPT, "--epochs", "3", "--die-epoch", "1", "--die-batch", "1",
                                    "--die-rank", "2", "--reference"], timeout=140)
    assert re.search(r"sluice launch: worker 2 \(pid \d+\) was killed by SIGKILL.*; replacing worker 2 in place: the "
                     r"other workers keep their processes \(--in-place\)", output), output[-4000:]
    first = {s["rank"]: s for s in starts if s["generation"] == 0}
    then = {s["rank"]: s for s in starts if s["generation"] == 1}
    assert len(first) == len(then) == 3 and len(starts) == 6, output[-4000:]
    assert [then[r]["pid"] == first[r]["pid"] for r in range(3)] == [True, True, False]  # the survivors' processes
    (commit,) = _said(output, "COMMIT")
    assert {(s["size"], s["epoch"], s["batch"], s["digest"]) for s in then.values()} == {(3, 1, 1, commit["digest"])}
    assert [(r["size"], r["epoch"], r["batch"]) for r in results] == [(3, 3, 0)] * 3
    assert len({r["digest"] for r in results}) == 1
    references = _said(output, "REFERENCE")
    assert len(references) == 3 and {r["start"] for r in references} == {first[0]["digest"]}
    assert {r["digest"] for r in references} == {results[0]["digest"]}
    directories = {s["directory"] for s in starts}  # this job's (other jobs may run beside it)
    assert len(directories) == 1 and not Path(directories.pop()).exists(), "the committed state outlived the job"


@pytest.mark.timeout(300)
def test_elastic_job_grows_when_discovery_finds_a_slot(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(0o755)
    # generation 0's steps pause, so that it still trains when discovery finds the slot, and generation 1
    # has fewer steps left to train
    job = subprocess.Popen([*LAUNCH, *preloads.TORCH,
                            "--elastic", "-w", "2", "--max-workers", "3", "--host-discovery-script",
                            str(script), "--discovery-interval", "0.5", "-s", "0", "--", sys.executable, SCRIPT,
                            "--steps", str(GROW_STEPS), "--pause", "0.05"], cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        assert job.stdout is not None
        for line in job.stdout:
            if line.startswith("[worker 0] ELASTIC_START"):
                break
        hosts.write_text("localhost:3\n")
        out = "".join(job.stdout)
        job.wait(240)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, out[-5000:]
    assert "host discovery: 3 slots now (2 in use); the workers re-form the job at their next commit" in out
    assert "[launch] re-forming the job: generation 1 with 3 workers" in out
    starts = [json.loads(m.group(1)) for m in re.finditer(r"ELASTIC_START (.*)$", out, re.M)]
    switch = {s["step"] for s in starts if s["generation"] == 1}
    assert len(switch) == 1 and 0 < min(switch) < GROW_STEPS
    results = sorted((json.loads(m.group(1)) for m in re.finditer(r"ELASTIC_RESULT (.*)$", out, re.M)),
                     key=lambda r: r["rank"])
    assert [r["size"] for r in results] == [3, 3, 3]
    assert results[0]["params"] == _reference(tmp_path, 2, 3, switch.pop(), GROW_STEPS, "0")
