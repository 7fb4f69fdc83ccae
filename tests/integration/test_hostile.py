"""A running job under attack: malformed and forged messages are rejected and logged, training is unharmed.

The requirement: a raw ZeroMQ client sends a running server malformed messages (wrong version,
truncated header, random bytes, sizes that do not match the frames, an unknown dtype, an unknown key,
a huge declared length). Each is rejected and logged; the server keeps serving and a training run
alongside ends with the same parameters as without the attack.

The forked servers log through `logging` to the stderr they inherit from this process, so the test
configures a stderr handler before the cluster starts and reads the process-level stderr (capfd).
"""

from __future__ import annotations

import re
import time

import numpy as np
import pytest

from testbed.cluster import LocalCluster
from tests.integration.attack import train_under_attack
from tests.integration.logging_helpers import warnings_to_stderr
from tests.integration.training import train_single

STEPS, BATCH = 20, 32
WORKERS, SERVERS = 2, 2

#: what the servers' log must say for each kind of attack (wording of transport/wire.py and ps/store.py)
LOGGED = {
    "wrong version": "protocol version 2 is not 1",
    "truncated header, random bytes": "header is not valid msgpack",
    "sizes that do not match the frames": "payload bytes, frame has",
    "shape against bytes": "does not match",
    "unknown dtype": "dtype 'complex64' is not one of",
    "huge declared length": "field 'nbytes' must be an int",
    "three frames": "expected 1 or 2 frames",
    "lists nested 1,000 deep": "nested deeper than 32 containers",
    "oversized header": "bytes exceeds 65536",
    "unknown kind": "unknown message kind 77",
    "negative key": "field 'key' must be an int",
    "shared-memory descriptor not msgpack": "shared-memory descriptor is not valid msgpack",
    # path traversal, unknown or real segments: the same kind of reason, logged once per interval
    "shared-memory descriptor into a segment not announced": "' was not announced by '",
    "not a worker of the job": "is not a worker of this job",
    "unknown key": "unknown key 1048576",
    "round that is not the next": "push for round 1099511627776",
    "wrong dtype or shape": "message carries float64",
    "kind a server does not take": "a server does not take REPLY messages",
    "calibration probe from a stranger": "rejected PROBE from '",
}
#: segments announced by a member (with CURVE, the compromised one) get as far as the file checks
LOGGED_FROM_A_MEMBER = {
    "announced: a directory or a FIFO": "is not a regular file",
    "announced: a symlink": "cannot be opened: Too many levels of symbolic links",
    "announced: a name ending in a newline": "\\n' is not a Sluice segment",
    "announced: the wrong size": "holds 4096 bytes, announced 8192",
    "outside a shared-memory segment": "lies outside segment",
}
#: without CURVE, a stranger's announcement is refused for what it is: not from a member
LOGGED_FROM_A_STRANGER = {"announced by a stranger": "announced: not a member of this job"}


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("optimizer_on", "forge_opt", "curve"),
    [
        ("worker", False, True),
        ("server", False, True),
        ("server", True, True),
        ("worker", False, False),
    ],
    ids=["worker-opt", "server-opt", "server-opt-forged", "worker-opt-curve-off"],
)
def test_server_rejects_malformed_messages_and_training_is_unharmed(
    capfd: pytest.CaptureFixture[str], optimizer_on: str, forge_opt: bool, curve: bool
) -> None:
    reference = train_single(STEPS, BATCH, "sgd")
    # every gradient through the servers, which are under attack
    config = {"worker": {"optimizer_on": optimizer_on}, "transport": {"curve": curve}, "collective": {"mode": "ps"}}
    with warnings_to_stderr(), LocalCluster(WORKERS, SERVERS, config) as cluster:
        results = cluster.run(train_under_attack, STEPS, BATCH, "sgd", forge_opt, timeout=60)
        codes = cluster.wait(timeout=20)
    err = capfd.readouterr().err

    assert codes == [0] * (1 + SERVERS + WORKERS), f"exit codes {codes}\n{err[-3000:]}"
    # training: every worker saw the same parameters after every step, equal to the unattacked reference
    assert len(results[0]["digests"]) == STEPS
    for other in results[1:]:
        assert other["digests"] == results[0]["digests"], "workers diverged after some step"
    for got, want in zip(results[0]["params"], reference, strict=True):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-6)

    # the attack ran alongside the training, every kind of it several times to every server
    report = results[0]["attack"]
    assert results[1]["attack"] is None
    assert report["rounds"] == STEPS + 1
    once = {"31 MiB header", "frame over the chunk size"}  # sent in the first round only
    assert min(n for what, n in report["sent"].items() if what not in once) >= (STEPS + 1) * SERVERS
    # to each server's 3 channels, on its TCP port and its Unix socket
    assert all(report["sent"][what] == SERVERS * 3 * 2 for what in once)

    # every kind of attack was rejected and logged, by name, and nothing crashed
    expected = {**LOGGED, **(LOGGED_FROM_A_MEMBER if curve else LOGGED_FROM_A_STRANGER)}
    missing = {what: text for what, text in expected.items() if text not in err}
    assert not missing, f"not in the servers' log: {missing}\n{err[-3000:]}"
    # with CURVE the garbage comes from a compromised member (another server's key), else from strangers
    attacker = r"'server-\d'" if curve else r"'stranger-[0-9a-f]{12}'"
    assert re.search(rf"dropped a message from {attacker} on channel \d", err)
    assert re.search(rf"rejected PUSH from {attacker}", err)
    assert re.search(r"rejected PUSH from 'worker-0'", err)
    # the scheduler took its share of the attack and kept hearing every node's heartbeats
    refused_by_scheduler = (
        r"sluice.scheduler:rejected \w+ from 'scheduler': \w+ from unregistered peer" if curve
        else r"sluice.transport:rejected \w+ from 'stranger-[0-9a-f]{12}': not a member of this job")
    # (failed once in 17 suites, not reproduced in 32 runs: the scheduler's own lines say what it refused instead)
    scheduler_lines = "\n".join(line for line in err.splitlines()
                                if "sluice.scheduler" in line or "'scheduler'" in line)
    assert re.search(refused_by_scheduler, err), scheduler_lines[-4000:]
    assert "sent no heartbeat" not in err
    counted = re.findall(r"scheduler stopped \((\d+) messages rejected, (\d+) connections refused\)", err)
    assert counted and int(counted[0][0]) >= report["rounds"], err[-2000:]
    for forbidden in ("Traceback", "Logging error", "I/O thread failed", "failed; message dropped", "ERROR:"):
        lines = [line for line in err.splitlines() if forbidden in line]
        assert not lines, f"{forbidden!r} in the log: {lines[:10]}"
    stopped = re.findall(r"server (\d+) stopped \((\d+) messages rejected, (\d+) connections refused\)", err)
    assert sorted(int(rank) for rank, _, _ in stopped) == list(range(SERVERS)), err[-3000:]
    assert all(int(count) >= report["rounds"] for _, count, _ in stopped)
    if curve:  # strangers never got a message in: each of their connections was refused, and counted
        assert report["strangers"] == 2 * SERVERS * 3 * 2
        assert all(int(refused) >= 1 for _, _, refused in stopped), stopped
        assert "refused a connection" in err
    else:  # strangers that send nothing but garbage are cut off
        assert "messages and little else: its messages are dropped from now on" in err


