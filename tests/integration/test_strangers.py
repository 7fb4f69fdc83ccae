"""A job admits only its own processes: strangers get nothing before, during or after, and no one takes over a name.

With CURVE on (the default), a process without the job's secret does not know the scheduler's public
key and has no key (or, at a server's sealed data listener, no ticket) the ZAP handlers admit, so its
handshakes fail and nothing it sends is ever read. A process that knows a public key (leaked, say)
still has no member key; one that read a member's ticket off the network cannot show it from another
address. A member (which holds the secret) that claims another member's name is refused message by
message: the name a connection proved with its key or ticket is bound to it.
"""

from __future__ import annotations

import re
import time
from typing import Any

import numpy as np
import pytest
import zmq

from sluice.transport.auth import JobKeys
from sluice.transport.wire import Kind, Message
from testbed.cluster import LocalCluster
from tests.integration.logging_helpers import warnings_to_stderr
from tests.integration.stranger_helpers import _heard, _register, _send, _stranger, _ticketed

LISTEN_SECONDS = 1.5


def _train_then_watch_takeovers(steps: int, secret: bytes, names: list[str]) -> dict[str, Any]:
    """Both workers train; worker 1 then sends strangers at the servers while training goes on, and
    after worker 0 has left, tries to take over its name: with random keys, and as a member (worker 1's
    real key) claiming worker 0's name."""
    from sluice.worker.node import WorkerNode

    node = WorkerNode()
    client = node.ps
    client.declare([("w", (1024,), "float32", None)])
    data, out = np.full(1024, client.rank + 1, np.float32), np.zeros(1024, np.float32)
    keys = JobKeys(secret, names)
    servers = [p for p in client.control.peers if p.role == "server"]
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    strangers: list[zmq.Socket[bytes]] = []
    report: dict[str, Any] = {}
    try:
        for step in range(steps):
            if client.rank == 1 and step == steps // 2:  # during: pushes and pulls from strangers
                for server in servers:
                    for name in ("worker-0", "worker-1", "stranger"):
                        for key in (keys.public_key(server.name), zmq.curve_keypair()[0], None):
                            sock = (_stranger(ctx, server.endpoints[0], name, key) if key is not None else
                                    _ticketed(ctx, server.endpoints[0], name, keys, "worker-0", server.name,
                                              shown_from="127.0.0.2"))
                            _send(sock, Message(Kind.PULL, sender=3, key=0, chunk=0, round=1))
                            _send(sock, Message(Kind.PUSH, sender=3, key=0, chunk=0, round=step + 1, dtype="float32",
                                                shape=(1024,), payload=np.full(1024, 1e6, np.float32)))
                            strangers.append(sock)
            client.push_pull("w", data, out).wait(30)
        report["sum"] = float(out[0])
        node.barrier("trained")
        if client.rank == 1:
            time.sleep(1.0)  # worker 0 has said goodbye: its name is free to be taken
            latest = steps
            for server in servers:
                for member in (False, True):
                    sock = (_ticketed(ctx, server.endpoints[0], "worker-0", keys, "worker-1", server.name) if member
                            else _stranger(ctx, server.endpoints[0], "worker-0", keys.public_key(server.name)))
                    _send(sock, Message(Kind.PULL, sender=3, key=0, chunk=0, round=latest))
                    _send(sock, Message(Kind.BCAST_PULL, sender=3, key=0, chunk=0, round=1))
                    strangers.append(sock)
        report["heard"] = _heard(strangers, LISTEN_SECONDS) if strangers else 0
        report["strangers"] = len(strangers)
    finally:
        for sock in strangers:
            sock.close()
        ctx.term()
        node.close()
    return report


@pytest.mark.timeout(90)
def test_strangers_get_nothing_before_during_or_after_and_names_cannot_be_taken(
    capfd: pytest.CaptureFixture[str],
) -> None:
    steps = 8
    with warnings_to_stderr(), LocalCluster(2, 1) as cluster:
        names = ["scheduler", "server-0", "worker-0", "worker-1"]
        keys = JobKeys(cluster.secret, names)
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            # before: strangers try to register as the workers, with a guessed and with a leaked scheduler key
            early = [_stranger(ctx, cluster.endpoint, f"worker-{rank}", key)
                     for rank in (0, 1) for key in (zmq.curve_keypair()[0], keys.public_key("scheduler"))]
            for rank, sock in enumerate(early):
                _send(sock, _register("worker", rank % 2))
            heard_early = _heard(early, LISTEN_SECONDS)
            results = cluster.run(_train_then_watch_takeovers, steps, cluster.secret, names, timeout=60)
            heard_early += _heard(early, 0.2)
        finally:
            for sock in early:
                sock.close()
            ctx.term()
        codes = cluster.wait(timeout=20)
    err = capfd.readouterr().err

    assert codes == [0, 0, 0, 0], f"exit codes {codes}\n{err[-3000:]}"
    assert heard_early == 0, "a stranger got an answer from the scheduler"
    # the real workers were admitted (not pre-empted) and every round summed only their pushes
    assert [r["sum"] for r in results] == [3.0, 3.0]
    assert results[1]["strangers"] == 3 * 3 + 2 and results[1]["heard"] == 0, results[1]
    assert "refused a connection" in err
    # worker 1's key claiming worker 0's name got through the handshake, and was refused message by message
    assert "authenticated as 'worker-1' that calls itself 'worker-0'" in err
    refused = re.findall(r"server 0 stopped \(\d+ messages rejected, (\d+) connections refused\)", err)
    assert refused and int(refused[0]) >= 3 * 3 + 1, err[-3000:]
    # worker 0's ticket, read off the network and shown from another address, did not get in; the server said why
    assert "worker-0 dialled from 127.0.0.1 but its connection comes from 127.0.0.2" in err
