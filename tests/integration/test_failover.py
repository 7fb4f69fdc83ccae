"""scheduler.standby: the scheduler is killed mid-training; the nodes rejoin the standby, which takes the job over.

A local launch of 3 workers, 2 servers (the optimizer on the servers) and an aggregator (two static
trees) whose worker 0 SIGKILLs the scheduler in step 5. The nodes find it silent after
scheduler.heartbeat_timeout, rejoin the standby with what they were told (scheduler/standby.py), and
train on; after training one more tensor is declared, which the standby plans; the workers' goodbyes
end the job under the standby. The job ends with the parameters of the same job without the kill,
and leaves nothing running. Another local job is killed between a switch's ROUTES and its COMMIT (trees
rotating, scripts/switch_kill.py), another loses a server after the standby took over, and the rest lose whole
hosts of the ssh testbed.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testbed.host_loss import lose_host_in_job, wait_gone
from testbed.netbed import NetbedUnavailable
from testbed.ssh import SshBed, ssh_bed
from tests.integration import preloads
from tests.integration.script_workers import script_outputs

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "tests/integration/scripts/cluster_train.py"
ARGS = ["--steps", "30", "--hidden", "256"]
#: the job's processes on a host: the remote stubs, the training script, servers and schedulers
JOB_PROCESS = re.compile(r"sluice\.launch\.remote|cluster_train\.py|sluice\.launch\.cli (server|scheduler)")
SETTINGS: dict[str, Any] = {"collective": {"mode": "ps"}, "worker": {"optimizer_on": "server"},
                            "transport": {"chunk_bytes": 4096, "inflight_bytes": 4 << 20}}


def _results(printed: str) -> list[dict[str, Any]]:
    found = [json.loads(m.group(1)) for m in re.finditer(r"CLUSTER_RESULT (.*)$", printed, re.M)]
    return sorted(found, key=lambda r: r["rank"])


#: the scheduler-kill job's trees: workers 0 and 1 through aggregator 0 for half the chunks, 1 and 2 for the rest
TREES = ("0.5: worker-0>aggregator-0 worker-1>aggregator-0", "0.5: worker-1>aggregator-0 worker-2>aggregator-0")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_failover_scheduler_killed_the_standby_takes_over_and_the_job_ends_bit_identical() -> None:
    """3 workers, 2 servers and an aggregator of two static trees: the standby rebuilds the routing epoch too. Two
    standbys: worker 0 SIGKILLs the scheduler in step 5, then 3.5 s into step 12 (the first standby has taken
    over by then) that standby too; the nodes rejoin the second, which ends the job."""
    aggregation = {"aggregation": {"mode": "static", "trees": list(TREES)}}
    reference = _results("".join(script_outputs(3, 2, SETTINGS | aggregation, ROOT / SCRIPT, *ARGS, timeout=90,
                                                aggregators=1)))
    sets = ["collective.mode=ps", "worker.optimizer_on=server", "transport.chunk_bytes=4096",
            "transport.inflight_bytes=4194304", "scheduler.standby=2", "scheduler.heartbeat_interval=0.5",
            "scheduler.heartbeat_timeout=2", "aggregation.mode=static", "aggregation.trees=" + ",".join(TREES),
            "metrics.port=-1"]  # every process serves its metrics on a free port; the standby once it took over
    argv = [sys.executable, "-m", "sluice.launch.cli", "launch", *preloads.TORCH, "-w", "3", "-s", "2", "-a", "1",
            *(f"--set={s}" for s in sets), "--", sys.executable, SCRIPT, *ARGS, "--kill-scheduler-at", "5",
            "--kill-standby-at", "12", "--kill-standby-pause", "3.5"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=100)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    assert "standby scheduler ready at tcp://127.0.0.1:" in out and "killed the scheduler" in out
    assert re.search(r"sluice launch: scheduler \(pid \d+\) was killed by SIGKILL; the nodes rejoin the standby "
                     r"scheduler \(pid \d+\)", out), out[-4000:]
    assert "standby scheduler 2 ready at tcp://127.0.0.1:" in out and "killed the standby scheduler" in out
    assert re.search(r"sluice launch: standby scheduler \(pid \d+\) was killed by SIGKILL; the job goes on with the "
                     r"standby scheduler 2 \(pid \d+\)", out), out[-4000:]
    assert len(re.findall(r"has not answered heartbeats for [\d.]+ s; rejoining the standby scheduler", out)) == 12
    assert re.search(r"\[standby scheduler 2\] .*took over from the silent scheduler: 6 nodes rejoined, "
                     r"1 declarations replayed", out), out[-4000:]
    # the first standby has taken over within the pause (its lines below) on a machine not far too busy; if not,
    # the nodes it never welcomed rejoin the second all the same, and so does what follows
    first = re.search(r"\[standby scheduler\] .*took over from the silent scheduler: 6 nodes rejoined", out)
    print(f"the first standby took over before it was killed: {first is not None}")
    assert re.search(r"\[standby scheduler 2\] .*aggregation trees at routing epoch 1\n", out), out[-4000:]
    assert re.search(r"\[standby scheduler 2\] .*scheduler 0 serves Prometheus metrics at "
                     r"http://127\.0\.0\.1:\d+/metrics", out), out[-4000:]
    primary = re.search(r"scheduler ready at (tcp://127\.0\.0\.1:\d+);", out)
    assert primary and re.search(rf"\[standby scheduler 2\] .*registry entry is published by this standby now, as "
                                 rf"{re.escape(primary[1])}\n", out), out[-4000:]
    assert "[standby scheduler 2] INFO sluice.scheduler: all workers finished; job done" in out
    assert "job failed" not in out and "rejected" not in out.replace("0 messages rejected", "")
    results = _results(done.stdout)
    assert len(results) == 3 and all(r["params"] == reference[0]["params"] for r in results)
    assert all(r["after"] == [1.0] * 5 for r in results)  # the mean rank, declared and planned under standby 2
    left = subprocess.run(["pgrep", "-f", f"{SCRIPT} {' '.join(ARGS)} --kill-scheduler-at"], capture_output=True)
    assert left.returncode == 1, left.stdout


#: trees the switch-kill job rotates through every 0.2 s (aggregation.replan_s): two sets over aggregator 0
ROTATING = ("@0 0.5: worker-0>aggregator-0 worker-1>aggregator-0",
            "@0 0.5: worker-1>aggregator-0 worker-2>aggregator-0", "@1 1: worker-0>aggregator-0 worker-2>aggregator-0")


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_failover_scheduler_killed_between_routes_and_commit_the_standby_finishes_the_switch() -> None:
    """3 workers, 2 servers and an aggregator whose trees rotate every 0.2 s, rounds of many chunks behind a
    one-chunk credit: worker 0 SIGKILLs the scheduler as a ROUTES reaches it (the third, or the first after it that
    finds pushes of worker 0 queued), when its pushes of the round in flight are held back and the scheduler waits
    for its answer. The nodes rejoin the standby with what they were
    told; it sends the COMMIT of that switch, the held pushes go on, the trees go on rotating, and every round of
    every worker sums every worker exactly once (scripts/switch_kill.py exits 1 on a wrong sum)."""
    script = "tests/integration/scripts/switch_kill.py"
    sets = ["transport.chunk_bytes=16384", "transport.inflight_bytes=16384", "scheduler.standby=1",
            "scheduler.heartbeat_interval=0.5", "scheduler.heartbeat_timeout=2", "aggregation.mode=static",
            "aggregation.trees=" + ",".join(ROTATING), "aggregation.replan_s=0.2"]
    argv = [sys.executable, "-m", "sluice.launch.cli", "launch", "-w", "3", "-s", "2", "-a", "1",
            *(f"--set={s}" for s in sets), "--", sys.executable, script, "--rounds", "60", "--kill-at-routes", "3"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=80)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    killed = re.search(r"^\[worker 0\] killed the scheduler at ROUTES of routing epoch (\d+)$", out, re.M)
    assert killed, out[-6000:]
    epoch = int(killed.group(1))
    # the scheduler sent that switch's ROUTES and died before its COMMIT; the standby sent the COMMIT
    assert re.search(rf"^\[scheduler\] .*routing epoch {epoch}: ROUTES sent to 3 workers$", out, re.M), out[-6000:]
    assert not re.search(rf"^\[scheduler\] .*routing epoch {epoch}: COMMIT", out, re.M), out[-6000:]
    assert re.search(rf"^\[standby scheduler\] .*routing epoch {epoch}: COMMIT sent to 3 workers$", out, re.M), \
        out[-6000:]
    assert re.search(r"\[standby scheduler\] .*took over from the silent scheduler: 6 nodes rejoined", out), out[-4000:]
    assert "[standby scheduler] INFO sluice.scheduler: all workers finished; job done" in out
    results = sorted((json.loads(m.group(1)) for m in re.finditer(r"SWITCH_RESULT (.*)$", out, re.M)),
                     key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1, 2] and all(r["wrong"] == [] for r in results), results
    # worker 0 held pushes of its round in flight back when the scheduler died; the standby's switches went on
    assert results[0]["held_at_kill"][0] > 0, results[0]
    assert all(r["epoch"] > epoch + 1 for r in results), results
    assert "job failed" not in out and "rejected" not in out.replace("0 messages rejected", "")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_failover_a_server_restarted_after_the_standby_took_over_registers_with_the_standby() -> None:
    """ps.recover under a standby: worker 0 SIGKILLs the scheduler in step 3 and server 1 in step 12 (3 s later, the
    standby has taken over by then); the launcher restarts the server, which registers with the standby (before,
    with the dead scheduler: the standby failed the job for the server it never saw come back). The standby, started
    once the scheduler's endpoint was known, watches that port (before, none: it never left on its own)."""
    reference = _results("".join(script_outputs(2, 2, SETTINGS, ROOT / SCRIPT, "--steps", "16", "--hidden", "256",
                                                timeout=90)))
    sets = ["collective.mode=ps", "worker.optimizer_on=server", "transport.chunk_bytes=4096",
            "transport.inflight_bytes=4194304", "scheduler.standby=1", "scheduler.heartbeat_interval=0.5",
            "scheduler.heartbeat_timeout=2", "ps.recover=true"]
    argv = [sys.executable, "-m", "sluice.launch.cli", "launch", *preloads.TORCH,
            "-w", "2", "-s", "2", *(f"--set={s}" for s in sets),
            "--", sys.executable, SCRIPT, "--steps", "16", "--hidden", "256", "--step-sleep", "0.35",
            "--kill-scheduler-at", "3", "--kill-server-at", "12", "--kill-server-rank", "1"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=100)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    primary = re.search(r"scheduler ready at (tcp://127\.0\.0\.1:\d+);", out)
    assert primary and f"it takes over if the scheduler at {primary[1]} falls silent" in out, out[-4000:]  # watched
    assert re.search(r"\[standby scheduler\] .*took over from the silent scheduler", out), out[-4000:]
    assert re.search(r"sluice launch: server 1 \(pid \d+\) was killed by SIGKILL; restarting it", out), out[-4000:]
    assert re.search(r"\[standby scheduler\] .*server 1 \(node \d+, pid \d+\) is back", out), out[-4000:]
    results = _results(done.stdout)
    assert len(results) == 2 and all(r["params"] == reference[0]["params"] for r in results), out[-3000:]


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshBed]:
    try:
        with ssh_bed(tmp_path_factory.mktemp("failover"), ssh_hosts=2, second=True) as made:
            yield made
    except NetbedUnavailable as exc:
        pytest.skip(str(exc))


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_failover_lost_host_of_the_launcher_and_scheduler_the_job_ends_under_the_standby(
        bed: SshBed, tmp_path: Path) -> None:
    """The launcher's host (and the scheduler on it) is lost mid-training: the roles on h1 and h2 outlive
    their sessions, rejoin the standby on h1, and end the job there with the expected parameters."""
    reference = _results("".join(script_outputs(2, 2, SETTINGS, ROOT / SCRIPT, *ARGS, timeout=90)))
    h1, h2 = (bed.netbed.hosts[name].address for name in ("h1", "h2"))
    sets = ["collective.mode=ps", "worker.optimizer_on=server", "transport.chunk_bytes=4096",
            "transport.inflight_bytes=4194304", "scheduler.heartbeat_interval=0.5", "scheduler.heartbeat_timeout=3",
            "worker.metrics_every=5"]  # scheduler.standby: one by default, as the job spans hosts
    args = ["-H", f"{h1}:1,{h2}:1", "-w", "2", "-s", "2", *(f"--set={s}" for s in sets), "--", sys.executable, SCRIPT,
            *ARGS, "--result-dir", str(tmp_path)]

    def standby_ready(out: str) -> None:
        assert f"standby scheduler ready at tcp://{h1}:" in out, out[-3000:]

    loss = lose_host_in_job(bed, args, "launcher", r"^\[worker 0\] .*transport, steps \d+-\d+:",
                            before=standby_ready, ended=lambda: len(list(tmp_path.glob("rank.*.json"))) == 2)
    wait_gone(bed, ("h1", "h2"), JOB_PROCESS, within_s=30)
    results = [json.loads((tmp_path / f"rank.{rank}.json").read_text()) for rank in (0, 1)]
    assert results[0]["params"] == results[1]["params"] == reference[0]["params"]
    assert results[0]["after"] == results[1]["after"] == [0.5] * 5  # planned by the standby
    assert min((tmp_path / f"rank.{rank}.json").stat().st_mtime for rank in (0, 1)) > loss.lost_at


