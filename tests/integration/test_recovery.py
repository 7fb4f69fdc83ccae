"""Server recovery (ps.recover): a server SIGKILLed mid-training is restarted and nothing is lost or applied twice.

Worker 0 kills server 0 in step 10, right after its backward pass (pushes in flight, some rounds
committed on the server, some not). The launcher restarts the server; it restores its committed
state (ps/snapshot.py); the workers send it again what it had not answered (scheduler/resend.py). The
job must end with exactly the parameters of the same job without the kill, in sum mode (the
optimizer on the workers) and with the optimizer on the servers (momentum, Adam moments). The sum-mode
job mirrors each server's state on the other (ps.replicas, on one host here) and kills server 1 instead:
it holds server 0's mirror and dials server 0, so its hello after the restart may reach server 0 before
the scheduler's SERVER_BACK does (ps/mirror.py `holder_replaced`; before, server 0 then sent it no mirror
again and failed ps.mirror_timeout later). The
momentum job runs 3 workers through an aggregator: in one tree workers 0 and 1 push to it, in the
other workers 1 and 2, the third pushing straight to the servers; the aggregator sends its sums
again (ps/relay.py `server_back`), the direct pushes their workers. The reference runs the same
script and settings (aggregator and trees too) in processes forked from the test (script_workers.py).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integration import preloads
from tests.integration.script_workers import script_outputs

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "tests/integration/scripts/cluster_train.py"
INFLIGHT = 4 << 20


def _script_args(optimizer: str, kill_at: int, hidden: int = 256, kill_rank: int = 0) -> list[str]:
    return ["--steps", "20", "--optimizer", optimizer, "--hidden", str(hidden), "--kill-server-at", str(kill_at),
            "--kill-server-rank", str(kill_rank)]


#: each server's state mirrored on the other, both on this host; a mirror missing for 10 s fails the job
REPLICAS = ("ps.replicas=1", "ps.mirror_same_host=true", "ps.mirror_timeout=10")


#: two trees over 3 workers (half the chunks each): workers 0 and 1, then 1 and 2, through aggregator 0
TREES = ("0.5: worker-0>aggregator-0 worker-1>aggregator-0", "0.5: worker-1>aggregator-0 worker-2>aggregator-0")


def _train(optimizer: str, where: str, kill_at: int, workers: int, aggregators: int, kill_rank: int = 0,
           settings: tuple[str, ...] = ()) -> tuple[list[float], str]:
    # every tensor through the servers (collective.mode = auto would allreduce small ones among the
    # workers), in chunks of 4 KiB: every tensor, fused or not, has chunks on both servers. The in-flight
    # bound is set as well (what calibration chooses here): calibrating it with 4 KiB probes takes seconds
    trees = ["aggregation.mode=static", "aggregation.trees=" + ",".join(TREES)] if aggregators else []
    argv = [sys.executable, "-m", "sluice.launch.cli", "launch", *preloads.TORCH,
            "-w", str(workers), "-s", "2", "-a", str(aggregators),
            "--set", "collective.mode=ps", "--set", "ps.recover=true", "--set", f"worker.optimizer_on={where}",
            "--set", "transport.chunk_bytes=4096", "--set", f"transport.inflight_bytes={INFLIGHT}",
            *(f"--set={s}" for s in (*trees, *settings)), "--", sys.executable, SCRIPT,
            *_script_args(optimizer, kill_at, kill_rank=kill_rank)]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=150)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    results = [json.loads(m.group(1)) for m in re.finditer(r"CLUSTER_RESULT (.*)$", done.stdout, re.M)]
    assert len(results) == workers and all(r["params"] == results[0]["params"] for r in results), output[-3000:]
    return list(results[0]["params"]), output


def _reference(optimizer: str, where: str, workers: int, aggregators: int, chunk_bytes: int = 4096,
               hidden: int = 256, trees: tuple[str, ...] = TREES) -> list[float]:
    """The same job (script, settings) without the kill, in forked workers: nothing in it for the launcher to do."""
    config: dict[str, Any] = {"collective": {"mode": "ps"}, "ps": {"recover": True},
                              "worker": {"optimizer_on": where},
                              "transport": {"chunk_bytes": chunk_bytes, "inflight_bytes": INFLIGHT}}
    if aggregators:
        config["aggregation"] = {"mode": "static", "trees": list(trees)}
    printed = "".join(script_outputs(workers, 2, config, ROOT / SCRIPT, *_script_args(optimizer, -1, hidden),
                                     timeout=120, aggregators=aggregators))
    results = [json.loads(m.group(1)) for m in re.finditer(r"CLUSTER_RESULT (.*)$", printed, re.M)]
    assert len(results) == workers and all(r["params"] == results[0]["params"] for r in results), printed[-3000:]
    return list(results[0]["params"])


@pytest.mark.timeout(300)
# Adam on the servers, its moments restored: bench/recovery.py's resume-after-kill case, whose quick run
# (test_bench_quick_jobs.py) fails unless the killed job ends bit-identical to the same job without the kill
@pytest.mark.parametrize(("optimizer", "where", "workers", "aggregators", "killed", "settings"),
                         [("sgd", "worker", 2, 0, 1, REPLICAS), ("sgd", "server", 3, 1, 0, ())],
                         ids=["sum-mode-mirrored-holder-killed", "server-momentum-through-an-aggregator"])
def test_recovery_server_killed_at_step_10_ends_with_the_same_parameters(optimizer: str, where: str, workers: int,
                                                                         aggregators: int, killed: int,
                                                                         settings: tuple[str, ...]) -> None:
    reference = _reference(optimizer, where, workers, aggregators)
    recovered, output = _train(optimizer, where, 10, workers, aggregators, killed, settings)
    assert f"killed server {killed}" in output
    assert re.search(rf"sluice launch: server {killed} \(pid \d+\) was killed by SIGKILL; restarting it \(1 of at "
                     r"most 3 restarts\)", output), output[-4000:]
    if settings:  # the restarted holder is sent server 0's mirrors again: each acknowledged, no restart more
        assert "has not acknowledged a mirrored commit" not in output, output[-4000:]
        assert output.count("; restarting it (") == 1, output[-4000:]
        assert re.search(r"server 0: \d+ commits mirrored on server 1", output), output[-4000:]
    assert "is back: telling the workers its endpoints" in output
    if aggregators:
        assert re.search(r"aggregator 0: server 0 was replaced; sending it again \d+ unanswered pushes", output), \
            output[-4000:]
    assert recovered == reference


@pytest.mark.timeout(300)
def test_recovery_a_server_replaced_while_a_worker_waits_in_join_counts_it_as_joined() -> None:
    """Worker 1 has fewer batches: after 4 steps it waits in hvd.join() while worker 0 trains on, and SIGKILLs server
    0 in step 10. The replacement is told again that worker 1 joined (worker/ps_join.py): before, its rounds waited
    for worker 1's pushes until op_timeout. Each worker ends with the parameters of the same job without the kill."""
    join = ["--join-rank", "1", "--join-at", "4"]
    config: dict[str, Any] = {"collective": {"mode": "ps"}, "ps": {"recover": True},
                              "worker": {"optimizer_on": "server"},
                              "transport": {"chunk_bytes": 4096, "inflight_bytes": INFLIGHT}}
    printed = "".join(script_outputs(2, 2, config, ROOT / SCRIPT, *_script_args("sgd", -1), *join, timeout=120))
    reference = sorted((json.loads(m.group(1)) for m in re.finditer(r"CLUSTER_RESULT (.*)$", printed, re.M)),
                       key=lambda r: r["rank"])
    argv = [sys.executable, "-m", "sluice.launch.cli", "launch", *preloads.TORCH,
            "-w", "2", "-s", "2", "--set", "collective.mode=ps",
            "--set", "ps.recover=true", "--set", "worker.optimizer_on=server", "--set", "transport.chunk_bytes=4096",
            "--set", f"transport.inflight_bytes={INFLIGHT}", "--set", "scheduler.op_timeout=30", "--",
            sys.executable, SCRIPT, *_script_args("sgd", 10), *join]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=150)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    assert "killed server 0" in output and "is back: telling the workers its endpoints" in output, output[-4000:]
    results = sorted((json.loads(m.group(1)) for m in re.finditer(r"CLUSTER_RESULT (.*)$", done.stdout, re.M)),
                     key=lambda r: r["rank"])
    assert [r["params"] for r in results] == [r["params"] for r in reference], output[-3000:]
    assert results[0]["params"] != results[1]["params"]  # worker 1 stopped early