def _impersonate_the_scheduler() -> list[str]:
    """A stranger calling itself 'scheduler' tells server 0 to shut down; the job must not notice."""
    import zmq

    from sluice.transport.wire import Kind, Message, encode
    from sluice.worker.node import WorkerNode

    node = WorkerNode()
    client = node.ps
    client.declare([("w", (8,), "float32", None)])
    out = np.zeros(8, np.float32)
    client.push_pull("w", np.ones(8, np.float32), out).wait()
    server = next(p for p in client.control.peers if p.role == "server" and p.rank == 0)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"scheduler")
    sock.connect(server.endpoints[0])
    for kind in (Kind.SHUTDOWN, Kind.ERROR, Kind.NODE_LOST):
        sock.send_multipart(encode(Message(kind, sender=0, meta={"error": "forged"})))
    time.sleep(1.0)
    sock.close(linger=1000)
    ctx.term()
    client.push_pull("w", np.ones(8, np.float32), out).wait(10)
    node.close()
    return [str(v) for v in out[:2]]


@pytest.mark.timeout(60)
def test_a_stranger_cannot_speak_for_the_scheduler(capfd: pytest.CaptureFixture[str]) -> None:
    config = {"transport": {"curve": False}}  # with CURVE a stranger cannot connect at all (tested above)
    with warnings_to_stderr(), LocalCluster(1, 1, config) as cluster:
        assert cluster.run(_impersonate_the_scheduler) == [["1.0", "1.0"]]
        assert cluster.wait(timeout=20) == [0, 0, 0]
    assert "calls itself 'scheduler'" in capfd.readouterr().err
