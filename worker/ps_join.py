"""A worker's join() toward the parameter servers: inside it the servers count this worker as pushing zeros.

Under the parameter-server route a worker with fewer batches calls join() like under allreduce: it
tells every server (JOIN, joined=true), so each round the others push completes without it, its part
zeros (an average still divides by every worker, as Horovod's join does). When every worker has
joined, each says it is back (joined=false) and waits for every server's echo before the join
returns, so that no round completes without it afterwards; then the workers take the highest round
of each tensor any of them reached (an allreduce of the round numbers), so the one that skipped rounds
pushes the next round with the others.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

import numpy as np

from sluice.errors import SluiceError
from sluice.transport.wire import Kind, Message

if TYPE_CHECKING:
    from sluice.worker.client import Client
    from sluice.worker.collective.engine import CollectiveEngine
    from sluice.worker.node import WorkerNode


class ServerJoin:
    def __init__(self, node: WorkerNode, client: Client) -> None:
        self._node, self._client = node, client
        self._cond = threading.Condition()
        self._echoes: set[str] = set()
        self._epoch = 0
        #: what this worker told the servers last (None: nothing): a server's replacement is told it again
        self._joined: bool | None = None
        node.route((Kind.JOIN,), self._on_echo)
        client.server_back_hooks.append(self.server_back)

    def enter(self) -> None:
        """This worker is inside join(): every server counts it as pushing zeros."""
        self._send(True)

    def leave(self, timeout: float) -> None:
        """Every worker has joined: be counted again, once every server has said so."""
        with self._cond:
            self._epoch += 1
            self._echoes = set()
        self._send(False)
        deadline = time.monotonic() + timeout
        servers = set(self._client.server_names)
        with self._cond:
            while not servers <= self._echoes:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SluiceError(f"join: servers {sorted(servers - self._echoes)} did not answer within "
                                      f"{timeout:.0f} s that this worker is back")
                self._cond.wait(left)

    def catch_up(self, engine: CollectiveEngine, name: str) -> None:
        """Every worker takes the highest round any of them reached, tensor by tensor (all must call it)."""
        current = self._client.rounds()
        names = sorted(current)
        if not names:
            return
        rounds = np.array([current[n] for n in names], np.int64)
        engine.allreduce(name, [rounds], "int64", "max").wait()
        self._client.set_rounds(dict(zip(names, rounds.tolist(), strict=True)))

    def server_back(self, server: str) -> None:
        """`server` was replaced (ps.recover; I/O thread): what this worker told the dead one, again, while it
        matters: inside join() (else the replacement's rounds wait for its pushes), or back from it with that
        server's echo not yet in (else leave() waits for it in vain)."""
        with self._cond:
            joined = self._joined
            again = joined is True or (joined is False and server not in self._echoes)
        if again and joined is not None:
            self._send(joined, [server])

    def _send(self, joined: bool, servers: list[str] | None = None) -> None:
        with self._cond:
            self._joined = joined
        for server in self._client.server_names if servers is None else servers:
            msg = Message(Kind.JOIN, sender=self._node.control.node_id, round=self._epoch, meta={"joined": joined})
            self._node.transport.send(server, 0, msg)

    def _on_echo(self, peer: str, msg: Message) -> None:
        if peer not in self._client.server_names or msg.round != self._epoch:
            self._node.transport.refuse(peer, f"dropped an unexpected JOIN from {peer!r:.60}")
            return
        with self._cond:
            self._echoes.add(peer)
            self._cond.notify_all()
