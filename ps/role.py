"""What a server and an aggregator share: a transport, a control client, a run loop that reports stalls, an end."""

from __future__ import annotations

import logging
import threading
import time

from sluice.scheduler.bootstrap import NodeEnv
from sluice.scheduler.calibration import Limits
from sluice.scheduler.config import SchedulerConfig
from sluice.scheduler.leaving import left, parse_error
from sluice.scheduler.node import SCHEDULER_PEER, ControlClient
from sluice.transport.base import open_transport
from sluice.transport.metrics import summary_lines
from sluice.transport.prometheus import MetricsServer, Readings, process_index, serve_metrics
from sluice.transport.wire import Kind, Message, WireError, meta_field

Reply = tuple[str, int, Message]


class Role:
    """A data-plane role: `handle` answers peers, `on_scheduler` the scheduler's other messages."""

    role = ""

    def __init__(self, env: NodeEnv) -> None:
        self.log = logging.getLogger(f"sluice.{self.role}")
        self.env = env
        self.metrics_server: MetricsServer | None = None
        self.control_settings = SchedulerConfig(**env.section("scheduler"))
        self.done = threading.Event()
        #: the scheduler ended the job (SHUTDOWN): every worker has left
        self.shut_down = False
        self.exit_code = 0
        self.inflight = 0
        self.transport = open_transport(env.name, env.transport_config(), self._on_message, keys=env.job_keys(),
                                        members=env.members)
        self.control = ControlClient(
            self.transport, env, self.control_settings, on_fatal=self._on_fatal, on_message=self._on_control,
            on_welcome=self.on_welcome,
        )

    # ------------------------------------------------------------------ what a role fills in
    def handle(self, peer: str, channel: int, msg: Message, now: float) -> list[Reply]:
        """A peer's message, validated by the transport, at `now` (time.monotonic()); the replies, or WireError
        (refused, nothing changed)."""
        raise NotImplementedError

    def on_welcome(self) -> None:
        """On the I/O thread, as the address book arrives and before any later message."""

    def on_scheduler(self, msg: Message) -> None:
        """A scheduler message other than SHUTDOWN and BYE; WireError if it has no business here."""
        raise WireError(f"unexpected {msg.kind.name} from the scheduler")

    def stalled(self, now: float, limit: float) -> list[str]:
        """Rounds waiting longer than `limit` seconds, in words."""
        return []

    def worker_left(self, rank: int, error: str) -> list[Reply]:
        """Worker `rank` said goodbye (`error`: what ended it, if it said): the messages that fail the rounds it
        can no longer join."""
        return []

    def on_close(self) -> None:
        """The transport is closed: nothing more will arrive."""

    def before_goodbye(self) -> None:
        """The role is ending, its connections still up: what must reach the scheduler first (a timeline part)."""

    def readings(self) -> Readings:
        """What this role's Prometheus endpoint shows (metrics.port): its transport's counters, and more."""
        return Readings.of_transport(self.role, self.control.rank, self.transport)

    # ------------------------------------------------------------------ shared
    def run(self) -> int:
        name = f"{self.role} {self.control.rank}"
        try:
            endpoints = self.transport.listen()
            self.control.register(self.role, endpoints)
            name = f"{self.role} {self.control.rank}"
            self.log.info("%s serving on %s", name, " ".join(endpoints))
            self.metrics_server = serve_metrics(self.env.section("metrics"), self.readings(), process_index(
                self.role, self.control.rank, self.env.servers, self.env.aggregators))
            limit = self.control_settings.op_timeout
            while not self.done.wait(min(limit, 10.0)):
                for stall in self.stalled(time.monotonic(), limit):
                    self.log.warning("%s", stall)
        finally:  # also when SIGTERM ends the role (SystemExit): what it refused is told either way
            self.before_goodbye()
            self.control.bye()
            # after SHUTDOWN the scheduler waits for this goodbye only while it gathers a timeline, and then takes
            # it at once; else it may be gone, and the goodbye would hold the sockets open for their whole linger
            self.transport.close(flush_seconds=2.0, linger_seconds=0.25 if self.shut_down else 2.0)
            self.on_close()
            stats = self.transport.stats()
            for line in summary_lines(stats, name):
                self.log.info("%s", line)
            self.log.info("%s stopped (%d messages rejected, %d connections refused)", name, stats["rejected"],
                          stats["refused_connections"])
            if self.metrics_server is not None:
                self.metrics_server.close()
        return self.exit_code

    def take_limits(self, limits: Limits) -> bool:
        """Keep to the job's in-flight bound (replies too); True when it changed."""
        if limits.inflight_bytes == self.inflight:
            return False
        self.inflight = limits.inflight_bytes
        self.transport.set_inflight(self.inflight)
        return True

    def _on_message(self, peer: str, channel: int, msg: Message) -> None:
        if peer == SCHEDULER_PEER:
            self.control.receive(msg)
            return
        try:
            replies = self.handle(peer, channel, msg, time.monotonic())
        except WireError as exc:
            self.transport.refuse(peer, f"rejected {msg.kind.name} from {peer!r:.60}: {exc}")
            return
        for to, reply_channel, reply in replies:
            self.transport.send(to, reply_channel, reply)

    def _on_control(self, msg: Message) -> None:
        if msg.kind == Kind.SHUTDOWN:
            self.log.info("the scheduler ended the job")
            self.shut_down = True
            self.done.set()
        elif msg.kind == Kind.BYE:
            rank, error = meta_field(msg, "rank", int), parse_error(msg.meta)
            self.log.info("%s", left(f"worker {rank}", error))
            for to, channel, reply in self.worker_left(rank, error):
                self.transport.send(to, channel, reply)
        else:
            self.on_scheduler(msg)

    def _on_fatal(self, error: str) -> None:
        self.exit_code = 1
        self.done.set()
