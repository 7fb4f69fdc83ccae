"""The parameter-server client of a worker node: declare tensors, then push, pull and broadcast them by name.

Framework-free: tensors are numpy arrays (a torch CPU tensor's `.numpy()` shares its memory).
Every operation cuts the tensor into the planned chunks, queues one message per chunk with the
tensor's priority, and returns a Handle that completes when every chunk has been answered. Replies
are written straight into the caller's output array on the transport's I/O thread. The node
(worker/node.py) routes to it the servers' replies, calibration probes, and the scheduler's switches of
aggregation trees and replaced servers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from sluice.errors import SluiceError
from sluice.scheduler.bootstrap import node_name
from sluice.scheduler.calibration import Limits
from sluice.scheduler.hierarchy.midround import parse_moved
from sluice.scheduler.hierarchy.routes import epoch_field, parse_routing
from sluice.scheduler.hierarchy.switch import parse_rounds
from sluice.scheduler.node import PeerInfo
from sluice.scheduler.recovery import mirror_rounds
from sluice.scheduler.resend import Answered, parse_back, parse_server_back
from sluice.transport.config import on_this_host
from sluice.transport.dtypes import STORAGE
from sluice.transport.wire import Flag, Kind, Message, meta_field
from sluice.worker.calibrate import Calibrator
from sluice.worker.handle import Handle
from sluice.worker.job_priority import JobLevel, JobsConfig
from sluice.worker.midround import HeldBack
from sluice.worker.replaced import aggregator_back, server_back
from sluice.worker.routing import Router
from sluice.worker.tensors import Pending, Tensor, TensorDecl, chunk_sizes, parse_plan

if TYPE_CHECKING:
    from sluice.worker.node import WorkerNode

log = logging.getLogger("sluice.worker")

class Client:
    """The parameter-server client of a worker node: its messages are routed to it by the node."""

    def __init__(self, node: WorkerNode) -> None:
        self._node = node
        self.transport, self.control = node.transport, node.control
        self.settings, self._op_timeout = node.settings, node.control_settings.op_timeout
        self._tensors: dict[str, Tensor] = {}
        self._pending = Pending()  # under _lock
        self._lock = threading.Lock()
        jobs = JobsConfig(**node.env.section("jobs"))
        try:  # with job priorities on, every push goes on the channel of the job's level
            self.job_level = JobLevel(jobs, self.settings.channels) if jobs.priorities else None
        except ValueError as exc:
            raise SluiceError(str(exc)) from None
        if self.job_level is not None:
            self.control.job_report = self.job_level.report
        #: ps.replicas: each chunk's pushes of its last mirror_every answered rounds, to replay to a server that
        #: takes over (I/O thread only)
        ps = node.env.section("ps")  # validated by the launcher (ps/config.py)
        replicated = int(ps.get("replicas", 0)) > 0
        self._answered = Answered(mirror_rounds(int(ps.get("mirror_every", 0)))) if replicated else None
        #: which aggregation tree each chunk of each round takes (worker/routing.py), and the pushes of rounds
        #: started while a switch to new trees is being agreed, sent once it is (both under _lock)
        self._router = Router(node.env.name)
        self._held: list[tuple[Tensor, list[tuple[int, Message]]]] = []
        #: the pushes of rounds in flight taken back from the transport while a switch is agreed (under _lock)
        self._held_back = HeldBack(self.transport, node.env.name)
        #: who may answer a push: the servers, and the aggregators of the trees
        self._reply_ids: set[int] = set()
        self._aggregator_endpoints: dict[str, tuple[str, ...]] = {}
        #: told a replaced server's name (I/O thread) before the requests it owes go again (worker/replaced.py)
        self.server_back_hooks: list[Callable[[str], None]] = []
        self._server_names: list[str] = []
        self._server_ids: set[int] = set()
        #: this worker's calibrated limits, proposed to the scheduler with the first declaration
        self.proposal: Limits | None = None
        #: the job's chunk size and in-flight bound, known after the first declaration
        self.limits: Limits | None = None
        self._calibrator: Calibrator | None = None
        node.route((Kind.REPLY, Kind.BCAST_REPLY, Kind.ERROR), self._on_reply)
        node.route((Kind.PROBE_REPLY,), self._on_probe_reply)
        node.control_routes.update({Kind.ROUTES: self._on_routes, Kind.COMMIT: self._on_commit,
                                    Kind.SERVER_BACK: self._on_server_back,
                                    Kind.AGGREGATOR_BACK: self._on_aggregator_back})
        node.add_handler(self)

    @property
    def rank(self) -> int:
        return self._node.rank

    @property
    def size(self) -> int:
        return self._node.size

    def welcomed(self, peers: list[PeerInfo]) -> None:
        """The address book, on the I/O thread as it arrives: the aggregators may answer (ROUTES may come next)."""
        aggregators = [p for p in peers if p.role == "aggregator"]
        self._reply_ids |= {p.node_id for p in aggregators}
        self._aggregator_endpoints.update((p.name, p.endpoints) for p in aggregators)

    def start(self) -> None:
        """Connect to the servers and, unless the chunk size and in-flight bound are set, calibrate."""
        servers = self._node.by_rank("server")
        self._server_names = [p.name for p in servers]
        self._router.servers = len(servers)
        self._server_ids = {p.node_id for p in servers}
        self._reply_ids |= self._server_ids
        for peer in servers:
            self.transport.connect(peer.name, peer.endpoints)
        local = all(on_this_host(p.endpoints, self.settings.host) for p in servers)
        if servers and not (self.settings.chunk_bytes and self.settings.inflight_bytes):
            self._calibrate(local)

    @property
    def servers(self) -> int:
        return len(self._server_names)

    @property
    def server_names(self) -> list[str]:
        return list(self._server_names)

    def rounds(self) -> dict[str, int]:
        """The last round of every declared tensor (join's catch-up: worker/ps_join.py)."""
        return {name: tensor.round for name, tensor in self._tensors.items()}

    def set_rounds(self, rounds: dict[str, int]) -> None:
        for name, round_ in rounds.items():
            self._tensors[name].round = round_

    def _calibrate(self, local: bool) -> None:
        timeout = min(self._op_timeout, 60.0)
        self._calibrator = Calibrator(
            self.transport, self.control.node_id, self._server_names, self.settings.channels - 1, timeout
        )
        try:
            self.proposal, measured = self._calibrator.run(
                self.settings.chunk_bytes, self.settings.inflight_bytes, local=local
            )
        finally:
            self._calibrator = None
        log.info("worker %d calibration: %s -> %s", self.rank, measured, self.proposal.describe())

    # ------------------------------------------------------------------ collective set-up
    def declare(self, tensors: Sequence[TensorDecl], ranks: list[int] | None = None) -> None:
        """Declare tensors on every worker at once (same names, shapes, dtypes; any order), or on every worker
        of a process set's `ranks` (the servers' rounds of those tensors count only them; no aggregators)."""
        if not self._server_names:
            raise SluiceError("this job has no parameter servers (-s 0): tensors cannot be declared for them; "
                              "use the allreduce collectives (worker.collective) instead")
        table = [[name, list(shape), dtype, opt] for name, shape, dtype, opt in tensors]
        plan, limits = self.control.declare(table, self.proposal if self.limits is None else None, ranks)
        if self.limits is None:
            self.limits = limits
            self.transport.set_inflight(limits.inflight_bytes)
        new = parse_plan(plan, self._tensors, self.settings)
        sizes = chunk_sizes(new)
        with self._lock:  # the I/O thread reads both when a switch of the aggregation trees begins
            self._tensors.update(new)
            if ranks is None:  # a process set's tensors go straight to the servers: no aggregation tree
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
            nbytes = tensor.numel * np.dtype(STORAGE[tensor.dtype]).itemsize
            tensor.channel = self.settings.channel_for(tensor.priority, levels, nbytes)

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
        flat = tensor.flat(out, writable=True)
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
            flat = tensor.flat(array, writable=True)
            pulls = [(server, Message(Kind.BCAST_PULL, key=tensor.key, chunk=chunk, round=version))
                     for chunk, _, _, server in tensor.chunks]
            handle = self._start(tensor, Kind.BCAST_REPLY, version, what, flat, pulls)
            for server, msg in pulls:
                self._send(tensor, server, msg)
            return handle
        flat = tensor.flat(array, writable=False)
        pushes = []
        for chunk, offset, length, server in tensor.chunks:
            msg = self._data_message(Kind.BCAST_PUSH, tensor, chunk, version, flat[offset : offset + length])
            msg.flags = Flag.WANT_REPLY
            pushes.append((server, msg))
        handle = self._start(tensor, Kind.BCAST_REPLY, version, what, None, pushes)
        for server, msg in pushes:
            self._send(tensor, server, msg)
        return handle

    # ------------------------------------------------------------------ internals
    def _push(
        self, name: str, data: np.ndarray, out: np.ndarray | None, opt: dict[str, Any] | None, want_reply: bool
    ) -> Handle:
        tensor = self._tensor(name)
        flat = tensor.flat(data, writable=False)
        target = tensor.flat(out, writable=True) if out is not None else None
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
            if (trace := self._node.trace) is not None:
                trace.round_started(name, tensor.key, round_, tensor.priority, tensor.channel, flat.nbytes, handle)
            if self._router.holding:
                self._held.append((tensor, pushes))
                return handle
            routes = self._routes(tensor, pushes)
        self._send_pushes(tensor, pushes, routes, handle)
        return handle

    def _routes(self, tensor: Tensor, pushes: list[tuple[int, Message]]) -> list[tuple[int, int, str] | None]:
        """The tree (epoch, tree, parent) each push takes, None for its server (call with _lock held)."""
        return [self._router.route(tensor.key, msg.chunk, msg.round) for _, msg in pushes]

    def _send_pushes(self, tensor: Tensor, pushes: list[tuple[int, Message]],
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

    def _tensor(self, name: str) -> Tensor:
        self._node.check()
        tensor = self._tensors.get(name)
        if tensor is None:
            raise SluiceError(f"tensor {name!r} was not declared; declare it on every worker first")
        return tensor

    def _start(self, tensor: Tensor, kind: Kind, round_: int, what: str, out: np.ndarray | None,
               requests: list[tuple[int, Message]]) -> Handle:
        with self._lock:
            return self._register(tensor, kind, round_, what, out, requests)

    def _register(self, tensor: Tensor, kind: Kind, round_: int, what: str, out: np.ndarray | None,
                  requests: list[tuple[int, Message]]) -> Handle:
        """A handle for one operation on every chunk, its replies awaited (call with _lock held)."""
        return self._pending.add(tensor, kind, round_, what, out, requests, self._op_timeout)

    def _data_message(self, kind: Kind, tensor: Tensor, chunk: int, round_: int, view: np.ndarray) -> Message:
        return Message(
            kind, sender=self.control.node_id, key=tensor.key, chunk=chunk, round=round_,
            priority=tensor.priority, dtype=tensor.dtype, shape=(view.size,), payload=view,
        )

    def _send(self, tensor: Tensor, server: int, msg: Message) -> None:
        msg.sender, msg.priority = self.control.node_id, tensor.priority
        self.transport.send(self._server_names[server], tensor.channel, msg)

    def _on_probe_reply(self, peer: str, msg: Message) -> None:
        calibrator = self._calibrator
        if calibrator is not None and msg.sender in self._server_ids:
            calibrator.on_reply(msg)
        else:
            self.transport.refuse(peer, f"dropped unexpected {msg.kind.name} from {peer!r:.60}")

    def _on_reply(self, peer: str, msg: Message) -> None:
        """A server's (or an aggregator's) REPLY, BCAST_REPLY or ERROR, on the I/O thread."""
        if msg.sender not in self._reply_ids:
            self.transport.refuse(peer, f"dropped unexpected {msg.kind.name} from {peer!r:.60}")
            return
        if msg.kind == Kind.ERROR:
            self._fail_round(msg)
            return
        with self._lock:
            op = self._pending.take(msg)
        if op is None:
            log.warning("dropped a reply nobody waits for: key %d chunk %d round %d", msg.key, msg.chunk, msg.round)
            return
        if op.out is not None:
            if msg.dtype != op.dtype or msg.shape != op.out.shape:
                op.handle._fail(f"server sent {msg.dtype}{list(msg.shape)} for a {op.dtype}{list(op.out.shape)} chunk")
                return
            np.copyto(op.out, np.frombuffer(msg.payload, STORAGE[op.dtype]))
        if self._answered is not None and op.request is not None and op.request.kind == Kind.PUSH:
            self._answered.keep(op.server, op.request)  # before the caller may change the array
        if (trace := self._node.trace) is not None:
            trace.replied(msg.key, msg.round)
        op.handle._part_done(msg.chunk)

    def _on_routes(self, msg: Message) -> None:
        """The scheduler's switch to new aggregation trees begins (scheduler/hierarchy/switch.py), on the I/O
        thread: pushes of later rounds are held until it is committed."""
        routing = parse_routing(meta_field(msg, "routes", list))
        with self._lock:
            self._router.begin(routing, set(self._aggregator_endpoints))
            started = [[t.key, t.round] for t in self._tensors.values() if t.round > 0]
            held = self._held_back.take(self._router, {(key, round_) for key, round_ in started})
            oldest = self._router.oldest_in_use(self._pending.rounds())
        self.control.send(Kind.ROUTES_ACK, epoch=routing.epoch, rounds=started, held=held, oldest=oldest)

    def _on_commit(self, msg: Message) -> None:
        """The switch is agreed: connect to the new parents and send the pushes held meanwhile."""
        epoch, rounds = meta_field(msg, "epoch", int), parse_rounds(meta_field(msg, "rounds", list))
        moved = parse_moved((msg.meta or {}).get("moved", []))
        with self._lock:
            parents = self._router.commit(epoch, rounds, epoch_field(msg.meta, "keep_from"))
            again, onto = self._held_back.release(self._router, moved, self._server_names.__getitem__)
            for push, parent in onto:  # a reply that never comes names where the push went now
                for handle in self._pending.handles(push):
                    handle.via(push.chunk, parent.replace("-", " ") if parent else None)
            held = [(tensor, pushes, self._routes(tensor, pushes)) for tensor, pushes in self._held]
            self._held = []
        for parent in parents:  # a no-op for aggregators connected in an earlier epoch
            self.transport.connect(parent, self._aggregator_endpoints[parent])
        for peer, channel, push in again:  # the round in flight's, first: the others wait for it
            self.transport.send(peer, channel, push)
        for tensor, pushes, routes in held:
            self._send_pushes(tensor, pushes, routes, None)

    def _on_server_back(self, msg: Message) -> None:
        server_back(self, parse_server_back(msg, self._server_names))

    def _on_aggregator_back(self, msg: Message) -> None:
        aggregator_back(self, parse_back(msg, [node_name("aggregator", r) for r in range(self._node.env.aggregators)]))

    def _fail_round(self, msg: Message) -> None:
        """A server says a round can never complete: fail whatever waits for it, with its words."""
        error = str(msg.meta.get("error", "the server refused the round")) if msg.meta else "refused"
        with self._lock:
            ops = self._pending.pop(Kind.REPLY, msg.key, msg.chunk, msg.round)
        for op in ops:
            op.handle._fail(error)

    def fail(self, error: str) -> None:
        """The job failed: every operation still waiting raises `error`."""
        with self._lock:
            ops = self._pending.drain()
        for op in ops:
            op.handle._fail(error)
