"""A server's ps.replicas links: whom it mirrors to and for, the connections, hellos and restarts between them.

Placement comes from the address book (scheduler/recovery.py `holders`, the scheduler uses the same
on the same endpoints). Each pair of linked servers shares one connection, dialled by the higher rank
(ps/mirror.py `dials`), which then says hello; a server that listens sends its MIRRORs once it heard
it. When a linked server is restarted (ps.recover), the scheduler's SERVER_BACK reaches the servers
too: a dialler connects to the new endpoints and says hello again, and a primary sends its holder
every MIRROR not yet acknowledged; a restarted primary mirrors what it restored.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from sluice.ps.mirror import MirrorSender, dials, hello_message, holders, mirror_channel
from sluice.ps.mirror_holder import MirrorHolder
from sluice.ps.store import Chunk, Reply
from sluice.scheduler.node import PeerInfo, endpoint_host
from sluice.transport.base import Transport
from sluice.transport.wire import Kind, Message, WireError, brief

log = logging.getLogger("sluice.server")
#: set (to 1) by the launcher for a server it starts on the host of its mirror, its own host lost
ENV_TAKEOVER = "SLUICE_TAKEOVER"


class MirrorLinks:
    """This server's MirrorSender (None: no server on another host) and MirrorHolder, and their connections."""

    def __init__(self, transport: Transport, rank: int, node_id: int, tag: str, workers: int, timeout: float,
                 same_host: bool, every: int = 1) -> None:
        self.transport, self.rank, self.node_id, self.timeout, self.every = transport, rank, node_id, timeout, every
        self.same_host = same_host
        self.sender: MirrorSender | None = None
        self.channel = mirror_channel(transport.config.channels)
        self.holder = MirrorHolder(tag, node_id, workers, channel=self.channel, every=every)
        #: the servers linked to this one, by transport name
        self.linked: dict[str, PeerInfo] = {}
        self.host = ""

    def place(self, peers: Sequence[PeerInfo]) -> Callable[[Chunk], None] | None:
        """Open the mirror files of the servers this one holds, connect; Recovery's after_commit, or None when no
        server on another host can hold this one's state. SluiceError if a mirror file is locked."""
        servers = sorted((p for p in peers if p.role == "server"), key=lambda p: p.rank)
        placed = holders([endpoint_host(p.endpoints) for p in servers], self.same_host)
        me = next(i for i, p in enumerate(servers) if p.rank == self.rank)
        self.host = endpoint_host(servers[me].endpoints)
        for index, holder in placed.items():
            if holder == me:
                primary = servers[index]
                self.holder.hold(primary.rank, primary.name, primary.node_id)
                self.linked[primary.name] = primary
        if me in placed:
            peer = servers[placed[me]]
            self.linked[peer.name] = peer
            self.sender = MirrorSender(self.rank, peer.rank, peer.name, endpoint_host(peer.endpoints), self.node_id,
                                       self.timeout, ready=dials(self.rank, peer.rank), channel=self.channel,
                                       every=self.every)
        for peer in self.linked.values():
            if dials(self.rank, peer.rank):
                self.transport.connect(peer.name, peer.endpoints)
                self.transport.send(peer.name, self.channel, hello_message(self.node_id))
        if self.sender is None:
            log.warning("server %d: no server on another host can mirror its state (ps.replicas = 1): it survives "
                        "a restart on its own host, not the loss of its host", self.rank)
            return None
        log.info("server %d: mirrors its committed state on %s", self.rank, self.sender.describe())
        return self.sender.committed

    def handle(self, peer: str, msg: Message) -> list[Reply]:
        """A MIRROR (this server holds the sender's state) or a MIRROR_ACK (a hello, or its holder's ack)."""
        if msg.kind == Kind.MIRROR:
            return self.holder.take(peer, msg)
        if (msg.meta or {}).get("hello") is True:
            linked = self.linked.get(peer)
            if linked is None or linked.node_id != msg.sender or dials(self.rank, linked.rank):
                raise WireError(f"a mirror hello from {peer!r:.60}, which does not dial this server")
            return self.sender.hello() if self.sender is not None and peer == self.sender.holder_peer else []
        if self.sender is None:
            raise WireError(f"a MIRROR_ACK from {peer!r:.60}, but this server mirrors nothing")
        return self.sender.acked(peer, msg)

    def server_back(self, msg: Message) -> list[Reply]:
        """The scheduler's SERVER_BACK: a linked server was restarted; what to send it now."""
        name, endpoints = msg.meta.get("name") if msg.meta else None, msg.meta.get("endpoints") if msg.meta else None
        linked = self.linked.get(name) if type(name) is str else None
        if linked is None:
            return []  # not linked to this server: nothing to redo
        if type(endpoints) is not list or not endpoints or not all(type(e) is str and e for e in endpoints):
            raise WireError(f"SERVER_BACK endpoints must be a non-empty list of strings, got {brief(endpoints)}")
        dialled = dials(self.rank, linked.rank)
        if dialled:
            self.transport.replace_peer(linked.name, endpoints)
            self.transport.send(linked.name, self.channel, hello_message(self.node_id))
        if self.sender is None or linked.name != self.sender.holder_peer:
            return []
        if endpoint_host(endpoints) == self.host and not self.same_host:  # it took over a lost host's shard here
            log.warning("server %d: its mirror holder server %d now runs on this host (%s): its state is kept on "
                        "this host only from now on", self.rank, linked.rank, self.host)
            released, self.sender = self.sender.stop(), None
            return released
        return self.sender.holder_replaced(dialled)

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

    def close(self, clean: bool) -> None:
        self.holder.close(remove=clean)
        if self.sender is not None:
            log.info("server %d: %d commits mirrored on %s (%d bytes)", self.rank, self.sender.mirrored,
                     self.sender.describe(), self.sender.bytes)
