"""The worker process as a node: its transport, control client, message routing, early mailboxes, failure and close.

Modelled on ps/role.py (a server's node around the pure store) and on ps-lite's van, which hands each
message to the `Customer` registered for it: every message kind a worker accepts has one entry in
`routes`, naming the handler that owns it and who may send it. The handlers are the parameter-server
client (worker/client.py: declare, push, pull, broadcast, replies, tree routes, server recovery), the
allreduce engine (worker/collective/, made when the scheduler welcomes this worker) and a pipeline
stage's exchange (worker/pipeline/, attached when the stage is built). Messages for a handler that does
not exist yet (a faster peer's first collective or activation) wait in a bounded mailbox. The node
alone fails its handlers when the job fails, and closes them in order.
"""

from __future__ import annotations

import atexit
import logging
import os
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from sluice.errors import SluiceError
from sluice.scheduler import culprit
from sluice.scheduler.bootstrap import NodeEnv, from_environ
from sluice.scheduler.config import SchedulerConfig
from sluice.scheduler.leaving import note_uncaught, parse_error, uncaught
from sluice.scheduler.node import SCHEDULER_PEER, ControlClient, PeerInfo, endpoint_host
from sluice.scheduler.timeline_parts import send_part
from sluice.transport.base import open_transport
from sluice.transport.metrics import StepTimes
from sluice.transport.prometheus import Readings, process_index, retried, serve_metrics
from sluice.transport.timeline import TimelineConfig, part_path
from sluice.transport.wire import Kind, Message, WireError, meta_field
from sluice.worker.client import Client
from sluice.worker.collective.config import CollectiveConfig
from sluice.worker.collective.engine import COLLECTIVE_KINDS, CollectiveEngine
from sluice.worker.collective.mailbox import Mailbox
from sluice.worker.collective.sets import EARLY_SET_BYTES, SET_KINDS, ProcessSets, set_engine_factory
from sluice.worker.hierarchy import Hierarchy
from sluice.worker.ps_join import ServerJoin
from sluice.worker.trace import WorkerTrace

log = logging.getLogger("sluice.worker")

#: collective messages kept until the scheduler's welcome starts the engine (HELLOs, first requests)
EARLY_COLLECTIVE = 4096
#: messages between pipeline stages (worker/pipeline/), kept until this worker's stage attaches: a
#: neighbour may send its first activations before the stage exists here; at most so many, and bytes
PIPELINE_KINDS = frozenset((Kind.STAGE_FORWARD, Kind.STAGE_BACKWARD, Kind.STAGE_LANE, Kind.GROUP_DATA,
                            Kind.GROUP_DONE))
EARLY_PIPELINE = 1024
EARLY_PIPELINE_BYTES = 1 << 30

Receiver = Callable[[str, Message], None]


class Handler(Protocol):
    """What the node asks of every handler besides taking its messages."""

    def fail(self, error: str) -> None:
        """The job failed: fail whatever waits, with `error` (on any thread; must not raise)."""


@dataclass(frozen=True)
class Route:
    """Who takes a kind of message, and from whom: `workers_only` refuses it from anyone but a worker."""

    receive: Receiver
    workers_only: bool
    what: str = ""  # how a refusal names what the message would have been


