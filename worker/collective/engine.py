"""One worker's collective engine: requests ordered by the coordinator tree, run by the data plane.

A caller (the Horovod-style API, or DistributedOptimizer for fusion groups) enqueues an operation
under a name. The request goes to the coordinator, which decides operations in the same order on
every rank; each decision gets the next sequence number (the same on every rank, since the order
is) and starts its data movement at once, so decided operations run concurrently. A rank that has
called `join` takes part in every operation the others decide, contributing zeros. A decision that
carries an error (the op's ranks disagreed) fails that op's handle on every rank that submitted it, moves
no data and takes no sequence number; the engine goes on.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from sluice.errors import CollectiveError, InvalidCallError, SluiceError
from sluice.scheduler.leaving import left
from sluice.transport.base import Transport
from sluice.transport.dtypes import STORAGE
from sluice.transport.wire import Kind, Message
from sluice.worker.collective.carry import carried_bytes
from sluice.worker.collective.config import CollectiveConfig
from sluice.worker.collective.coordinator import Coordinator
from sluice.worker.collective.data import DataPlane
from sluice.worker.collective.greedy import GreedyFusion
from sluice.worker.collective.mailbox import Mailbox
from sluice.worker.collective.negotiation import Decision, Request
from sluice.worker.collective.negotiation_request import MAX_REASON, data_op, ranks_text, scaled_op
from sluice.worker.collective.ops import OpHandle, copy_back, flatten, scatter, settle
from sluice.worker.collective.reduce import identity
from sluice.worker.collective.tree import build_tree, ring_order

#: coordinator messages kept until this rank's coordinator starts (neighbours send a few each at start)
EARLY_COORDINATION = 4096
#: how long after a worker left the operations still undecided fail (their decisions may be on their way)
LEFT_GRACE_S = 5.0
#: kinds that fail while a rank has joined (as Horovod's): a joined rank has no rows or root to give
_NOT_WITH_JOIN = ("allgather", "alltoall", "broadcast")
COLLECTIVE_KINDS = frozenset((Kind.COORD_UP, Kind.COORD_DOWN, Kind.COLL_DATA, Kind.COLL_DONE))


@dataclass
class _Entry:
    request: Request
    arrays: list[np.ndarray]  # the caller's arrays: results land in them (allreduce, broadcast)
    handle: OpHandle
    splits: tuple[int, ...] = ()
    #: an allgather's output buffer, the caller's (None: a new array)
    out: np.ndarray | None = None


class CollectiveEngine:
    """Coordinator plus data plane for one rank; every method but `on_message` may be called from any thread."""

    def __init__(self, transport: Transport, rank: int, peers: Sequence[str], hosts: Sequence[str],
                 settings: CollectiveConfig, chunk_bytes: int, timeout: float,
                 channel_for: Callable[[int], int], *, members: Sequence[int] | None = None, label: str = "",
                 set_id: int = 0) -> None:
        """Ready to take messages at once (made on the I/O thread as the address book arrives);
        `connect` must follow before any operation. A process set's engine has the set's `members` (their
        job ranks: broadcast roots are job ranks, as in Horovod) and a `label` its errors carry."""
        self.rank, self.size, self.settings = rank, len(peers), settings
        self.members = list(members) if members is not None else list(range(len(peers)))
        self.label, self.set_id = label, set_id
        self._timeout = timeout
        self.tree = build_tree(hosts, settings.arity)
        self._hosts = list(hosts)
        self.ring = ring_order(hosts)
        self._lock = threading.Lock()
        self._waiting: dict[str, _Entry] = {}
        self._seq = 0  # data operations started: the same sequence on every rank
        #: Horovod's greedy fusion (collective.fusion = "greedy", the benchmark's baseline), else None
        self.greedy = GreedyFusion(settings.fusion_bytes, self._launch_fused) if settings.fusion == "greedy" else None
        self._joined = False
        self._failure: str | None = None
        #: why every later call fails: a worker ended its process while this one runs on (worker_left)
        self._departed: str | None = None
        self._departed_rank = -1
        #: called (rank, error) the first time an operation fails because a worker left (the launcher's culprit)
        self.on_first_orphan: Callable[[int, str], None] | None = None
        self.data = DataPlane(transport, rank, peers, self.ring, chunk_bytes, settings, timeout, channel_for)
        self._transport, self._peers = transport, list(peers)
        #: made once this rank has dialled its neighbours (`connect`); what they send before is kept here
        self.coordinator: Coordinator | None = None
        self._coordination = Mailbox(EARLY_COORDINATION, transport.refuse)

    # ------------------------------------------------------------------ requests (any thread)
    def allreduce(self, name: str, arrays: Sequence[np.ndarray], dtype: str, op: str, priority: int = 0,
                  scale: tuple[float, float] | None = None,
                  layout: tuple[tuple[int, ...], ...] | None = None) -> OpHandle:
        """Reduce each array over all ranks by `op` (reduce.OPS), in place; several arrays
        make one grouped request, decided when every one of them is ready everywhere. With `scale`
        (Horovod's prescale and postscale factors) the caller scales, and divides an average: here it
        is a sum, and the ranks must agree on the factors. `layout`: the shapes a fused buffer holds
        (as many elements in all), which the ranks must agree on instead of the buffer's length."""
        shapes = tuple(tuple(a.shape) for a in arrays) if layout is None else layout
        if layout is not None and (held := sum(math.prod(s) for s in layout)) != sum(a.size for a in arrays):
            raise InvalidCallError(f"allreduce {name!r}: a layout of {held} elements for {sum(a.size for a in arrays)}")
        described = op if scale is None else scaled_op(op, *scale)
        return self._enqueue(Request(name, "allreduce", dtype, shapes, described, -1, priority), list(arrays))

    def allgather(self, name: str, array: np.ndarray, dtype: str, priority: int = 0,
                  out: np.ndarray | None = None) -> OpHandle:
        """Rows of every rank's array, concatenated in rank order (the first dimension may differ); into `out`, a
        flat contiguous buffer of exactly their size (registered: no new array, no copy), when given."""
        if out is not None and (out.ndim != 1 or not out.flags.c_contiguous or out.dtype != STORAGE[dtype]):
            raise InvalidCallError(f"allgather {name!r}: its output must be flat, contiguous {STORAGE[dtype]}")
        return self._enqueue(Request(name, "allgather", dtype, (tuple(array.shape),), "sum", -1, priority), [array],
                             out=out)

    def broadcast(self, name: str, array: np.ndarray, root: int, dtype: str, priority: int = 0) -> OpHandle:
        """`root`: the job rank whose array every member gets."""
        if root not in self.members:
            if self.label:
                raise CollectiveError(f"broadcast received invalid root rank {root} for provided process set"
                                      f"{self.label}")
            self._check_rank(root, "broadcast root")
        local = self.members.index(root)
        return self._enqueue(Request(name, "broadcast", dtype, (tuple(array.shape),), "sum", local, priority), [array])

    def alltoall(self, name: str, array: np.ndarray, splits: Sequence[int], dtype: str, priority: int = 0) -> OpHandle:
        """Row block i of `array` (rows per block in `splits`) goes to rank i; the result is what each
        rank sent here, in rank order, and `handle.splits` how many rows came from each. Rows past the
        splits' sum are not sent (as in Horovod)."""
        rows = array.shape[0] if array.ndim else 0
        if len(splits) != self.size:
            raise InvalidCallError(f"alltoall {name!r}: Number of entries in splits does not equal number of "
                                   f"workers ({len(splits)} for {self.size})")
        if min(splits) < 0:
            raise InvalidCallError(f"alltoall {name!r}: splits must not be negative, got {list(splits)}")
        if sum(splits) > rows:
            raise InvalidCallError(f"alltoall {name!r}: Sum of splits entries is greater than the first dimension "
                                   f"of tensor ({sum(splits)} > {rows})")
        request = Request(name, "alltoall", dtype, (tuple(array.shape),), "sum", -1, priority)
        return self._enqueue(request, [array[:sum(splits)] if array.ndim else array], tuple(splits))

    def barrier(self, name: str) -> OpHandle:
        return self._enqueue(Request(name, "barrier"), [])

    def join(self) -> OpHandle:
        """From now on this rank takes part in every operation the others decide, with zeros; the
        handle completes when every rank has joined, with the rank that joined last as its result."""
        with self._lock:
            self._joined = True
        return self._enqueue(Request("join", "join"), [])

    def connect(self, endpoints: Sequence[Sequence[str]]) -> None:
        """Connect to every other rank (each pair once; alltoall and allgather reach every rank) and wait
        until every lower rank has connected here; not on the I/O thread."""
        self.data.connect(endpoints, self._timeout)
        here = self._hosts[self.rank]
        local = [r for r, host in enumerate(self._hosts) if host == here] if self.settings.lanes else []
        self.coordinator = Coordinator(self._transport, self.rank, self.tree, self._peers, self.settings,
                                       self._on_decided, self.fail, on_cycle_end=self.flush, local=local)
        self._coordination.attach(self.coordinator.on_message)

    def close(self) -> None:
        if self.coordinator is not None:
            self.coordinator.close()

    # ------------------------------------------------------------------ incoming (I/O thread)
    def on_message(self, peer: str, msg: Message) -> None:
        if msg.kind in (Kind.COORD_UP, Kind.COORD_DOWN):
            self._coordination.deliver(peer, msg)  # kept until the coordinator starts (`connect`)
        else:
            self.data.on_message(peer, msg)

    # ------------------------------------------------------------------ internals
    def _check_rank(self, rank: int, what: str) -> None:
        if not 0 <= rank < self.size:
            raise InvalidCallError(f"{what} {rank} is not a rank of this job (0..{self.size - 1})")

    def _enqueue(self, request: Request, arrays: list[np.ndarray], splits: tuple[int, ...] = (),
                 out: np.ndarray | None = None) -> OpHandle:
        for array in arrays:
            if request.dtype and array.dtype != STORAGE[request.dtype]:
                raise SluiceError(f"{request.kind} {request.name!r}: array of {array.dtype} "
                                  f"for a {request.dtype} tensor")
        handle = OpHandle(f"{request.kind} {request.name!r}{self.label}", self._timeout)
        with self._lock:
            if self._failure is not None:
                raise SluiceError(self._failure)
            departed = self._departed
            if departed is None:
                if request.name in self._waiting:
                    raise InvalidCallError(
                        f"Requested to {request.kind} a tensor with the same name as another tensor that is "
                        f"currently being processed ({request.name!r}, on rank {self.rank}); use another name")
                self._waiting[request.name] = _Entry(request, arrays, handle, splits, out)
        if departed is not None:
            self._report_orphan(f"{handle.what} waited for it: {departed}")
            raise CollectiveError(f"{handle.what} cannot run: {departed}")
        if self.coordinator is None:
            raise SluiceError("the collective engine is not connected yet (Client.__init__ connects it)")
        # a small allreduce's data goes up with its request (carry.py); not in Horovod's way
        carried = flatten(arrays) if self.greedy is None and carried_bytes(request, self.settings.carry_bytes) else None
        try:
            self.coordinator.submit(request, carried)
        except ValueError as exc:
            with self._lock:
                self._waiting.pop(request.name, None)
            raise InvalidCallError(str(exc)) from None
        return handle

    def refuse(self, name: str, reason: str) -> None:
        """This rank cannot run its call `name` (its arguments are invalid here): the same call fails on
        every other rank too, so that every rank raises at that call and the ranks stay in step. Returns
        once the call is decided (a cycle of the coordinator tree), so the name is free again; does
        nothing where the call reached the coordinator or the job failed."""
        with self._lock:
            if self._failure is not None or name in self._waiting or self.coordinator is None:
                return
        with contextlib.suppress(SluiceError):  # the job failed, or a worker left: nobody is left to tell
            self._enqueue(Request(name, "refused", op=reason[:MAX_REASON] or "refused"), []).wait()

    def _on_decided(self, decision: Decision) -> None:
        """On the coordinator's thread, for every decision in order."""
        with self._lock:
            entry = self._waiting.pop(decision.request.name, None)
        if decision.error is not None or decision.request.kind == "refused":
            # its ranks disagree, or every one refused it: it fails here and everywhere; the job goes on
            if entry is not None:
                entry.handle.finish(error=decision.error or f"every rank refused it: {decision.request.op}")
            return
        if decision.joined and decision.request.kind in _NOT_WITH_JOIN:  # Horovod's rule: it fails everywhere
            if entry is not None:
                entry.handle.finish(error=f"{decision.request.kind.capitalize()} is not supported with Join at this "
                                          f"time ({ranks_text(sorted(decision.joined))} joined)")
            return
        if entry is None:  # we joined, or someone else's join: take part with zeros
            entry = self._stand_in(decision)
            if entry is None:
                return
        if decision.result is not None:  # every rank's data came up with the requests: no data plane, no seq
            entry.handle.started = time.monotonic()
            scatter(decision.result, entry.arrays)
            entry.handle.finish()
            return
        if self.greedy is not None:
            if self.greedy.offer(entry, decision):
                return
            self.greedy.flush()  # what was decided before goes first: the same seqs on every rank
        self._launch(entry, decision)

    def flush(self) -> None:
        """The coordinator's decisions of this cycle are all in: a greedy fusion batch leaves now."""
        if self.greedy is not None:
            self.greedy.flush()

    def _launch(self, entry: _Entry, decision: Decision) -> None:
        seq = self._seq
        if entry.request.kind not in ("barrier", "join"):
            self._seq += 1
        entry.handle.started = time.monotonic()
        try:
            self._start(seq, entry, decision)
        except Exception as exc:  # a bad array or a data plane refusal fails this op, not the engine
            entry.handle.finish(error=f"{type(exc).__name__}: {exc}")

    def _launch_fused(self, batch: list[tuple[_Entry, Decision]]) -> None:
        """One allreduce for a greedy batch: copied into one buffer and back (Horovod's memcpy)."""
        if len(batch) == 1:
            self._launch(*batch[0])
            return
        entries = [entry for entry, _ in batch]
        for entry in entries:
            entry.handle.started = time.monotonic()
        first = entries[0].request
        request = Request(f"fused[{first.name}..{entries[-1].request.name}]", "allreduce", first.dtype,
                          tuple(s for e in entries for s in e.request.shapes), first.op, -1,
                          min(e.request.priority for e in entries))
        fused = _Entry(request, [e.arrays[0] for e in entries], OpHandle(f"fused allreduce of {len(entries)}",
                                                                          self._timeout))
        def settle(done: OpHandle) -> None:
            for entry in entries:
                entry.handle.finish(error=done.error)

        fused.handle.add_done_callback(settle)
        self._launch(fused, batch[0][1])

    def _stand_in(self, decision: Decision) -> _Entry | None:
        """The part a joined rank plays in an operation it did not submit: the op's identity in (zeros for
        a sum; the dtype's largest value for min, ...), result dropped."""
        request = decision.request
        if request.kind == "join":
            return None
        if self.rank not in decision.joined:
            self.fail(f"rank {self.rank} got a decision for {request.name!r}, which it never submitted")
            return None
        storage = STORAGE.get(request.dtype, np.uint8)
        if request.kind == "allgather" or request.kind == "alltoall":
            arrays = [np.zeros((0, *request.shapes[0][1:]), storage)]
        else:
            fill = identity(request.dtype, data_op(request.op)) if request.kind == "allreduce" else 0
            arrays = [np.full(shape, fill, storage) for shape in request.shapes]
        splits = (0,) * self.size if request.kind == "alltoall" else ()
        return _Entry(request, arrays, OpHandle(f"{request.kind} {request.name!r} (joined)", self._timeout), splits)

    def _start(self, seq: int, entry: _Entry, decision: Decision) -> None:
        request, handle = entry.request, entry.handle
        kind = request.kind
        if kind == "barrier":
            handle.finish()
            return
        if kind == "join":  # the decision, not our request, names the rank that joined last
            handle.finish(result=decision.request.root)
            return
        if kind == "allreduce":
            self._allreduce(seq, entry)
            return
        array = np.ascontiguousarray(entry.arrays[0])
        if kind == "allgather":
            data = self.data.allgather(seq, array, request.dtype, request.priority, entry.out)
            data.add_done_callback(lambda h: settle(handle, h, lambda: h.result()))
        elif kind == "broadcast":
            target = entry.arrays[0]
            flat = array.reshape(-1)
            data = self.data.broadcast(seq, flat, request.root, request.dtype, request.priority)
            data.add_done_callback(lambda h: settle(handle, h, lambda: copy_back(flat, target)))
        elif kind == "alltoall":
            data = self.data.alltoall(seq, array, entry.splits, request.dtype, request.priority)
            data.add_done_callback(lambda h: settle(handle, h, lambda: (h.result(), getattr(h, "splits", None))))
        else:
            handle.finish(error=f"unknown collective kind {kind!r}")

    def _allreduce(self, seq: int, entry: _Entry) -> None:
        request, handle = entry.request, entry.handle
        arrays = entry.arrays
        flat = flatten(arrays)
        single = np.may_share_memory(flat, arrays[0])  # a view of the caller's one array: nothing to write back
        algorithm = self.settings.algorithm
        if algorithm == "auto":
            algorithm = "tree" if flat.nbytes < self.settings.tree_below_bytes else "ring"
        parent, children = self.tree.parent[self.rank], self.tree.children[self.rank]
        data = self.data.allreduce(seq, flat, request.dtype, data_op(request.op), request.priority, algorithm, parent,
                                   children)
        data.add_done_callback(lambda h: settle(handle, h, lambda: None if single else scatter(flat, arrays)))

    def worker_left(self, rank: int, who: str, error: str = "") -> None:
        """Worker `rank` (`who`) ended its process (`error`: the exception that ended it, when it said one): later
        calls fail at once, naming it, and so do the
        operations still undecided LEFT_GRACE_S later (the scheduler's word can overtake the decisions
        of those it took part in); decided ones finish (their data has a deadline)."""
        if rank == self.rank or not 0 <= rank < self.size:
            return
        with self._lock:
            if self._departed is not None:
                return
            self._departed_rank = rank
            self._departed = (
                f"{left(who, error)} after {self._seq} collectives here" if error else
                f"{who} has left the job (its process ended) after {self._seq} collectives here; a worker with fewer "
                "batches than the others must call hvd.join() before it ends (join returns once every rank has "
                "joined)")
        timer = threading.Timer(LEFT_GRACE_S, self._fail_undecided)
        timer.daemon = True
        timer.start()

    def _fail_undecided(self) -> None:
        with self._lock:
            waiting, self._waiting = list(self._waiting.values()), {}
            reason = self._departed
        assert reason is not None
        if waiting:
            self._report_orphan(f"{waiting[0].handle.what} waited for it: {reason}")
        for entry in waiting:
            entry.handle.finish(error=f"it waited for {reason}")

    def _report_orphan(self, error: str) -> None:
        """The first operation that fails because a worker left names that worker, once."""
        with self._lock:
            report, self.on_first_orphan = self.on_first_orphan, None
        if report is not None:
            report(self._departed_rank, error)

    def fail(self, error: str) -> None:
        """End every operation with `error` (a coordinator failure, or the job failing); later ones raise it."""
        with self._lock:
            if self._failure is not None:
                return
            self._failure = error
            waiting, self._waiting = self._waiting, {}
        self.data.fail(error)
        for entry in waiting.values():
            entry.handle.finish(error=error)

