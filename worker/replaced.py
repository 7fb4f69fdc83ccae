"""A worker's part when a server or an aggregator of its job is replaced (ps.recover): what it sends again, and to whom.

The scheduler's SERVER_BACK or AGGREGATOR_BACK names the replacement's endpoints once it has its plans
(scheduler/returning.py). The worker connects to it (Transport.replace_peer: the dead one's queues,
credit and shared memory dropped) and sends it again, marked RESEND, every request of its own that it
left unanswered (scheduler/resend.py): to a server, what went straight to it (with ps.replicas, after
the answered pushes it may lack, replayed); to an aggregator, what went up a tree through it. Runs on
the I/O thread, as the client's other handlers.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

from sluice.scheduler.node import endpoint_host
from sluice.scheduler.resend import ServerBack, outstanding, resent

if TYPE_CHECKING:
    from sluice.transport.wire import Message
    from sluice.worker.client import Client
    from sluice.worker.tensors import Tensor

log = logging.getLogger("sluice.worker")


def _reconnect(client: Client, back: ServerBack) -> None:
    client.control.peers = [dataclasses.replace(p, endpoints=back.endpoints) if p.name == back.name else p
                            for p in client.control.peers]
    client.transport.replace_peer(back.name, back.endpoints)


def server_back(client: Client, back: ServerBack) -> None:
    """A dead server's replacement is ready: every request it owes an answer to, again (first what the worker's
    parts told the dead one, as join())."""
    _reconnect(client, back)
    for hook in client.server_back_hooks:
        hook(back.name)
    by_key = {t.key: t for t in client._tensors.values()}
    with client._lock:
        requests = outstanding(client._pending.requests(), back.rank)
        again = [(by_key[r.key], resent(r, by_key[r.key].opt_sent)) for r in requests if r.key in by_key]
        replays = [] if client._answered is None else [  # first: the replacement may be rounds behind
            (by_key[r.key], r) for r in client._answered.replays(back.rank) if r.key in by_key]
        for tensor in by_key.values():  # its next push tells the replacement the live settings again
            if any(server == back.rank for _, _, _, server in tensor.chunks):
                tensor.opt_sent = None
    log.warning("server %d was replaced; sending it again %d unanswered requests%s", back.rank, len(again),
                f" after {len(replays)} answered pushes (ps.replicas)" if replays else "")
    for tensor, msg in replays + again:
        client.transport.send(back.name, tensor.channel, msg)


def aggregator_back(client: Client, back: ServerBack) -> None:
    """A dead aggregator's replacement is ready: every push this worker sent up a tree through it, unanswered;
    first, when it came back on another host (its own was lost, and with it its copies of the sums a server
    that took over a lost shard may lack: ps.replicas), the answered ones kept, to be summed again."""
    before = next((p.endpoints for p in client.control.peers if p.name == back.name), ())
    _reconnect(client, back)
    client._aggregator_endpoints[back.name] = back.endpoints
    by_key = {t.key: t for t in client._tensors.values()}

    def through(request: Message) -> bool:
        route = (request.meta or {}).get("route")
        return route is not None and client._router.parent(route[0], route[1]) == back.name

    moved = endpoint_host(list(before)) != endpoint_host(list(back.endpoints))
    again: list[tuple[Tensor, Message]] = []
    with client._lock:
        if moved and client._answered is not None:
            again += [(by_key[r.key], r) for r in client._answered.replays(-1, through) if r.key in by_key]
        replays, seen = len(again), set()
        for _, request in client._pending.requests():
            if request is None or id(request) in seen or request.key not in by_key or not through(request):
                continue
            seen.add(id(request))
            again.append((by_key[request.key], resent(request, None)))
    log.warning("aggregator %d was replaced; sending it again %d unanswered pushes%s", back.rank, len(again) - replays,
                f" after {replays} answered ones (it came back on another host; ps.replicas)" if replays else "")
    for tensor, msg in again:
        client.transport.send(back.name, tensor.channel, msg)
