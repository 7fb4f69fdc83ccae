"""ps.replicas on the ssh testbed: a server's host is lost mid-training, the replica on another host takes its shard.

The launcher host runs the scheduler and both workers; server 0 runs on h1 and server 1 on h2, each
mirroring its committed state on the other's host (ps/mirror.py). Every process in h2's namespace is
killed (its sshd and the ssh session too, so the launcher sees the session fail) and its link set
down (for the job of the launcher's default, the link first: the loss is silent, and the launcher
takes the host as lost when the scheduler says server 1 fell silent and h2 does not answer); just
before, what h2 sends to h1 is stalled, so the mirror there is a round behind what the workers
were answered. The launcher starts server 1 on h1 from the mirror there; the workers replay the pushes
it lacks and re-send what it had not answered; the job ends with the parameters of the same job without
the loss, and nothing is left.
Three jobs: SGD with momentum on the servers and Adam on the servers (their mirrors carry each
round's gradient, which the holder steps: its copy must come out bit-identical), and the optimizer
on the workers (the servers sum; the mirror carries the sum). The momentum job has 3 workers and an
aggregator, which the launcher places on the first server host: there `--server-hosts h2,h1` puts
server 0 and the aggregator on h2, the host lost. In one tree workers 0 and 1 push through it, in the
other workers 1 and 2. The launcher starts the aggregator again on h1; the workers replay to it what
they pushed through it (it came back on another host), and it sums the replays again for server 0,
which came back on h1 from the mirror a round behind; each worker replays what it pushed straight to
the server. (An aggregator that survives a server's host replays its own copies of the sums:
tests/unit/test_relay_recovery.py.)
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testbed.host_loss import lose_host_in_job, wait_gone
from testbed.netbed import NetbedUnavailable
from testbed.ssh import ROOT, SshBed, ssh_bed
from tests.integration.script_workers import script_outputs

SCRIPT = "tests/integration/scripts/cluster_train.py"
#: the job's processes on a host: the remote stubs, the training script, servers
JOB_PROCESS = re.compile(r"sluice\.launch\.remote|cluster_train\.py|sluice\.launch\.cli (server|aggregator)")
ARGS = ["--steps", "60", "--hidden", "256"]
#: every tensor through the servers, in 4 KiB chunks (chunks on both servers); the in-flight bound set, so no
#: calibration runs
SETTINGS = {"collective": {"mode": "ps"}, "ps": {"recover": True}, "transport": {"chunk_bytes": 4096,
                                                                                 "inflight_bytes": 16 << 20}}
#: case -> (worker.optimizer_on, the script's --optimizer, workers, aggregators)
CASES = {"momentum-through-an-aggregator": ("server", "sgd", 3, 1), "optimizer-on-workers": ("worker", "sgd", 2, 0)}
#: two trees over 3 workers (half the chunks each): workers 0 and 1, then 1 and 2, through aggregator 0
TREES = ("0.5: worker-0>aggregator-0 worker-1>aggregator-0", "0.5: worker-1>aggregator-0 worker-2>aggregator-0")


@pytest.fixture
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshBed]:
    """A bed per job (under a second to build): a lost host's sshd is gone with it."""
    try:
        with ssh_bed(tmp_path_factory.mktemp("replicas"), ssh_hosts=2, second=True) as made:
            yield made
    except NetbedUnavailable as exc:
        pytest.skip(str(exc))


