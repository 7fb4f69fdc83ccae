"""horovodrun's and torchrun's habits in a launched job: -np with no -s, per-rank log files, timestamps, MASTER_PORT,
closed pipes; a bare script, -m and --local-ranks-filter."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.launch import Launch

ROOT = Path(__file__).resolve().parents[2]
STAMP = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3} "

# not a Sluice worker: it says what the launcher gave it, on both streams
WORKER = """
import os, sys
print("port", os.environ["MASTER_PORT"], "servers", os.environ["SLUICE_NUM_SERVERS"], flush=True)
print("trouble from", os.environ["RANK"], file=sys.stderr, flush=True)
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return int(probe.getsockname()[1])


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_horovodrun_command_line_runs_with_rank_files_and_timestamps(launch: type[Launch], tmp_path: Path) -> None:
    script, logs, port = tmp_path / "w.py", tmp_path / "logs", _free_port()
    script.write_text(WORKER)
    job = launch(["-np", "2", "--output-filename", str(logs), "-prefix-timestamp", "--master-port", str(port),
                  "--gloo", "--grace", "1", sys.executable, str(script)])
    assert job.finish(40) == 0, job.stderr()
    out, err = job.stdout(), job.stderr()
    assert "starting 0 servers, 2 workers" in out  # -s left out: pure allreduce
    assert re.search(rf"^{STAMP}\[worker 1\] port {port} servers 0$", out, re.M), out
    assert re.search(rf"^{STAMP}\[worker 0\] trouble from 0$", out, re.M)  # stderr reaches the terminal too
    assert re.search(rf"^{STAMP}\[launch\] all workers finished$", out, re.M)
    assert "--gloo is ignored: Sluice has its own transport" in err
    for rank in (0, 1):
        assert re.fullmatch(rf"{STAMP}port {port} servers 0\n", (logs / f"rank.{rank}" / "stdout").read_text())
        assert re.fullmatch(rf"{STAMP}trouble from {rank}\n", (logs / f"rank.{rank}" / "stderr").read_text())
    assert "SLUICE_SCHEDULER_READY" in (logs / "scheduler" / "stdout").read_text()
    job.assert_none_left()

    with socket.socket() as holder:  # a port taken on worker 0's host (here) stops the job before it starts
        holder.bind(("", port))
        holder.listen()
        taken = launch(["-np", "1", "--master_port", str(port), sys.executable, "-c", "pass"])
        assert taken.finish(20) == 2
    assert f"MASTER_PORT {port} cannot be used on this machine (worker 0's host)" in taken.stderr()
    assert "give another with --master-port PORT" in taken.stderr() and "[worker" not in taken.stdout()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_torchrun_command_line_runs_its_bare_script_and_module_and_filters_ranks(launch: type[Launch],
                                                                                   tmp_path: Path) -> None:
    script, logs = tmp_path / "w.py", tmp_path / "logs"
    script.write_text(WORKER)  # no execute permission: torchrun runs it with python, and so do we
    job = launch(["--nproc-per-node", "2", "--local-ranks-filter", "1", "--log-dir", str(logs), "--grace", "1",
                  str(script)])
    assert job.finish(40) == 0, job.stderr()
    out = job.stdout()
    assert "[worker 1] trouble from 1" in out and "[worker 0]" not in out  # only local rank 1 on the terminal
    assert (logs / "rank.0" / "stderr").read_text() == "trouble from 0\n"  # the files keep every rank
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "train.py").write_text(WORKER)
    module = launch(["--nproc-per-node", "1", "-m", "pkg.train"], cwd=tmp_path)  # torchrun -m: python -u -m
    assert module.finish(40) == 0, module.stderr()
    assert "[worker 0] trouble from 0" in module.stdout()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("words", [["config"], ["--help"], ["launch", "--help"]])
