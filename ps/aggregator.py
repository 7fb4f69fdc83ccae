"""The aggregator role: a relay of children's pushes behind a transport, registered with the scheduler."""

from __future__ import annotations

import logging
import threading
import time

from ps.relay import Relay
from scheduler.bootstrap import NodeEnv
from scheduler.config import SchedulerConfig
from scheduler.hierarchy.routes import parse_routing
from scheduler.node import SCHEDULER_PEER, ControlClient
from scheduler.rendezvous import parse_limits
from transport.base import open_transport
from transport.metrics import summary_lines
from transport.wire import Kind, Message, WireError, meta_field

log = logging.getLogger("sluice.aggregator")


class Aggregator:
    def __init__(self, env: NodeEnv) -> None:
        self.control_settings = SchedulerConfig(**env.section("scheduler"))
        self.done = threading.Event()
        self.exit_code = 0
        self.inflight = 0
        self.transport = open_transport(env.name, env.transport_config(), self._on_message, keys=env.job_keys(),
                                        members=env.members)
        self.relay = Relay(env.name, env.workers, alloc=self.transport.alloc)
        self.control = ControlClient(
            self.transport, env, self.control_settings, on_fatal=self._on_fatal, on_message=self._on_control,
            on_welcome=self._on_welcome,
        )

    def run(self) -> int:
        try:
            endpoints = self.transport.listen()
            self.control.register("aggregator", endpoints)
            log.info("aggregator %d serving on %s", self.control.rank, " ".join(endpoints))
            limit = self.control_settings.op_timeout
            while not self.done.wait(min(limit, 10.0)):
                for stall in self.relay.stalled(time.monotonic(), limit):
                    log.warning("%s", stall)
        finally:
            self.control.bye()
            self.transport.close(flush_seconds=2.0)
            for line in summary_lines(self.transport.stats(), f"aggregator {self.control.rank}"):
                log.info("%s", line)
        stats = self.transport.stats()
        log.info("aggregator %d stopped (%d messages rejected, %d connections refused)", self.control.rank,
                 stats["rejected"], stats["refused_connections"])
        return self.exit_code

    def _on_message(self, peer: str, channel: int, msg: Message) -> None:
        if peer == SCHEDULER_PEER:
            self.control.receive(msg)
            return
        try:
            replies = self.relay.handle(peer, channel, msg)
        except WireError as exc:
            self.transport.refuse(peer, f"rejected {msg.kind.name} from {peer!r:.60}: {exc}")
            return
        for to, reply_channel, reply in replies:
            self.transport.send(to, reply_channel, reply)

    def _on_welcome(self) -> None:
        """On the I/O thread, before anything else: who may push here, and the servers to forward to."""
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

    def _on_control(self, msg: Message) -> None:
        if msg.kind == Kind.PLAN:
            seq = meta_field(msg, "seq", int)
            self.relay.tables.add_plan(meta_field(msg, "tensors", list))
            limits = parse_limits(meta_field(msg, "limits", list))
            if limits.inflight_bytes != self.inflight:
                self.inflight = limits.inflight_bytes
                self.transport.set_inflight(self.inflight)
            self.control.send(Kind.PLAN_ACK, seq=seq)
        elif msg.kind == Kind.ROUTES:
            routing = parse_routing(meta_field(msg, "routes", list))
            for parent in self.relay.tables.install(routing):
                endpoints = next(p.endpoints for p in self.control.peers if p.name == parent)
                self.transport.connect(parent, endpoints)  # a no-op when connected in an earlier epoch
            log.info("aggregator %d: routing epoch %d, %d trees", self.control.rank, routing.epoch,
                     len(routing.trees))
            self.control.send(Kind.ROUTES_ACK, epoch=routing.epoch)
        elif msg.kind == Kind.SHUTDOWN:
            log.info("the scheduler ended the job")
            self.done.set()
        elif msg.kind == Kind.BYE:
            rank = meta_field(msg, "rank", int)
            log.info("worker %d has left the job", rank)
            for to, channel, reply in self.relay.worker_left(rank):
                self.transport.send(to, channel, reply)
        else:
            raise WireError(f"unexpected {msg.kind.name} from the scheduler")

    def _on_fatal(self, error: str) -> None:
        self.exit_code = 1
        self.done.set()


def run_aggregator(env: NodeEnv) -> int:
    return Aggregator(env).run()

