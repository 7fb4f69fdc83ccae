"""The server role: one shard store behind a transport, registered with the scheduler."""

from __future__ import annotations

import logging
import threading
import time

from ps.config import ServerConfig
from ps.store import ShardStore
from scheduler import culprit
from scheduler.bootstrap import NodeEnv
from scheduler.config import SchedulerConfig
from scheduler.node import SCHEDULER_PEER, ControlClient
from scheduler.rendezvous import parse_limits
from transport.base import open_transport
from transport.metrics import summary_lines
from transport.wire import Kind, Message, WireError, meta_field

log = logging.getLogger("sluice.server")


class Server:
    def __init__(self, env: NodeEnv) -> None:
        self.settings = ServerConfig(**env.section("ps"))
        self.control_settings = SchedulerConfig(**env.section("scheduler"))
        self.done = threading.Event()
        self.exit_code = 0
        self.inflight = 0
        self.transport = open_transport(env.name, env.transport_config(), self._on_message, keys=env.job_keys(),
                                        members=env.members)
        self.store = ShardStore(-1, env.workers, self.settings.sync, alloc=self.transport.alloc)
        self.store.on_first_orphan = self._report_orphan
        self.control = ControlClient(
            self.transport, env, self.control_settings, on_fatal=self._on_fatal, on_message=self._on_control,
            on_welcome=self._on_welcome,
        )

    def run(self) -> int:
        try:
            endpoints = self.transport.listen()
            self.control.register("server", endpoints)
            log.info("server %d serving on %s", self.control.rank, " ".join(endpoints))
            limit = self.control_settings.op_timeout
            while not self.done.wait(min(limit, 10.0)):
                for stall in self.store.stalled(time.monotonic(), limit):
                    log.warning("%s", stall)
        finally:
            self.control.bye()
            self.transport.close(flush_seconds=2.0)
            for line in summary_lines(self.transport.stats(), f"server {self.control.rank}"):
                log.info("%s", line)
        stats = self.transport.stats()
        log.info("server %d stopped (%d messages rejected, %d connections refused)", self.control.rank,
                 stats["rejected"], stats["refused_connections"])
        return self.exit_code

    def _on_message(self, peer: str, channel: int, msg: Message) -> None:
        if peer == SCHEDULER_PEER:
            self.control.receive(msg)
            return
        try:
            if msg.kind == Kind.PROBE:  # a worker's calibration: answer at once, no payload
                self.store.check_worker(peer, msg.sender)
                self.transport.send(peer, channel, Message(Kind.PROBE_REPLY, sender=self.store.node_id,
                                                           round=msg.round, priority=msg.priority))
                return
            replies = self.store.handle(peer, channel, msg)
        except WireError as exc:
            self.transport.refuse(peer, f"rejected {msg.kind.name} from {peer!r:.60}: {exc}")
            return
        for to, reply_channel, reply in replies:
            self.transport.send(to, reply_channel, reply)

    def _on_welcome(self) -> None:
        """On the I/O thread, before anything else: workers may probe this server the moment they are admitted."""
        self.store.node_id = self.control.node_id
        self.store.worker_ids = {p.node_id: (p.name, p.rank) for p in self.control.peers if p.role == "worker"}
        self.store.aggregator_ids = {p.node_id: p.name for p in self.control.peers if p.role == "aggregator"}

    def _on_control(self, msg: Message) -> None:
        if msg.kind == Kind.PLAN:
            seq = meta_field(msg, "seq", int)
            try:
                self.store.add_plan(meta_field(msg, "tensors", list))
                limits = parse_limits(meta_field(msg, "limits", list))
            except (ValueError, TypeError, KeyError) as exc:
                self.control.fail(f"server {self.control.rank} cannot take the plan of declaration {seq}: {exc}")
                return
            if limits.inflight_bytes != self.inflight:
                self.inflight = limits.inflight_bytes
                self.transport.set_inflight(self.inflight)  # replies keep to the job's bound too
                self.transport.stats(reset=True)  # the calibration probes are over: metrics start here
                log.info("server %d: %s", self.control.rank, limits.describe())
            self.control.send(Kind.PLAN_ACK, seq=seq)
        elif msg.kind == Kind.SHUTDOWN:
            log.info("the scheduler ended the job")
            self.done.set()
        elif msg.kind == Kind.BYE:
            rank = meta_field(msg, "rank", int)
            log.info("worker %d has left the job", rank)
            for to, channel, reply in self.store.worker_left(rank):
                self.transport.send(to, channel, reply)
        else:
            raise WireError(f"unexpected {msg.kind.name} from the scheduler")

    def _report_orphan(self, rank: int, error: str) -> None:
        """The first worker to leave early is the cause of every failed round after it: name it, once."""
        culprit.report("worker", rank, error)

    def _on_fatal(self, error: str) -> None:
        self.exit_code = 1
        self.done.set()


def run_server(env: NodeEnv) -> int:
    return Server(env).run()