ELASTIC = "tests/integration/scripts/elastic_train.py"
#: steps of the elastic jobs: the loss comes a few steps in (about 1 s), the job re-forms and trains on
ELASTIC_STEPS = "40"


def _elastic_reference(tmp_path: Path, workers: int, switch: int, steps: int) -> list[float]:
    """The same elastic job run deliberately: stopped after step `switch` - 1, continued from its state."""
    saved = tmp_path / "state.pt"
    script_outputs(workers, 0, {}, ROOT / ELASTIC, "--steps", str(steps), "--stop-at", str(switch - 1),
                   "--save", str(saved))
    printed = "".join(script_outputs(workers, 0, {}, ROOT / ELASTIC, "--steps", str(steps), "--load", str(saved)))
    found = [json.loads(m.group(1)) for m in re.finditer(r"ELASTIC_RESULT (.*)$", printed, re.M)]
    return list(found[0]["params"])


def _lose_a_workers_host(bed: SshBed, hosts: str, workers: int, options: tuple[str, ...] = (),
                         script: tuple[str, ...] = ()) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]]]:
    """An --elastic --in-place job by allreduce over `hosts` (worker 0 on h2), with `options` (and `script`, the
    script's own); h2 is lost a few steps in (every process in it killed, its link down). The launcher's output,
    the ELASTIC_STARTs and the ELASTIC_RESULTs by rank; nothing of the job left running on h1."""
    args = ["-H", hosts, *options, "-w", str(workers), "-s", "0", "--elastic", "--in-place", "--min-workers", "2",
            "--set=scheduler.heartbeat_interval=0.5", "--set=scheduler.heartbeat_timeout=2", "--",
            sys.executable, ELASTIC, "--steps", ELASTIC_STEPS, "--pause", "0.05", *script]
    loss = lose_host_in_job(bed, args, "h2", r'ELASTIC_START .*"rank": 0', settle_s=1.0, end_s=120)  # a few steps in
    out = loss.out
    assert loss.returncode == 0, out[-6000:]
    starts = [json.loads(m.group(1)) for m in re.finditer(r"ELASTIC_START (.*)$", out, re.M)]
    results = sorted((json.loads(m.group(1)) for m in re.finditer(r"ELASTIC_RESULT (.*)$", out, re.M)),
                     key=lambda r: r["rank"])
    wait_gone(bed, ("h1",), JOB_PROCESS)
    return out, starts, results