def _reference(optimizer_on: str, optimizer: str, workers: int, aggregators: int, servers: int = 2) -> list[float]:
    settings: dict[str, Any] = {**SETTINGS, "worker": {"optimizer_on": optimizer_on}}
    if aggregators:
        settings["aggregation"] = {"mode": "static", "trees": list(TREES)}
    printed = "".join(script_outputs(workers, servers, settings, ROOT / SCRIPT, *ARGS, "--optimizer", optimizer,
                                     "--kill-server-at", "-1", timeout=120, aggregators=aggregators))
    results = [json.loads(m.group(1)) for m in re.finditer(r"CLUSTER_RESULT (.*)$", printed, re.M)]
    assert len(results) == workers and all(r["params"] == results[0]["params"] for r in results), printed[-3000:]
    return list(results[0]["params"])


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", list(CASES))
def test_lost_host_replica_takes_the_shard_and_the_job_ends_bit_identical(bed: SshBed, case: str) -> None:
    optimizer_on, optimizer, workers, aggregators = CASES[case]
    launcher, h1, h2 = (bed.netbed.hosts[name].address for name in ("launcher", "h1", "h2"))
    lost = 0 if aggregators else 1  # the server on h2: the aggregator's goes first in --server-hosts
    # the optimizer-on-workers job takes ps.replicas from the launcher's default: on, as the servers span 2 hosts
    asked = [] if optimizer_on == "worker" else ["ps.recover=true", "ps.replicas=1"]
    sets = ["collective.mode=ps", *asked, f"worker.optimizer_on={optimizer_on}",
            "transport.chunk_bytes=4096", "transport.inflight_bytes=16777216", "worker.metrics_every=10",
            "scheduler.heartbeat_interval=0.5", "scheduler.heartbeat_timeout=3",
            *(["aggregation.mode=static", "aggregation.trees=" + ",".join(TREES)] if aggregators else [])]
    args = ["-H", f"{launcher}:{workers},{h1}:1,{h2}:1", "-w", str(workers), "-s", "2", "-a", str(aggregators),
            "--server-hosts", f"{h2},{h1}" if aggregators else f"{h1},{h2}",
            *(f"--set={s}" for s in sets), "--", sys.executable, SCRIPT, *ARGS, "--optimizer", optimizer]
    # the lost server's MIRRORs stall first: its replies go a round ahead of its holder's copy
    # the job of the launcher's default loses its host silently (link down first: no connection of it is closed),
    # so the launcher learns of it from the scheduler's word and its probe of the host, not from ssh
    silent = not asked
    loss = lose_host_in_job(bed, args, "h2", r"^\[worker 0\] .*transport, steps \d+-\d+:",
                            before=lambda _: bed.netbed.choke("h2", "h1"), settle_s=1.0, silent=silent)
    out = loss.out
    assert loss.returncode == 0, out[-6000:]
    default = ("[launch] ps.replicas: each server's committed state is mirrored on another host (its servers span 2 "
               "hosts)")
    chosen = {2: 16, 3: 14}[workers]  # ceil(40 / W), at most 16 (scheduler/recovery.py)
    assert (default in out) == (not asked) and f"ps.mirror_every = {chosen} (from {workers} workers" in out, out[:3000]
    assert f"server {lost}'s host {h2} lost; replica on {h1} took shard {lost}" in out, out[-4000:]
    probed = f"server 1 is silent and its host {h2} does not answer on port 22 within 2 s: taking the host as lost"
    assert (probed in out) == silent, out[-4000:]
    assert f"server {1 - lost}: server {lost} took over from its mirror here" in out, out[-4000:]
    # the step it took the shard at: the rounds its copy had (a round of a declaration is one of its steps)
    assert re.search(rf"\[server {lost}\] .*server {lost} took shard {lost} at step \d+ from server {1 - lost}'s "
                     rf"copy on this host \(declaration 0: \d+ chunks at rounds \d+\.\.\d+", out), out[-4000:]
    assert re.search(rf"\[server {lost}\] .*server {lost}: took \d+ replayed pushes of rounds its state was behind",
                     out), out[-4000:]
    results = _results(out)
    if aggregators:
        assert re.search(rf"aggregator 0 on {h2}, .*; restarting it on {h1}, as its host is lost", out), out[-4000:]
        assert re.search(r"\[worker [01]\] .*aggregator 0 was replaced; sending it again \d+ unanswered pushes after "
                         r"[1-9]\d* answered ones \(it came back on another host; ps.replicas\)", out), out[-4000:]
    assert len(results) == workers and all(r["params"] == results[0]["params"] for r in results)
    assert results[0]["params"] == _reference(optimizer_on, optimizer, workers, aggregators)
    wait_gone(bed, ("launcher", "h1", "h2"), JOB_PROCESS)
    # this job's files only (the reference job, and tests running beside this one, have their own)
    tag = re.search(r"/dev/shm/sluice-state-([0-9a-f]+)-server-0-like files", out)
    assert tag is not None and not list(Path("/dev/shm").glob(f"sluice-state-{tag.group(1)}-*")), out[:3000]