def test_output_cut_by_a_closed_pipe_ends_quietly(words: list[str]) -> None:
    # the reader (`true`) is gone before the first write: every write meets a closed pipe
    command = " ".join([sys.executable, "-m", "sluice.launch.cli", *words])
    result = subprocess.run(["bash", "-o", "pipefail", "-c", f"{command} | true"], cwd=ROOT, capture_output=True,
                            text=True, timeout=20)
    assert result.returncode == 0 and result.stderr == ""


# a Sluice worker whose process outlives its goodbye: an exit handler registered before sluice.torch's runs
# after it (atexit runs last-registered first), as a slow interpreter teardown or a late user handler would; the
# 8 s leave the scheduler's own exit (a few seconds on a loaded 2-core machine) and --grace 1 time to pass first
SLOW_EXIT = """
import atexit, os, sys, time
atexit.register(lambda: (time.sleep(8), os._exit(int(sys.argv[1]) if os.environ["RANK"] == "1" else 0)))
import torch
import sluice.torch as hvd
hvd.init()
print("sum", float(hvd.allreduce(torch.ones(2), op=hvd.Sum)[0]), flush=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_workers_that_exit_after_the_job_ended_are_waited_for_and_keep_their_exit_codes(
        launch: type[Launch], tmp_path: Path) -> None:
    # horovodrun (launch_gloo: every process run to its end, then the first non-zero exit named with its code) and
    # torchrun wait for every worker's own exit; --grace only says when to tell of the wait
    script = tmp_path / "slow_exit.py"
    script.write_text(SLOW_EXIT)
    job = launch(["-np", "2", "--grace", "1", sys.executable, str(script), "3"])
    assert job.finish(45) == 3, job.stderr()  # the failed worker's own code (horovodrun would exit 1, naming it)
    out, err = job.stdout(), job.stderr()
    assert "[worker 0] sum 2.0" in out and "[worker 1] sum 2.0" in out
    assert re.search(r"^\[launch\] the job ended \(scheduler exited 0\) [12] s ago and "
                     r"(worker \d still runs; waiting for it|worker \d, worker \d still run; waiting for them) to exit",
                     out, re.M), out
    assert re.search(r"worker 1 .*exited with code 3", err), err  # its own code, not a stop by the launcher
    assert "worker 0" not in err, err
    job.assert_none_left()


# a Sluice worker that says which start of the job it is in; rank 1 fails the first `argv[1]` starts
RESTARTED = """
import os, sys
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if os.environ["RANK"] == "1" and restart < int(sys.argv[1]):
    sys.exit(3)
from sluice.worker.node import WorkerNode
node = WorkerNode()
print("formed", node.rank, "start", restart, *(os.environ[k] for k in (
    "TORCHELASTIC_MAX_RESTARTS", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME",
    "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE")), flush=True)
node.close()
"""


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_torchruns_max_restarts_starts_the_whole_job_again_after_a_failure_and_gives_up_after_the_last(
        launch: type[Launch], tmp_path: Path) -> None:
    script = tmp_path / "w.py"
    script.write_text(RESTARTED)
    job = launch(["--nproc-per-node", "2", "--max-restarts", "2", str(script), "2"])
    assert job.finish(60) == 0, job.stderr()
    out = job.stdout()
    assert out.count("[launch] restarting every process of the job") == 2
    assert "start 3 of at most 3 (--max-restarts 2; the workers see TORCHELASTIC_RESTART_COUNT=2)" in out
    # the third start formed a job: a new scheduler, both workers; torchrun's variables, Lightning's sign of it
    assert "[worker 0] formed 0 start 2 2 0 1 0 2 default none False" in out
    assert "[worker 1] formed 1 start 2 2 0 1 1 2 default none False" in out
    assert job.stderr().count("worker 1 (pid") == 2  # each failure named
    failing = launch(["--nproc-per-node", "2", "--max-restarts", "1", str(script), "9"])
    assert failing.finish(60) == 3, failing.stderr()  # the worker's exit code, as torchrun's failure ends
    assert "the job failed after 1 restart (--max-restarts 1); ending it" in failing.stderr()
    assert failing.stdout().count("[launch] restarting every process of the job") == 1
