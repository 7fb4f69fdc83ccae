"""The aggregator role: a relay of children's pushes behind a transport, registered with the scheduler."""

from __future__ import annotations

import dataclasses

from sluice.ps.relay import Relay
from sluice.ps.role import Reply, Role
from sluice.scheduler.bootstrap import NodeEnv, node_name
from sluice.scheduler.declaration import parse_limits
from sluice.scheduler.hierarchy.routes import epoch_field, parse_routing
from sluice.scheduler.recovery import mirror_rounds
from sluice.scheduler.resend import Answered, parse_back, parse_server_back
from sluice.transport.prometheus import Readings
from sluice.transport.wire import Flag, Kind, Message, WireError, meta_field


class Aggregator(Role):
    role = "aggregator"

    def __init__(self, env: NodeEnv) -> None:
        super().__init__(env)
        self.relay = Relay(env.name, env.workers, alloc=self.transport.alloc)
        ps = env.section("ps")  # validated by the launcher (ps/config.py)
        if int(ps.get("replicas", 0)) > 0:  # a server taking over a lost host's shard may be rounds behind
            self.relay.kept = Answered(mirror_rounds(int(ps.get("mirror_every", 0))))

    def handle(self, peer: str, channel: int, msg: Message, now: float) -> list[Reply]:
        return self.relay.handle(peer, channel, msg, now)

    def on_welcome(self) -> None:
        """Who may push here, and the servers to forward to."""
        tables = self.relay.tables
        self.relay.node_id = self.control.node_id
        peers = self.control.peers
        tables.names = {p.node_id: p.name for p in peers if p.role in ("worker", "aggregator")}
        tables.worker_ranks = {p.name: p.rank for p in peers if p.role == "worker"}
        tables.aggregators = {p.name for p in peers if p.role == "aggregator"}
        servers = sorted((p for p in peers if p.role == "server"), key=lambda p: p.rank)
        tables.server_names = [p.name for p in servers]
        for server in servers:
            self.transport.connect(server.name, server.endpoints)

    def on_scheduler(self, msg: Message) -> None:
        if msg.kind == Kind.PLAN:
            seq = meta_field(msg, "seq", int)
            self.relay.tables.add_plan(meta_field(msg, "tensors", list))
            self.take_limits(parse_limits(meta_field(msg, "limits", list)))
            self.control.send(Kind.PLAN_ACK, seq=seq)
        elif msg.kind == Kind.ROUTES:
            routing = parse_routing(meta_field(msg, "routes", list))
            endpoints = {p.name: p.endpoints for p in self.control.peers}
            for parent in self.relay.tables.install(routing, epoch_field(msg.meta, "keep_from")):
                self.transport.connect(parent, endpoints[parent])  # a no-op when connected in an earlier epoch
            self.log.info("aggregator %d: routing epoch %d, %d trees", self.control.rank, routing.epoch,
                          len(routing.trees))
            if not (msg.meta or {}).get("again"):  # one this replacement holds again (ps.recover) needs no answer
                self.control.send(Kind.ROUTES_ACK, epoch=routing.epoch)
        elif msg.kind == Kind.AGGREGATOR_BACK:  # ps.recover: another aggregator was replaced: its parent?
            back = parse_back(msg, [node_name("aggregator", r) for r in range(self.env.aggregators)])
            # an aggregator dials only its parents, all of lower rank (scheduler/hierarchy/routes.py): a child (or
            # one of higher rank, a child some epoch) dials this one again itself, and a message on a connection
            # this one dialled to it would be refused as an impostor's (transport)
            self._moved(back.name, back.endpoints, dial=back.rank < self.control.rank)
            for to, channel, push in self.relay.parent_back(back.name):
                self.transport.send(to, channel, push)
        elif msg.kind == Kind.SERVER_BACK:  # ps.recover: a server was replaced; what it owes this one goes again
            back = parse_server_back(msg, self.relay.tables.server_names)
            self._moved(back.name, back.endpoints)
            again = self.relay.server_back(back.rank)
            replays = sum(bool(push.flags & Flag.REPLAY) for _, _, push in again)
            self.log.warning("aggregator %d: server %d was replaced; sending it again %d unanswered pushes%s",
                             self.control.rank, back.rank, len(again) - replays,
                             f" after {replays} answered ones (ps.replicas)" if replays else "")
            for to, channel, push in again:
                self.transport.send(to, channel, push)
        else:
            raise WireError(f"unexpected {msg.kind.name} from the scheduler")

    def _moved(self, name: str, endpoints: tuple[str, ...], dial: bool = True) -> None:
        """A peer replaced by a new process: its endpoints from now on, and (`dial`) a connection to it made again,
        unless this one connected to those already (it was welcomed after the replacement registered; each
        process listens on endpoints of its own: a second connection would drop what the first set up)."""
        before = next((p.endpoints for p in self.control.peers if p.name == name), ())
        self.control.peers = [dataclasses.replace(p, endpoints=endpoints) if p.name == name else p
                              for p in self.control.peers]
        if dial and before != endpoints:
            self.transport.replace_peer(name, endpoints)

    def readings(self) -> Readings:
        readings = super().readings()
        tables = self.relay.tables
        readings.plan_changes = lambda: {"routes": max(tables.epochs, default=0)}
        return readings

    def stalled(self, now: float, limit: float) -> list[str]:
        return self.relay.stalled(now, limit)

    def worker_left(self, rank: int, error: str) -> list[Reply]:
        return self.relay.worker_left(rank, error)


def run_aggregator(env: NodeEnv) -> int:
    return Aggregator(env).run()