def _results(out: str) -> list[dict[str, Any]]:
    return sorted((json.loads(m.group(1)) for m in re.finditer(r"^\[worker \d+\] CLUSTER_RESULT (.*)$", out, re.M)),
                  key=lambda r: r["rank"])


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_lost_host_twice_with_two_replicas_each_shard_comes_back_from_a_copy_left_and_the_job_ends_bit_identical(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """ps.replicas = 2, Adam on the servers: servers 0, 1, 2 on h1, h2, h3, each mirrored on both other hosts.
    h3 is lost (what it sends to h1 stalled just before, so the copy there is behind the one on h2): server 2 comes
    back on h1 from the copy there, and its restored state takes h2's copy back to its round. Once it is back, h1
    is lost too (what it sends to h2 stalled just before), with server 0 and the new server 2: both come back on
    h2, the one host left with their copies."""
    try:
        with ssh_bed(tmp_path_factory.mktemp("replicas2"), ssh_hosts=3, second=True) as bed:
            launcher, h1, h2, h3 = (bed.netbed.hosts[name].address for name in ("launcher", "h1", "h2", "h3"))
            # mirrors every 4th round: the job stalls within 8 rounds of a choke, well before it ends
            sets = ["collective.mode=ps", "ps.recover=true", "ps.replicas=2", "ps.mirror_every=4",
                    "worker.optimizer_on=server", "transport.chunk_bytes=4096", "transport.inflight_bytes=16777216",
                    "worker.metrics_every=10", "scheduler.heartbeat_interval=0.5", "scheduler.heartbeat_timeout=3"]
            args = ["-H", f"{launcher}:2,{h1}:1,{h2}:1,{h3}:1", "-w", "2", "-s", "3", "--server-hosts",
                    f"{h1},{h2},{h3}", *(f"--set={s}" for s in sets), "--", sys.executable, SCRIPT, *ARGS,
                    "--optimizer", "adam", "--step-sleep", "0.04"]  # 2.4 s of training: time to lose two hosts in
            loss = lose_host_in_job(bed, args, "h3", r"^\[worker 0\] .*transport, steps \d+-\d+:",
                                    before=lambda _: bed.netbed.choke("h3", "h1"), settle_s=1.0, end_s=90.0,
                                    # h1 once server 2 is back there, what h1 sends to h2 stalled just before
                                    then=[(r"^\[worker 0\] .*server 2 was replaced", "h1",
                                           lambda: bed.netbed.choke("h1", "h2"))])
            out = loss.out
            assert loss.returncode == 0, out[-6000:]
            for rank, lost, holder in ((2, h3, h1), (0, h1, h2), (2, h1, h2)):
                assert f"server {rank}'s host {lost} lost; replica on {holder} took shard {rank}" in out, out[-6000:]
            for holder, rank in ((0, 2), (1, 0), (1, 2)):
                assert f"server {holder}: server {rank} took over from its mirror here" in out, out[-6000:]
            # the copy on h2 was ahead of the one server 2 came back from: its restored state took it back
            assert re.search(r"\[server 1\] .*server 1: took \d+ restored states of server 2", out), out[-6000:]
            results = _results(out)
            assert len(results) == 2 and results[0]["params"] == results[1]["params"]
            assert results[0]["params"] == _reference("server", "adam", 2, 0, servers=3)
            wait_gone(bed, ("launcher", "h1", "h2", "h3"), JOB_PROCESS)
    except NetbedUnavailable as exc:
        pytest.skip(str(exc))