#: three levels: worker 2 under aggregator 1, which sends to aggregator 0 (an aggregator's parent has a lower rank)
CHILD_TREE = ("1: worker-0>aggregator-0 worker-1>aggregator-0 worker-2>aggregator-1 aggregator-1>aggregator-0",)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("trees", "killed"), [(TREES, 0), (CHILD_TREE, 1)], ids=["root", "child-of-an-aggregator"])
def test_recovery_aggregator_killed_at_step_10_is_restarted_and_the_job_ends_with_the_same_parameters(
        trees: tuple[str, ...], killed: int) -> None:
    """The momentum job through aggregators, whose worker 0 SIGKILLs one in step 10: the launcher restarts it, the
    scheduler gives it its plans and routings, the workers send it again what it left unanswered
    (worker/replaced.py) and it forwards them, marked as sent again (ps/relay.py); a push of a round the dead one
    had answered to some children only goes up alone (it hung 3 runs in 10 before). Chunks of 64 KiB travel through
    shared memory: what the dead one sent to is dropped when the replacement's HELLO comes (transport/
    incarnations.py; before, the job hung every time). The root sends to the servers; the child to aggregator 0,
    which must not dial it (before, each refused the other's messages as an impostor's and the job failed)."""
    reference = _reference("sgd", "server", 3, 1 + killed, chunk_bytes=65536, hidden=1024, trees=trees)
    args = [*_script_args("sgd", -1, hidden=1024), "--kill-aggregator-at", "10", "--kill-aggregator-rank", str(killed)]
    argv = [sys.executable, "-m", "sluice.launch.cli", "launch", *preloads.TORCH,
            "-w", "3", "-s", "2", "-a", str(1 + killed),
            "--set", "collective.mode=ps", "--set", "ps.recover=true", "--set", "worker.optimizer_on=server",
            "--set", "transport.chunk_bytes=65536", "--set", f"transport.inflight_bytes={INFLIGHT}",
            "--set", "aggregation.mode=static", "--set", "aggregation.trees=" + ",".join(trees),
            "--", sys.executable, SCRIPT, *args]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=150)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    assert f"killed aggregator {killed}" in output
    assert re.search(rf"sluice launch: aggregator {killed} \(pid \d+\) was killed by SIGKILL; restarting it \(1 of "
                     r"at most 3 restarts\)", output), output[-4000:]
    assert f"aggregator {killed} was replaced; sending it again" in output, output[-4000:]
    for peer in ("server 0", "server 1") if killed == 0 else ("aggregator 0",):
        assert f"[{peer}] INFO sluice.transport: transport {peer.replace(' ', '-')}: aggregator-{killed} is a new " \
            "process" in output, output[-4000:]
    assert "a peer we connected to" not in output, output[-4000:]
    results = [json.loads(m.group(1)) for m in re.finditer(r"CLUSTER_RESULT (.*)$", done.stdout, re.M)]
    assert len(results) == 3 and all(r["params"] == reference for r in results), output[-3000:]


@pytest.mark.timeout(120)
def test_recovery_without_restarts_left_fails_naming_the_server() -> None:
    argv = [sys.executable, "-m", "sluice.launch.cli", "launch", *preloads.TORCH,
            "-w", "2", "-s", "2", "--set", "ps.recover=true",
            "--set", "ps.max_restarts=0", "--", sys.executable, SCRIPT, "--steps", "20", "--kill-server-at", "5"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert done.returncode != 0
    assert "server 0 (pid" in done.stderr and "already restarted servers 0 times (ps.max_restarts)" in done.stderr