def _assert_worker_0_replaced(tmp_path: Path, starts: list[dict[str, Any]], results: list[dict[str, Any]]) -> None:
    """Worker 0 started again in generation 1, worker 1 kept its process, both from one commit, and the job ended
    as the same 2 workers stopped at that commit and continued from it."""
    first = {s["rank"]: s["pid"] for s in starts if s["generation"] == 0}
    then = [s for s in starts if s["generation"] == 1]
    assert len(then) == 2 and then[0]["step"] == then[1]["step"] > 0, starts
    assert {s["rank"]: s["pid"] for s in then}[1] == first[1]  # worker 1 kept its process
    assert len(results) == 2 and results[0]["params"] == results[1]["params"]
    assert results[0]["params"] == _elastic_reference(tmp_path, 2, then[0]["step"], int(ELASTIC_STEPS))


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_replace_lost_host_of_a_worker_in_a_spare_slot_the_others_keep_their_processes(
        bed: SshBed, tmp_path: Path) -> None:
    """--elastic --in-place on the ssh testbed: worker 0's host h2 is lost mid-training (every process in it
    killed, its link down); worker 0 starts again in h1's spare slot, worker 1 re-forms the job in its own
    process, and the job ends as the same job run deliberately from the commit it resumed at. By allreduce:
    the coordinator tree and the rings are made anew over the new address book."""
    h1, h2 = (bed.netbed.hosts[name].address for name in ("h1", "h2"))
    out, starts, results = _lose_a_workers_host(bed, f"{h2}:1,{h1}:2", 2)
    assert f"worker 0's host {h2} is lost; its replacement starts in a spare slot on {h1}" in out, out[-4000:]
    _assert_worker_0_replaced(tmp_path, starts, results)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_replace_lost_host_of_a_worker_in_a_slot_the_discovery_script_reports_now(bed: SshBed, tmp_path: Path) -> None:
    """--elastic --in-place with --host-discovery-script, as horovodrun's: worker 0's host h2 is lost and the plan
    has no spare slot, but the discovery script now reports a second slot on h1: worker 0 starts again there,
    worker 1 keeps its process, and the job ends as the same job run deliberately from the commit."""
    h1, h2 = (bed.netbed.hosts[name].address for name in ("h1", "h2"))
    listed, script = tmp_path / "hosts.txt", tmp_path / "discover.sh"
    listed.write_text(f"{h1}:2\n")  # the slots the cluster manager offers: not the -H ones (no spare there)
    script.write_text(f"#!/bin/sh\ncat {listed}\n")
    script.chmod(0o755)
    out, starts, results = _lose_a_workers_host(  # --max-workers 2: the job does not grow into that slot first
        bed, f"{h2}:1,{h1}:1", 2, ("--host-discovery-script", str(script), "--discovery-interval", "0.5",
                                   "--max-workers", "2"))
    assert (f"worker 0's host {h2} is lost; its replacement starts in a spare slot on {h1}, which the host "
            "discovery script reports") in out, out[-4000:]
    _assert_worker_0_replaced(tmp_path, starts, results)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_replace_lost_host_of_a_worker_and_no_free_slot_the_survivors_go_on_in_their_processes(
        bed: SshBed, tmp_path: Path) -> None:
    """--elastic --in-place with no slot free: worker 0's host h2 is lost; workers 1 and 2 (on h1) go on as
    ranks 0 and 1 of a job of 2 in their own processes (Horovod's elastic shrink), and the job ends as 2 workers
    continuing, run deliberately, from the state generation 1 started from (the commit). With a standby scheduler:
    generation 1's starts once its scheduler is up, on a new port, and watches that port."""
    h1, h2 = (bed.netbed.hosts[name].address for name in ("h1", "h2"))
    saved = tmp_path / "state.pt"  # what generation 1 starts from: the commit it resumed at
    out, starts, results = _lose_a_workers_host(bed, f"{h2}:1,{h1}:2", 3, ("--set=scheduler.standby=1",),
                                                script=("--save-start", str(saved)))
    watched = re.findall(r"it takes over if the scheduler at (\S+) falls silent", out)
    assert len(watched) == 2 and watched[1] != watched[0] and "(unknown)" not in watched, out[-4000:]
    assert f"worker 0's host {h2} is lost; no other host has a free slot" in out, out[-4000:]
    assert ("going on without worker 0: the other 2 workers keep their processes, numbered again from 0 "
            "(--in-place)") in out, out[-4000:]
    assert re.search(r"\[launch\] generation 1: the job went on with 2 workers \(worker 1 is worker 0, worker 2 is "
                     r"worker 1\) and the scheduler and servers started again [\d.]+ s after the loss", out), \
        out[-4000:]
    first = {s["rank"]: s["pid"] for s in starts if s["generation"] == 0}
    then = sorted((s for s in starts if s["generation"] == 1), key=lambda s: s["rank"])
    assert [(s["rank"], s["size"]) for s in then] == [(0, 2), (1, 2)] and then[0]["step"] == then[1]["step"] > 0
    assert [s["pid"] for s in then] == [first[1], first[2]], starts  # the survivors kept their processes
    assert re.search(r"^\[worker 1\] .*ELASTIC_RESULT", out, re.M), out[-3000:]  # the new rank's prefix
    assert [r["size"] for r in results] == [2, 2] and results[0]["params"] == results[1]["params"]
    # the 2 survivors went on from the commit as 2 workers of one machine do (the 3 workers' part, over these
    # hosts, sums in another order than 3 on one machine: the other tests' jobs check that training)
    import torch

    assert torch.load(saved)["batch"] == then[0]["step"]
    printed = "".join(script_outputs(2, 0, {}, ROOT / ELASTIC, "--steps", ELASTIC_STEPS, "--load", str(saved)))
    reference = [json.loads(m.group(1)) for m in re.finditer(r"ELASTIC_RESULT (.*)$", printed, re.M)]
    assert results[0]["params"] == reference[0]["params"]
