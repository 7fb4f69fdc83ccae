"""A server's ps.replicas links: whom it mirrors to and for, the connections, hellos and restarts between them.

Placement comes from the scheduler (scheduler/recovery.py `Placement`): each server's WELCOME says
which servers hold its state and whose state it holds. Each pair of linked servers shares one
connection, dialled by the higher rank (ps/mirror.py `dials`), which then says hello; a server that
listens sends its MIRRORs once it heard it. When a linked server is restarted (ps.recover), the
scheduler's SERVER_BACK reaches the servers too: a dialler connects to the new endpoints and says
hello again, and a primary sends its holder every MIRROR not yet acknowledged; a restarted primary
mirrors what it restored. A linked server that came back on another host (it took over from a
mirror, its own host lost) holds no mirror any more: its primaries stop sending to it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from sluice.ps.mirror import Holder, MirrorSender, dials, hello_message, mirror_channel
from sluice.ps.mirror_holder import Mirrored, MirrorHolder
from sluice.ps.store import Chunk, Reply
from sluice.scheduler.node import PeerInfo, endpoint_host
from sluice.scheduler.resend import parse_endpoints
from sluice.transport.base import Transport
from sluice.transport.wire import Kind, Message, WireError, brief

log = logging.getLogger("sluice.server")
#: set by the launcher for a server it starts on the host of its mirror, its own host lost: the rank of the server
#: that holds that mirror there
ENV_TAKEOVER = "SLUICE_TAKEOVER"


def took_over_from(value: str) -> int:
    """ENV_TAKEOVER's holder rank; -1 when it is not set (or not a rank)."""
    return int(value) if value.isdigit() else -1


