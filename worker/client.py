"""The worker's client: declare tensors, then push, pull, push_pull and broadcast them by name.

Framework-free: tensors are numpy arrays (a torch CPU tensor's `.numpy()` shares its memory).
Every operation cuts the tensor into the planned chunks, queues one message per chunk with the
tensor's priority, and returns a Handle that completes when every chunk has been answered. Replies
are written straight into the caller's output array on the transport's I/O thread.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sluice.errors import SluiceError
from sluice.scheduler.bootstrap import NodeEnv, from_environ
from sluice.scheduler.calibration import Limits
from sluice.scheduler.config import SchedulerConfig
from sluice.scheduler.hierarchy.routes import parse_routing
from sluice.scheduler.hierarchy.switch import parse_rounds
from sluice.scheduler.node import SCHEDULER_PEER, ControlClient, PeerInfo, endpoint_host
from sluice.transport.base import open_transport
from sluice.transport.config import LOCAL_ENDPOINTS
from sluice.transport.dtypes import STORAGE
from sluice.transport.timeline import TimelineConfig, part_path
from sluice.transport.wire import Flag, Kind, Message, WireError, meta_field
from sluice.worker.calibrate import Calibrator
from sluice.worker.collective.config import CollectiveConfig
from sluice.worker.collective.engine import COLLECTIVE_KINDS, CollectiveEngine
from sluice.worker.collective.mailbox import Mailbox
from sluice.worker.handle import Handle
from sluice.worker.job_priority import JobLevel, JobsConfig
from sluice.worker.resend import ServerBack, outstanding, parse_server_back, resent
from sluice.worker.routing import Router
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

TensorDecl = tuple[str, tuple[int, ...], str, dict[str, Any] | None]


@dataclass
class _Tensor:
    key: int
    name: str
    shape: tuple[int, ...]
    dtype: str
    priority: int
    channel: int
    chunks: list[tuple[int, int, int, int]]  # (chunk, offset, length, server rank)
    numel: int = 0
    round: int = 0
    bcast_version: int = 0
    opt_sent: dict[str, Any] | None = None


@dataclass
class _Op:
    handle: Handle
    out: np.ndarray | None
    dtype: str
    #: what was sent for this chunk and to which server, kept to send again to a replacement (resend.py)
    server: int = -1
    request: Message | None = None


class Client:
    def __init__(self, env: NodeEnv | None = None) -> None:
        self.trace: WorkerTrace | None = None  # the timeline, when asked for (the I/O thread reads it)
        self.env = env or from_environ()
        self.settings = self.env.transport_config()
        self.control_settings = SchedulerConfig(**self.env.section("scheduler"))
        self._tensors: dict[str, _Tensor] = {}
        self._pending: dict[tuple[Kind, int, int, int], deque[_Op]] = {}
        self._lock = threading.Lock()
        self._failure: str | None = None
        self.collective_settings = CollectiveConfig(**self.env.section("collective"))
        jobs = JobsConfig(**self.env.section("jobs"))
        try:  # with job priorities on, every push goes on the channel of the job's level
            self.job_level = JobLevel(jobs, self.settings.channels) if jobs.priorities else None
        except ValueError as exc:
            raise SluiceError(str(exc)) from None
        #: the collective engine (allreduce and the rest among workers), made when the scheduler welcomes us
        self.collectives: CollectiveEngine | None = None
        #: collective messages from workers that were welcomed (and dialled us) before we were (I/O thread)
        self._before_welcome = Mailbox(EARLY_COLLECTIVE, lambda peer, text: self.transport.refuse(peer, text))
        self._before_stage = Mailbox(EARLY_PIPELINE, lambda peer, text: self.transport.refuse(peer, text),
                                     EARLY_PIPELINE_BYTES)
        #: called with the error when the job fails (the scheduler's SHUTDOWN, a lost peer): pipeline stages
        self._failure_listeners: list[Callable[[str], None]] = []
        #: called first in close(), while the connections still work: a pipeline stage's closing handshake
        self._closing: list[Callable[[], None]] = []
        #: which aggregation tree each chunk of each round takes (worker/routing.py), and the pushes of rounds
        #: started while a switch to new trees is being agreed, sent once it is (both under _lock)
        self._router = Router(self.env.name)
        self._held: list[tuple[_Tensor, list[tuple[int, Message]]]] = []
        self._reply_ids: set[int] = set()
        self._aggregator_endpoints: dict[str, tuple[str, ...]] = {}
        self.transport = open_transport(self.env.name, self.settings, self._on_message, keys=self.env.job_keys(),
                                        members=self.env.members)
        self.control = ControlClient(self.transport, self.env, self.control_settings, on_fatal=self._on_fatal,
                                     on_welcome=self._start_collectives, on_message=self._on_control)
        if self.job_level is not None:
            self.control.job_report = self.job_level.report
        self.control.register("worker", self.transport.listen())
        self.rank = self.control.rank
        timeline = TimelineConfig(**self.env.section("timeline"))
        if timeline.path:
            self.start_trace(str(part_path(timeline.path, "worker", self.rank)))
        self.size = self.env.workers
        assert self.collectives is not None
        self.collectives.connect([p.endpoints for p in self._by_rank("worker")])
        servers = self._by_rank("server")
        self._server_names: list[str] = [p.name for p in servers]
        self._server_ids: set[int] = {p.node_id for p in servers}
        #: who may answer a push: the servers, and the aggregators of the trees
        self._reply_ids |= self._server_ids
        for peer in servers:
            self.transport.connect(peer.name, peer.endpoints)
        self._servers_local: bool = all(e.startswith(LOCAL_ENDPOINTS) for p in servers for e in p.endpoints)
        #: this worker's calibrated limits, proposed to the scheduler with the first declaration
        self.proposal: Limits | None = None
        #: the job's chunk size and in-flight bound, known after the first declaration
        self.limits: Limits | None = None
        self._calibrator: Calibrator | None = None
        if servers and not (self.settings.chunk_bytes and self.settings.inflight_bytes):
            self._calibrate()

    @property
    def servers(self) -> int:
        return len(self._server_names)

    def hosts(self, role: str) -> list[str]:
        """The host of each node of `role` ("worker" or "server"), by rank."""
        return [endpoint_host(p.endpoints) for p in self._by_rank(role)]

    def names(self, role: str) -> list[str]:
        """The transport name of each node of `role`, by rank."""
        return [p.name for p in self._by_rank(role)]

    def _start_collectives(self) -> None:
        """On the I/O thread, as the address book arrives and before any later message is handled: a
        faster worker may send coordinator messages at once."""
        aggregators = [p for p in self.control.peers if p.role == "aggregator"]  # ROUTES may come next
        self._reply_ids |= {p.node_id for p in aggregators}
        self._aggregator_endpoints.update((p.name, p.endpoints) for p in aggregators)
        workers = self._by_rank("worker")
        names = [p.name for p in workers]
        hosts = [endpoint_host(p.endpoints) for p in workers]
        levels = self.settings.channels
        engine = CollectiveEngine(
            self.transport, self.control.rank, names, hosts, self.collective_settings,
            self.settings.chunk_limit, self.control_settings.op_timeout,
            lambda priority: self.settings.channel_for(priority, levels),
        )
        self._before_welcome.attach(engine.on_message)
        self.collectives = engine

    def _by_rank(self, role: str) -> list[PeerInfo]:
        return sorted((p for p in self.control.peers if p.role == role), key=lambda p: p.rank)

    def _calibrate(self) -> None:
        timeout = min(self.control_settings.op_timeout, 60.0)
        self._calibrator = Calibrator(
            self.transport, self.control.node_id, self._server_names, self.settings.channels - 1, timeout
        )
        try:
            self.proposal, measured = self._calibrator.run(
                self.settings.chunk_bytes, self.settings.inflight_bytes, local=self._servers_local
            )
        finally:
            self._calibrator = None
        log.info("worker %d calibration: %s -> %s", self.rank, measured, self.proposal.describe())

    # ------------------------------------------------------------------ collective set-up
    def declare(self, tensors: Sequence[TensorDecl]) -> None:
        """Declare tensors on every worker at once (same names, shapes, dtypes; any order)."""
        if not self._server_names:
            raise SluiceError("this job has no parameter servers (-s 0): tensors cannot be declared for them; "
                              "use the allreduce collectives (worker.collective) instead")
        table = [[name, list(shape), dtype, opt] for name, shape, dtype, opt in tensors]
        plan, limits = self.control.declare(table, self.proposal if self.limits is None else None)
        if self.limits is None:
            self.limits = limits
            self.transport.set_inflight(limits.inflight_bytes)
        levels = max(len(plan), 1)
        try:
            new = {}
            for key, name, shape, dtype, priority, chunks in plan:
                if name not in self._tensors:
                    new[name] = _Tensor(
                        key, name, tuple(shape), dtype, priority, self.settings.channel_for(priority, levels),
                        [(c, o, n, s) for c, o, n, s in chunks], numel=sum(n for _, _, n, _ in chunks),
                    )
            sizes = [(t.key, c, n * np.dtype(STORAGE[t.dtype]).itemsize)
                     for t in new.values() for c, _, n, _ in t.chunks]
        except (TypeError, ValueError, KeyError) as exc:  # the scheduler is authenticated, but not trusted blindly
            raise SluiceError(f"malformed PLAN from the scheduler: {type(exc).__name__}") from None
        with self._lock:  # the I/O thread reads both when a switch of the aggregation trees begins
            self._tensors.update(new)
            self._router.declare(sizes)

    def set_priorities(self, priorities: dict[str, int]) -> None:
        """Give declared tensors new priorities (0 most urgent) and the channels that carry them.

        Every worker should set the same map; chunks already queued keep the priority they had.
        """
        for name, priority in priorities.items():
            if priority < 0:
                raise SluiceError(f"priority of {name!r} must be >= 0, got {priority}")
            self._tensor(name).priority = priority
        levels = max((t.priority for t in self._tensors.values()), default=0) + 1
        for tensor in self._tensors.values():
            tensor.channel = self.settings.channel_for(tensor.priority, levels)

    def barrier(self, name: str) -> None:
        self.control.barrier(name)

    def alloc(self, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        """A zeroed array in registered memory: pushing from it costs no copy when servers share the host.

        Any array works as push data; this one skips the copy into the send ring. It must not change
        while a push from it is in flight (until the handle completes).
        """
        count = 1
        for d in shape:
            count *= d
        return self.transport.alloc(count, np.dtype(STORAGE[dtype])).reshape(shape)

    def declared(self, name: str) -> bool:
        return name in self._tensors

    # ------------------------------------------------------------------ data operations
    def push_pull(self, name: str, data: np.ndarray, out: np.ndarray, opt: dict[str, Any] | None = None) -> Handle:
        """Push `data` for the next round and write the round's result (sum, or updated value) into `out`."""
        return self._push(name, data, out, opt, want_reply=True)

    def push(self, name: str, data: np.ndarray, opt: dict[str, Any] | None = None) -> Handle:
        """Push `data` for the next round; completes when every owning server has taken it."""
        return self._push(name, data, None, opt, want_reply=False)

    def pull(self, name: str, out: np.ndarray) -> Handle:
        """Write the result of this worker's latest round into `out` (waits for the round to complete)."""
        tensor = self._tensor(name)
        flat = self._flat(tensor, out, writable=True)
        pulls = [(server, Message(Kind.PULL, key=tensor.key, chunk=chunk, round=tensor.round))
                 for chunk, _, _, server in tensor.chunks]
        handle = self._start(tensor, Kind.REPLY, tensor.round, f"pull of {name!r} round {tensor.round}", flat, pulls)
        for server, msg in pulls:
            self._send(tensor, server, msg)
        return handle

    def broadcast(self, name: str, array: np.ndarray, root: int) -> Handle:
        """Root sends `array` to every worker; the others receive it into `array`."""
        tensor = self._tensor(name)
        tensor.bcast_version += 1
        version = tensor.bcast_version
        what = f"broadcast of {name!r} from worker {root}"
        if self.rank != root:
            flat = self._flat(tensor, array, writable=True)
            pulls = [(server, Message(Kind.BCAST_PULL, key=tensor.key, chunk=chunk, round=version))
                     for chunk, _, _, server in tensor.chunks]
            handle = self._start(tensor, Kind.BCAST_REPLY, version, what, flat, pulls)
            for server, msg in pulls:
                self._send(tensor, server, msg)
            return handle
        flat = self._flat(tensor, array, writable=False)
        pushes = []
        for chunk, offset, length, server in tensor.chunks:
            msg = self._data_message(Kind.BCAST_PUSH, tensor, chunk, version, flat[offset : offset + length])
            msg.flags = Flag.WANT_REPLY
            pushes.append((server, msg))
        handle = self._start(tensor, Kind.BCAST_REPLY, version, what, None, pushes)
        for server, msg in pushes:
            self._send(tensor, server, msg)
        return handle

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

    def on_close(self, fn: Callable[[], None]) -> None:
        """Call `fn()` first when the client closes (it must not raise, and should have a deadline)."""
        self._closing.append(fn)

    def close(self) -> None:
        closing, self._closing = self._closing, []
        for fn in closing:
            fn()
        if self.collectives is not None:
            self.collectives.close()
        self.control.bye()
        self.transport.close(flush_seconds=2.0)
        self.stop_trace()

    # ------------------------------------------------------------------ internals
    def _push(
        self, name: str, data: np.ndarray, out: np.ndarray | None, opt: dict[str, Any] | None, want_reply: bool
    ) -> Handle:
        tensor = self._tensor(name)
        flat = self._flat(tensor, data, writable=False)
        target = self._flat(tensor, out, writable=True) if out is not None else None
        meta = None
        if opt is not None and opt != tensor.opt_sent:
            meta, tensor.opt_sent = {"opt": opt}, dict(opt)
        verb = "push_pull" if want_reply else "push"
        pushes = []
        with self._lock:  # the round, and whether a switch of the trees holds it, agree with the I/O thread
            tensor.round += 1
            round_ = tensor.round
            if self.job_level is not None:  # replies come back on the channel a push went on
                tensor.channel = self.job_level.on_push(round_, flat.nbytes, time.monotonic())
            for chunk, offset, length, server in tensor.chunks:
                msg = self._data_message(Kind.PUSH, tensor, chunk, round_, flat[offset : offset + length])
                msg.flags, msg.meta = (Flag.WANT_REPLY if want_reply else Flag.NONE), meta
                pushes.append((server, msg))
            handle = self._register(tensor, Kind.REPLY, round_, f"{verb} of {name!r} round {round_}", target, pushes)
            if self.trace is not None:
                self.trace.round_started(name, tensor.key, round_, tensor.priority, tensor.channel, flat.nbytes, handle)
            if self._router.holding:
                self._held.append((tensor, pushes))
                return handle
            routes = self._routes(tensor, pushes)
        self._send_pushes(tensor, pushes, routes, handle)
        return handle

    def _routes(self, tensor: _Tensor, pushes: list[tuple[int, Message]]) -> list[tuple[int, int, str] | None]:
        """The tree (epoch, tree, parent) each push takes, None for its server (call with _lock held)."""
        return [self._router.route(tensor.key, msg.chunk, msg.round) for _, msg in pushes]

    def _send_pushes(self, tensor: _Tensor, pushes: list[tuple[int, Message]],
                     routes: list[tuple[int, int, str] | None], handle: Handle | None) -> None:
        """Each chunk to its server, or to its parent aggregator in the tree its round takes."""
        for (server, msg), route in zip(pushes, routes, strict=True):
            if route is None:
                self._send(tensor, server, msg)
                continue
            epoch, tree, parent = route
            msg.meta = {**(msg.meta or {}), "route": [epoch, tree]}
            msg.sender, msg.priority = self.control.node_id, tensor.priority
            if handle is not None:
                handle.via(msg.chunk, parent.replace("-", " "))
            self.transport.send(parent, tensor.channel, msg)

    def _tensor(self, name: str) -> _Tensor:
        if self._failure is not None:
            raise SluiceError(self._failure)
        tensor = self._tensors.get(name)
        if tensor is None:
            raise SluiceError(f"tensor {name!r} was not declared; declare it on every worker first")
        return tensor

    def _flat(self, tensor: _Tensor, array: np.ndarray, writable: bool) -> np.ndarray:
        if array.dtype != STORAGE[tensor.dtype] or array.size != tensor.numel:
            raise SluiceError(
                f"tensor {tensor.name!r} is {tensor.dtype}{list(tensor.shape)}; got {array.dtype}{list(array.shape)}"
            )
        if not array.flags.c_contiguous:
            if writable:
                raise SluiceError(f"output for {tensor.name!r} must be contiguous")
            array = np.ascontiguousarray(array)
        return array.reshape(-1)

    def _start(self, tensor: _Tensor, kind: Kind, round_: int, what: str, out: np.ndarray | None,
               requests: list[tuple[int, Message]]) -> Handle:
        with self._lock:
            return self._register(tensor, kind, round_, what, out, requests)

    def _register(self, tensor: _Tensor, kind: Kind, round_: int, what: str, out: np.ndarray | None,
                  requests: list[tuple[int, Message]]) -> Handle:
        """A handle for one operation on every chunk, its replies awaited (call with _lock held);
        `requests`: (server, message) per chunk, in the tensor's chunk order."""
        owners = {c: f"server {s}" for c, _, _, s in tensor.chunks}
        handle = Handle(what, owners, self.control_settings.op_timeout)
        for (chunk, offset, length, _), (server, request) in zip(tensor.chunks, requests, strict=True):
            view = out[offset : offset + length] if out is not None else None
            self._pending.setdefault((kind, tensor.key, chunk, round_), deque()).append(
                _Op(handle, view, tensor.dtype, server, request))
        return handle

    def _data_message(self, kind: Kind, tensor: _Tensor, chunk: int, round_: int, view: np.ndarray) -> Message:
        return Message(
            kind, sender=self.control.node_id, key=tensor.key, chunk=chunk, round=round_,
            priority=tensor.priority, dtype=tensor.dtype, shape=(view.size,), payload=view,
        )

    def _send(self, tensor: _Tensor, server: int, msg: Message) -> None:
        msg.sender, msg.priority = self.control.node_id, tensor.priority
        self.transport.send(self._server_names[server], tensor.channel, msg)

    def _on_message(self, peer: str, channel: int, msg: Message) -> None:
        if peer == SCHEDULER_PEER:
            self.control.receive(msg)
            return
        if msg.kind in PIPELINE_KINDS:
            if peer.startswith("worker-"):  # checked against the stage's neighbours once it attaches
                self._before_stage.deliver(peer, msg)
            else:
                self.transport.refuse(peer, f"dropped {msg.kind.name} from {peer!r:.60}: not a worker's")
            return
        if msg.kind in COLLECTIVE_KINDS:
            if peer.startswith("worker-"):  # kept until the welcome starts the engine: a worker welcomed sooner
                self._before_welcome.deliver(peer, msg)
            else:
                self.transport.refuse(peer, f"dropped {msg.kind.name} from {peer!r:.60}: not a worker's collective")
            return
        calibrator = self._calibrator
        if msg.kind == Kind.PROBE_REPLY and calibrator is not None and msg.sender in self._server_ids:
            calibrator.on_reply(msg)
            return
        if msg.kind not in (Kind.REPLY, Kind.BCAST_REPLY, Kind.ERROR) or msg.sender not in self._reply_ids:
            self.transport.refuse(peer, f"dropped unexpected {msg.kind.name} from {peer!r:.60}")
            return
        if msg.kind == Kind.ERROR:
            self._fail_round(msg)
            return
        with self._lock:
            ops = self._pending.get((msg.kind, msg.key, msg.chunk, msg.round))
            op = next((o for o in ops if (o.out is None) == (msg.payload is None)), None) if ops else None
            if op is None or ops is None:
                log.warning("dropped a reply nobody waits for: key %d chunk %d round %d", msg.key, msg.chunk, msg.round)
                return
            ops.remove(op)
            if not ops:
                del self._pending[(msg.kind, msg.key, msg.chunk, msg.round)]
        if op.out is not None:
            if msg.dtype != op.dtype or msg.shape != op.out.shape:
                op.handle._fail(f"server sent {msg.dtype}{list(msg.shape)} for a {op.dtype}{list(op.out.shape)} chunk")
                return
            np.copyto(op.out, np.frombuffer(msg.payload, STORAGE[op.dtype]))
        if self.trace is not None:
            self.trace.replied(msg.key, msg.round)
        op.handle._part_done(msg.chunk)

    def _on_control(self, msg: Message) -> None:
        """The scheduler's switch to new aggregation trees (scheduler/hierarchy/switch.py), on the I/O thread."""
        if msg.kind == Kind.ROUTES:
            routing = parse_routing(meta_field(msg, "routes", list))
            with self._lock:
                self._router.begin(routing, set(self._aggregator_endpoints))
                started = [[t.key, t.round] for t in self._tensors.values() if t.round > 0]
            self.control.send(Kind.ROUTES_ACK, epoch=routing.epoch, rounds=started)
        elif msg.kind == Kind.SERVER_BACK:
            self._server_back(parse_server_back(msg, self._server_names))
        elif msg.kind == Kind.COMMIT:
            epoch, rounds = meta_field(msg, "epoch", int), parse_rounds(meta_field(msg, "rounds", list))
            with self._lock:
                parents = self._router.commit(epoch, rounds)
                held = [(tensor, pushes, self._routes(tensor, pushes)) for tensor, pushes in self._held]
                self._held = []
            for parent in parents:  # a no-op for aggregators connected in an earlier epoch
                self.transport.connect(parent, self._aggregator_endpoints[parent])
            for tensor, pushes, routes in held:
                self._send_pushes(tensor, pushes, routes, None)
        else:
            raise WireError(f"unexpected {msg.kind.name} from the scheduler")

    def _server_back(self, back: ServerBack) -> None:
        """A dead server's replacement is ready (ps.recover): connect to it and send it again every
        request it owes an answer to (worker/resend.py), on the I/O thread."""
        self.control.peers = [dataclasses.replace(p, endpoints=back.endpoints) if p.name == back.name else p
                              for p in self.control.peers]
        self.transport.replace_peer(back.name, back.endpoints)
        by_key = {t.key: t for t in self._tensors.values()}
        with self._lock:
            requests = outstanding(((op.server, op.request) for ops in self._pending.values() for op in ops),
                                   back.rank)
            again = [(by_key[r.key], resent(r, by_key[r.key].opt_sent)) for r in requests if r.key in by_key]
            for tensor in by_key.values():  # its next push tells the replacement the live settings again
                if any(server == back.rank for _, _, _, server in tensor.chunks):
                    tensor.opt_sent = None
        log.warning("server %d was replaced; sending it again %d unanswered requests", back.rank, len(again))
        for tensor, msg in again:
            self.transport.send(back.name, tensor.channel, msg)

    def _fail_round(self, msg: Message) -> None:
        """A server says a round can never complete: fail whatever waits for it, with its words."""
        error = str(msg.meta.get("error", "the server refused the round")) if msg.meta else "refused"
        with self._lock:
            ops = self._pending.pop((Kind.REPLY, msg.key, msg.chunk, msg.round), None)
        for op in ops or ():
            op.handle._fail(error)

    def attach_pipeline(self, receiver: Callable[[str, Message], None], on_failure: Callable[[str], None]) -> None:
        """Hand pipeline messages (PIPELINE_KINDS, from workers) to `receiver` on the I/O thread, those kept
        so far first; `on_failure(error)` when the job fails (at once if it has). One stage per worker."""
        self._failure_listeners.append(on_failure)
        self._before_stage.attach(receiver)
        if self._failure is not None:
            on_failure(self._failure)

    def _on_fatal(self, error: str) -> None:
        self._failure = error
        if self.collectives is not None:
            self.collectives.fail(error)
        for listener in self._failure_listeners:
            listener(error)
        with self._lock:
            pending, self._pending = self._pending, {}
        for ops in pending.values():
            for op in ops:
                op.handle._fail(error)