class WorkerNode:
    """A worker process's node; blocks in the constructor until the scheduler admits it and, with
    servers, until this worker has calibrated against them."""

    def __init__(self, env: NodeEnv | None = None) -> None:
        note_uncaught()  # a script that raises: its goodbye says what (scheduler/leaving.py)
        self.env = env or from_environ()
        self.settings = self.env.transport_config()
        self.control_settings = SchedulerConfig(**self.env.section("scheduler"))
        self.collective_settings = CollectiveConfig(**self.env.section("collective"))
        self.trace: WorkerTrace | None = None  # the timeline, when asked for (the I/O thread reads it)
        #: this worker's part of the job's timeline (timeline.path): sent to the scheduler at close
        self._timeline_part: Path | None = None
        #: the time between optimizer steps (the framework shim ticks it), for the Prometheus endpoint
        self.step_times = StepTimes()
        self.failure: str | None = None
        self._closed = False
        self._pid = os.getpid()
        #: message kind -> its handler (from peers other than the scheduler)
        self.routes: dict[Kind, Route] = {}
        #: message kind from the scheduler (beyond the control client's own) -> its handler
        self.control_routes: dict[Kind, Callable[[Message], None]] = {}
        self._handlers: list[Handler] = []
        #: called first in close(), while the connections still work: a pipeline stage's closing handshake
        self._closing: list[Callable[[], None]] = []
        #: the collective engine (allreduce and the rest among workers), made when the scheduler welcomes us
        self.collectives: CollectiveEngine | None = None
        #: process sets (Horovod's): their ranks, and an engine for each this worker is in
        self.process_sets: ProcessSets | None = None
        self._hierarchy: Hierarchy | None = None
        self.transport = open_transport(self.env.name, self.settings, self._on_message, keys=self.env.job_keys(),
                                        members=self.env.members)
        self._early_collective = self._mailbox(COLLECTIVE_KINDS, "a worker's collective", EARLY_COLLECTIVE)
        self._early_pipeline = self._mailbox(PIPELINE_KINDS, "a worker's", EARLY_PIPELINE, EARLY_PIPELINE_BYTES)
        # a faster worker may start the hierarchy's sets (worker/hierarchy.py) before this one has the address book
        self._early_sets = self._mailbox(SET_KINDS, "a worker's process set", EARLY_COLLECTIVE, EARLY_SET_BYTES)
        self.control = ControlClient(self.transport, self.env, self.control_settings, on_fatal=self._on_fatal,
                                     on_welcome=self._start_collectives, on_message=self._on_control)
        #: the parameter-server client: its kinds are routed before any server can answer
        self.ps = Client(self)
        self.ps_join = ServerJoin(self, self.ps)
        self.control.register("worker", self.transport.listen())
        self.rank = self.control.rank
        self.size = self.env.workers
        timeline = TimelineConfig(**self.env.section("timeline"))
        if timeline.path:
            self._timeline_part = part_path(timeline.path, "worker", self.rank)
            self.start_trace(str(self._timeline_part))
        self.metrics_server = serve_metrics(self.env.section("metrics"), self._readings(), process_index(
            "worker", self.rank, self.env.servers, self.env.aggregators))
        assert self.collectives is not None
        self.collectives.connect([p.endpoints for p in self.by_rank("worker")])
        self.ps.start()
        # a script that ends without close() (an exception, sys.exit) still says goodbye, with its error, and
        # unlinks its shared memory: the scheduler names the error instead of a missed heartbeat later
        atexit.register(self._close_at_exit)

    # ------------------------------------------------------------------ who is who
    def by_rank(self, role: str) -> list[PeerInfo]:
        """The nodes of `role` in the address book, by rank."""
        return sorted((p for p in self.control.peers if p.role == role), key=lambda p: p.rank)

    def hosts(self, role: str) -> list[str]:
        """The host of each node of `role` ("worker" or "server"), by rank."""
        return [endpoint_host(p.endpoints) for p in self.by_rank(role)]

    def names(self, role: str) -> list[str]:
        """The transport name of each node of `role`, by rank."""
        return [p.name for p in self.by_rank(role)]

    def barrier(self, name: str) -> None:
        """Wait until every worker reaches the barrier `name` (through the scheduler)."""
        self.control.barrier(name)

    def stats(self, reset: bool = False) -> dict[str, Any]:
        """The transport's metrics (queueing delay per priority, bytes per channel, refusals)."""
        return self.transport.stats(reset)

    # ------------------------------------------------------------------ handlers
    def route(self, kinds: Collection[Kind], receive: Receiver, workers_only: bool = False, what: str = "") -> None:
        """Hand messages of `kinds` to `receive(peer, msg)` on the I/O thread."""
        for kind in kinds:
            self.routes[kind] = Route(receive, workers_only, what)

    def add_handler(self, handler: Handler) -> None:
        """`handler.fail(error)` when the job fails (at once if it has)."""
        self._handlers.append(handler)
        if self.failure is not None:
            handler.fail(self.failure)

    def attach_pipeline(self, receiver: Receiver, on_failure: Callable[[str], None]) -> None:
        """Hand pipeline messages (PIPELINE_KINDS, from workers) to `receiver` on the I/O thread, those kept
        so far first; `on_failure(error)` when the job fails (at once if it has). One stage per worker."""
        self.add_handler(_Failing(on_failure))
        self._early_pipeline.attach(receiver)

    def on_close(self, fn: Callable[[], None]) -> None:
        """Call `fn()` first when the node closes (it must not raise, and should have a deadline)."""
        self._closing.append(fn)

    def check(self) -> None:
        """Raise the job's failure, if it has failed."""
        if self.failure is not None:
            raise SluiceError(self.failure)

    # ------------------------------------------------------------------ timeline
    def start_trace(self, path: str) -> None:
        """Record this worker's timeline into `path` (a Chrome trace; see worker/trace.py)."""
        self.stop_trace()
        self.trace = WorkerTrace.open(path, self.rank)
        self.transport.tracer = self.trace.sent

    def stop_trace(self) -> None:
        trace, self.trace = self.trace, None
        if trace is not None:
            self.transport.tracer = None
            trace.close()

    def hierarchy(self) -> Hierarchy | None:
        """The hierarchy fused gradients take (collective.hierarchical; started at the first call), or None
        where the job has none: every host must run as many workers, more than one, on more than one host."""
        if self._hierarchy is None and self.collective_settings.hierarchical and self.process_sets is not None:
            engines = self.process_sets.hierarchy()
            if engines is not None:
                self._hierarchy = Hierarchy(*engines, self.process_sets.job, self.control_settings.op_timeout)
        return self._hierarchy

    # ------------------------------------------------------------------ closing
    def close(self) -> None:
        """Close in order: the stages' handshakes, the engine, goodbye to the scheduler, the transport (once)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._close_at_exit)
        closing, self._closing = self._closing, []
        for fn in closing:
            fn()
        if self._hierarchy is not None:
            self._hierarchy.close()
        if self.process_sets is not None:
            self.process_sets.close()
        if self.collectives is not None:
            self.collectives.close()
        self._send_timeline()
        self.control.bye(uncaught())
        self.transport.close(flush_seconds=2.0)
        self.stop_trace()
        if self.metrics_server is not None:
            self.metrics_server.close()

    def _close_at_exit(self) -> None:
        """Close at exit, in this process only: a child forked from it (os.fork) inherits the handler but
        neither the node's threads nor its place in the job."""
        if os.getpid() == self._pid:
            self.close()

    def _send_timeline(self) -> None:
        """Before the goodbye (so the scheduler has it when the job ends), on a clean end only."""
        part, self._timeline_part = self._timeline_part, None
        if part is None or self.failure is not None:
            return
        self.stop_trace()
        why = send_part(self.control, part)
        if why is not None:
            log.warning("timeline: worker %d's part stays at %s: %s", self.rank, part, why)

    def _readings(self) -> Readings:
        """What the Prometheus endpoint shows (metrics.port): the transport's counters, rounds, steps, collectives."""
        readings = Readings.of_transport("worker", self.rank, self.transport)
        readings.rounds = retried(lambda: sum(self.ps.rounds().values()))
        readings.steps = self.step_times

        def decided() -> float:
            coordinator = self.collectives.coordinator if self.collectives is not None else None
            return float(coordinator.stats()["decisions"]) if coordinator is not None else 0.0

        readings.counters["collectives"] = ("collective operations the coordinator tree decided", decided)
        return readings

    # ------------------------------------------------------------------ internals (I/O thread)
    def _mailbox(self, kinds: Collection[Kind], sender: str, limit: int, limit_bytes: int = 1 << 30) -> Mailbox:
        """Route `kinds` from workers into a mailbox that keeps them until their handler attaches."""
        box = Mailbox(limit, self.transport.refuse, limit_bytes)
        self.route(kinds, box.deliver, workers_only=True, what=sender)
        return box

    def _start_collectives(self) -> None:
        """On the I/O thread, as the address book arrives and before any later message is handled: a
        faster worker may send coordinator messages at once."""
        self.ps.welcomed(self.control.peers)
        workers = self.by_rank("worker")
        levels = self.settings.channels
        engine = CollectiveEngine(
            self.transport, self.control.rank, [p.name for p in workers], [endpoint_host(p.endpoints) for p in workers],
            self.collective_settings, self.settings.chunk_limit, self.control_settings.op_timeout,
            lambda priority: self.settings.channel_for(priority, levels),
        )
        engine.on_first_orphan = lambda rank, error: culprit.report("worker", rank, error)
        self._early_collective.attach(engine.on_message)
        self.collectives = engine
        self.add_handler(engine)
        make = set_engine_factory(self.transport, self.collective_settings, self.settings.chunk_limit,
                                  self.control_settings.op_timeout,
                                  lambda priority: self.settings.channel_for(priority, levels), self.control.rank)
        self.process_sets = ProcessSets(engine, self.transport, [p.name for p in workers],
                                        [endpoint_host(p.endpoints) for p in workers], make)
        self._early_sets.attach(self.process_sets.on_message)
        self.add_handler(self.process_sets)

    def _on_message(self, peer: str, channel: int, msg: Message) -> None:
        if peer == SCHEDULER_PEER:
            self.control.receive(msg)
            return
        route = self.routes.get(msg.kind)
        if route is None:
            self.transport.refuse(peer, f"dropped unexpected {msg.kind.name} from {peer!r:.60}")
        elif route.workers_only and not peer.startswith("worker-"):
            self.transport.refuse(peer, f"dropped {msg.kind.name} from {peer!r:.60}: not {route.what}")
        else:
            route.receive(peer, msg)

    def _on_control(self, msg: Message) -> None:
        """A scheduler message the control client does not take itself, to the handler that owns its kind."""
        if msg.kind == Kind.BYE:  # another worker ended its process: collectives still waiting for it fail
            self._on_worker_left(meta_field(msg, "rank", int), parse_error(msg.meta))
            return
        handler = self.control_routes.get(msg.kind)
        if handler is None:
            raise WireError(f"unexpected {msg.kind.name} from the scheduler")
        handler(msg)

    def _on_worker_left(self, rank: int, error: str) -> None:
        workers = self.by_rank("worker")
        if not 0 <= rank < len(workers):
            raise WireError(f"the scheduler says worker {rank} left; the job has workers 0..{len(workers) - 1}")
        who = f"worker {rank} (on {endpoint_host(workers[rank].endpoints)})"
        if self.collectives is not None:
            self.collectives.worker_left(rank, who, error)
        if self.process_sets is not None:
            self.process_sets.worker_left(rank, who, error)

    def _on_fatal(self, error: str) -> None:
        self.failure = error
        for handler in list(self._handlers):
            handler.fail(error)


@dataclass(frozen=True)
class _Failing:
    """A handler that only listens for the job's failure (a pipeline stage's exchange)."""

    on_failure: Callable[[str], None]

    def fail(self, error: str) -> None:
        self.on_failure(error)
