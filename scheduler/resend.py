"""What a worker or an aggregator sends again to a server that replaced a dead one (ps.recover; pure).

Every push a node sends straight to a server (a worker's own, or an aggregator's sum of its subtree)
is kept until that chunk is answered; a worker's payload is a view of the caller's array, which must
not change until the handle completes (Client.alloc's rule), and an aggregator's is its sum buffer,
which the chunk's next round overwrites only after this one's reply: both still hold the bytes first
sent. When the scheduler says SERVER_BACK, every unanswered push to the dead server goes to its
replacement again, marked RESEND: the replacement restored the rounds it had committed
(ps/snapshot.py) and answers a re-sent push of such a round without applying it twice. A worker's
push that went up an aggregation tree is the aggregator's to send again, inside its sum.

With ps.replicas the server that takes over a lost host's shard may hold its state up to
ps.mirror_every rounds behind what was answered (ps/mirror.py), and the arrays may have changed
since: so each sender keeps its pushes of that many answered rounds per chunk, copied (`Answered`),
and replays them (RESEND | REPLAY) first, oldest first. A worker keeps those that went up a tree too:
an aggregator lost with a server's host took its copies of the sums along, and its replacement sums
the replays of its children again (ps/relay.py). The server gets the pieces of each round it
redoes exactly as it first did (the same senders, the same sums), so its rank-ordered sum comes out
bit-identical.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sluice.transport.wire import Flag, Kind, Message, WireError, brief, meta_field

log = logging.getLogger("sluice.worker")


@dataclass(frozen=True)
class ServerBack:
    rank: int
    name: str
    endpoints: tuple[str, ...]


def parse_endpoints(value: object, what: str) -> tuple[str, ...]:
    """A message's endpoints: a non-empty list of strings (WireError naming `what` if not)."""
    if type(value) is not list or not value or not all(isinstance(e, str) and e for e in value):
        raise WireError(f"{what} endpoints must be a non-empty list of strings, got {brief(value)}")
    return tuple(value)


def parse_back(msg: Message, names: Sequence[str]) -> ServerBack:
    """The scheduler's SERVER_BACK or AGGREGATOR_BACK, checked against `names`, that role's names by rank."""
    rank, name = meta_field(msg, "rank", int), meta_field(msg, "name", str)
    endpoints = meta_field(msg, "endpoints", list)
    if not 0 <= rank < len(names) or names[rank] != name:
        raise WireError(f"{msg.kind.name} names {brief(name)} as number {rank}, which is not one of this job's")
    return ServerBack(rank, name, parse_endpoints(endpoints, msg.kind.name))


def parse_server_back(msg: Message, server_names: Sequence[str]) -> ServerBack:
    """The scheduler's SERVER_BACK, checked against the servers this node knows."""
    return parse_back(msg, server_names)


def resent(request: Message, opt: dict[str, Any] | None) -> Message:
    """A copy of `request` marked RESEND; a push carries the tensor's current optimizer settings, which
    the replacement may not have (they are sent only when they change)."""
    meta = dict(request.meta or {})
    if request.kind == Kind.PUSH and opt is not None:
        meta["opt"] = opt
    return dataclasses.replace(request, flags=request.flags | Flag.RESEND, meta=meta or None, shm=None)


def direct(request: Message) -> bool:
    """Whether `request` went straight to its server, not up an aggregation tree (meta `route`)."""
    return not (request.meta and "route" in request.meta)


def outstanding(requests: Iterable[tuple[int, Message | None]], server: int) -> list[Message]:
    """The requests still unanswered that went straight to `server`, each once (an operation may wait on a
    chunk under several handles, e.g. a push_pull and a pull of the same round)."""
    seen: set[int] = set()
    out = []
    for owner, request in requests:
        if owner == server and request is not None and id(request) not in seen and direct(request):
            seen.add(id(request))
            out.append(request)
    return out


def host_memory() -> int:
    """This host's physical memory in bytes (0 when the system does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0


class Answered:
    """ps.replicas: each chunk's last `depth` pushes that were answered, with their payloads copied (into buffers
    kept per chunk and reused), and the server each went to. Says once, as a warning, when the copies pass
    `warn_bytes` (an eighth of the host's memory unless given): ps.mirror_every sets how many there are."""

    def __init__(self, depth: int, warn_bytes: int | None = None) -> None:
        self.depth = depth
        self._kept: dict[tuple[int, int], deque[tuple[int, Message, np.ndarray]]] = {}
        #: bytes of the copies held now
        self.kept_bytes = 0
        self._warn_bytes = host_memory() // 8 if warn_bytes is None else warn_bytes
        self.warned = False

    def keep(self, server: int, request: Message) -> None:
        """`request` (a PUSH) was answered: keep it, in place of the chunk's oldest once `depth` are kept."""
        source = np.frombuffer(request.payload or b"", np.uint8) if not isinstance(request.payload, np.ndarray) \
            else request.payload.reshape(-1).view(np.uint8)
        kept = self._kept.setdefault((request.key, request.chunk), deque())
        oldest = kept.popleft() if len(kept) >= self.depth else None
        if oldest is not None and oldest[2].nbytes == source.nbytes:
            buffer = oldest[2]
        else:
            buffer = np.empty_like(source)
            self.kept_bytes += source.nbytes - (oldest[2].nbytes if oldest is not None else 0)
            if self.kept_bytes > self._warn_bytes > 0 and not self.warned:
                self.warned = True
                log.warning("ps.replicas: this worker keeps copies of its pushes of the last %d answered rounds, to "
                            "replay to a server that takes over a lost host's shard: %.0f MiB so far, more than "
                            "%.0f MiB (an eighth of this host's memory); a smaller ps.mirror_every keeps fewer "
                            "(more mirror traffic), ps.replicas = 0 none", self.depth, self.kept_bytes / 2**20,
                            self._warn_bytes / 2**20)
        np.copyto(buffer, source)
        kept.append((server, dataclasses.replace(request, payload=buffer, shm=None), buffer))

    def replays(self, server: int, wanted: Callable[[Message], bool] = direct) -> list[Message]:
        """The kept pushes for `server` that are `wanted` (by default those that went straight to it), oldest first,
        marked RESEND | REPLAY (each with the settings it was sent with: a replayed round is stepped as it was)."""
        return [dataclasses.replace(request, flags=(request.flags | Flag.RESEND | Flag.REPLAY) & ~Flag.WANT_REPLY)
                for kept in self._kept.values() for owner, request, _ in kept
                if (owner == server or server < 0) and wanted(request)]