class MirrorLinks:
    """This server's MirrorSender (None: no live holder on another host) and MirrorHolder, and their connections."""

    def __init__(self, transport: Transport, rank: int, node_id: int, tag: str, workers: int, timeout: float,
                 every: int = 1) -> None:
        self.transport, self.rank, self.node_id, self.timeout, self.every = transport, rank, node_id, timeout, every
        self.sender: MirrorSender | None = None
        self.channel = mirror_channel(transport.config.channels)
        self.holder = MirrorHolder(tag, rank, node_id, workers, channel=self.channel, every=every)
        #: the servers linked to this one, by transport name
        self.linked: dict[str, PeerInfo] = {}
        #: where this server listens, as the scheduler's address book says: its hellos name its process so
        self.endpoints: tuple[str, ...] = ()

    def place(self, peers: Sequence[PeerInfo], links: Any) -> Callable[[Chunk], None] | None:
        """Open the mirror files of the servers this one holds and connect, as the WELCOME's meta `mirror` (`links`:
        {"holders": ranks, "holds": ranks}, from the scheduler's placement, scheduler/recovery.py) says; Recovery's
        after_commit, or None when no server on another host holds this one's state. WireError if `links` is
        malformed, SluiceError if a mirror file is locked."""
        servers = {p.rank: p for p in peers if p.role == "server"}
        if self.rank not in servers:
            raise WireError(f"a WELCOME's address book must list this server (rank {self.rank})")
        holder_ranks, held_ranks = (_ranks(links, name, servers, self.rank) for name in ("holders", "holds"))
        for rank in held_ranks:
            primary = servers[rank]
            self.holder.hold(primary.rank, primary.name, primary.node_id)
            self.linked[primary.name] = primary
        if holder_ranks:
            self.linked.update((servers[rank].name, servers[rank]) for rank in holder_ranks)
            self.sender = MirrorSender(self.rank, [
                Holder(rank, servers[rank].name, endpoint_host(servers[rank].endpoints), ready=dials(self.rank, rank))
                for rank in holder_ranks], self.node_id, self.timeout, channel=self.channel, every=self.every)
        self.endpoints = servers[self.rank].endpoints
        for peer in self.linked.values():
            if dials(self.rank, peer.rank):
                self.transport.connect(peer.name, peer.endpoints)
                self.transport.send(peer.name, self.channel, hello_message(self.node_id, self.endpoints))
        if self.sender is None:
            log.warning("server %d: no server on another host holds its state (ps.replicas): it survives a restart "
                        "on its own host, not the loss of its host", self.rank)
            return None
        log.info("server %d: mirrors its committed state on %s", self.rank, self.sender.describe())
        return self.sender.committed

    def links(self) -> dict[str, list[int]]:
        """The ranks that hold this server's state now, first the one that takes over, and those whose state it
        holds: told a standby scheduler that takes over (its placement may be older than a moved server)."""
        holders = [holder.rank for holder in self.sender.holders.values()] if self.sender is not None else []
        return {"holders": holders, "holds": [mirrored.rank for mirrored in self.holder.primaries.values()]}

    def handle(self, peer: str, msg: Message) -> list[Reply]:
        """A MIRROR (this server holds the sender's state) or a MIRROR_ACK (a hello, or a holder's ack)."""
        if msg.kind == Kind.MIRROR:
            return self.holder.take(peer, msg)
        if (msg.meta or {}).get("hello") is True:
            linked = self.linked.get(peer)
            if linked is None or linked.node_id != msg.sender or dials(self.rank, linked.rank):
                raise WireError(f"a mirror hello from {peer!r:.60}, which does not dial this server")
            endpoints = parse_endpoints((msg.meta or {}).get("endpoints"), "a mirror hello's")
            return self.sender.hello(peer, endpoints) if self.sender is not None and peer in self.sender.holders \
                else []
        if self.sender is None:
            raise WireError(f"a MIRROR_ACK from {peer!r:.60}, but this server mirrors nothing")
        return self.sender.acked(peer, msg)

    def server_back(self, msg: Message) -> list[Reply]:
        """The scheduler's SERVER_BACK: a linked server was restarted; what to send now (to it; or, when it held
        this server's state and came back on another host, the replies that waited for it alone)."""
        name = msg.meta.get("name") if msg.meta else None
        linked = self.linked.get(name) if type(name) is str else None
        if linked is None:
            return []  # not linked to this server: nothing to redo
        endpoints = parse_endpoints((msg.meta or {}).get("endpoints"), "SERVER_BACK")
        if endpoints == linked.endpoints:  # this server was welcomed after that one's replacement registered: it
            return []  # knows that process already (a second connection would drop what the first set up)
        moved = endpoint_host(endpoints) != endpoint_host(linked.endpoints)
        linked = self.linked[linked.name] = replace(linked, endpoints=tuple(endpoints))
        holds_me = self.sender is not None and linked.name in self.sender.holders
        released: list[Reply] = []
        if moved and self.sender is not None and holds_me:  # its mirror of this server was on the host lost
            released = self.sender.stop(linked.name)
            log.warning("server %d: its mirror holder server %d moved to %s (its host was lost): this server's state "
                        "is kept on %s from now on", self.rank, linked.rank, endpoint_host(endpoints),
                        self.sender.describe() or "no other host")
            if not self.sender.holders:
                self.sender = None
        if moved and not any(m.peer == linked.name for m in self.holder.primaries.values()):
            del self.linked[linked.name]  # it holds nothing of this server's, nor this server of its
            return released
        dialled = dials(self.rank, linked.rank)
        if dialled:
            self.transport.replace_peer(linked.name, endpoints)
            self.transport.send(linked.name, self.channel, hello_message(self.node_id, self.endpoints))
        if moved or not holds_me or self.sender is None:
            return released  # a moved primary this server holds mirrors its restored state at the hello
        return self.sender.holder_replaced(linked.name, dialled, endpoints)

    def add_plans(self, mirrors: Any) -> None:
        """A PLAN's meta `mirrors`: {primary rank: its part of the plan} for the servers this one mirrors."""
        if type(mirrors) is not dict:
            raise WireError(f"a PLAN's mirrors must be a map, got {brief(mirrors)}")
        for rank, tensors in mirrors.items():
            if not rank.isdigit():
                raise WireError(f"a PLAN's mirrors are keyed by server rank, got {brief(rank)}")
            if not any(m.rank == int(rank) for m in self.holder.primaries.values()):
                continue  # a plan sent again to a server that moved host: it holds no mirror now
            held = self.holder.add_plan(int(rank), tensors)
            if held:
                log.info("server %d: its mirror of server %s held %d chunks already", self.rank, rank, held)

    def release(self, rank: int) -> str | None:
        """The scheduler's MIRROR_RELEASE: server `rank` took over from its mirror here (MirrorHolder.release)."""
        self._say_rewound([m for m in self.holder.primaries.values() if m.rank == rank])
        return self.holder.release(rank)

    def _say_rewound(self, mirrors: Sequence[Mirrored]) -> None:
        for mirrored in mirrors:
            if mirrored.rewound:
                log.info("server %d: took %d restored states of server %d behind its mirror here (that server came "
                         "back from another copy)", self.rank, mirrored.rewound, mirrored.rank)

    def close(self, clean: bool) -> None:
        self._say_rewound(list(self.holder.primaries.values()))
        self.holder.close(remove=clean)
        if self.sender is not None:
            log.info("server %d: %d commits mirrored on %s (%d bytes)", self.rank, self.sender.mirrored,
                     self.sender.describe(), self.sender.bytes)


def _ranks(links: Any, name: str, servers: dict[int, PeerInfo], rank: int) -> list[int]:
    """The WELCOME's meta mirror[name]: distinct server ranks other than this one's (WireError if not)."""
    ranks = links.get(name) if type(links) is dict else None
    if (type(ranks) is not list or not all(type(r) is int and r in servers and r != rank for r in ranks)
            or len(set(ranks)) != len(ranks)):
        raise WireError(f"a WELCOME's mirror {name} must be distinct ranks of other servers, got {brief(ranks)}")
    return ranks
