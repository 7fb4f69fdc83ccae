"""The collective data plane: allreduce (ring, tree), allgather, broadcast and alltoall between workers.

Each op is an object (ring.py, tree_reduce.py, gather.py) that the plane feeds, under one lock,
with the op's messages: on the transport's I/O thread as they arrive (the reduction included: a
chunk is added straight from the payload, often the sender's shared memory, and forwarded at once),
and on the caller's thread when it starts. Ops run concurrently and independently, keyed by seq.

Every message is checked before use: the sender's name is a peer's and its header names the same
rank; the seq is that of a running op, or of one not started here yet (a faster peer's), kept
within bounds (`early_ops` seqs, `early_bytes` in all, a sender's eager budget per op); the op then
checks step, chunk, dtype and size against its schedule and refuses duplicates. What fails a check
is refused (`transport.refuse`) and changes nothing; nothing is raised to the I/O thread.

An op completes on a rank only once every peer it sent data to has said DONE (ops.py): the caller
may then overwrite the array at once, even when the peers read it in place from shared memory.
An array that is not registered memory is sent as it is: the transport copies each chunk once into
its per-peer ring as it goes. Copying the whole array into a registered scratch buffer first (and
the result back) was measured slower (bench/results/allreduce.md): it copies every byte twice,
where the transport copies only the (size - 1) / size of it each rank sends in each phase.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from sluice.errors import SluiceError
from sluice.transport.base import Transport
from sluice.transport.dtypes import STORAGE
from sluice.transport.wire import Kind, Message
from sluice.worker.collective.config import CollectiveConfig
from sluice.worker.collective.early import EarlyMessages
from sluice.worker.collective.gather import Exchange
from sluice.worker.collective.ops import COPY_BELOW, HELLO, CollectiveHandle, Link, Op
from sluice.worker.collective.reduce import check_reducible, storage
from sluice.worker.collective.ring import ChainBroadcast, RingAllreduce
from sluice.worker.collective.schedule import heap_tree
from sluice.worker.collective.tree import dials
from sluice.worker.collective.tree_reduce import TreeAllreduce

__all__ = ["CollectiveHandle", "DataPlane"]

Finished = list[tuple[CollectiveHandle, "np.ndarray | None", "str | None"]]


class DataPlane:
    def __init__(self, transport: Transport, rank: int, peers: Sequence[str], ring: Sequence[int], chunk_bytes: int,
                 settings: CollectiveConfig, timeout: float, channel_for: Callable[[int], int], *,
                 eager_bytes: int = 0, early_bytes: int = 64 << 20, early_ops: int = 256,
                 early_window: int = 1 << 16, max_gather_bytes: int = 1 << 34,
                 copy_below: int = COPY_BELOW, kinds: tuple[Kind, Kind] = (Kind.COLL_DATA, Kind.COLL_DONE)) -> None:
        """`eager_bytes` (0: one chunk): what a rank sends a peer for an op before the peer's READY.
        Early messages (for ops not started here yet) are kept for at most `early_ops` seqs, at most
        `early_window` seqs ahead, `early_bytes` in all. An op sends copies to a peer it sends at most
        `copy_below` bytes, and needs no DONE from it (ops.py). An allgather or alltoall output larger
        than `max_gather_bytes` fails the op. `kinds`: the (data, control) message kinds, so that a
        sub-group's plane (GROUP_DATA, GROUP_DONE) runs beside the job's, its ranks its own."""
        size = len(peers)
        if not 0 <= rank < size or sorted(ring) != list(range(size)):
            raise ValueError(f"rank {rank} and ring {list(ring)} do not fit {size} peers")
        if chunk_bytes < 1 or timeout <= 0:
            raise ValueError("chunk_bytes and timeout must be positive")
        self.rank, self.size, self.settings = rank, size, settings
        self.ring = list(ring)
        self._chunk_bytes, self._timeout, self._channel_for = chunk_bytes, timeout, channel_for
        self._link = Link(transport, rank, list(peers), eager_bytes or chunk_bytes, copy_below, *kinds)
        self._ranks = {name: r for r, name in enumerate(peers)}
        self._max_gather_bytes = max_gather_bytes
        self._lock = threading.Lock()
        self._ops: dict[int, Op] = {}
        self._last_seq = -1
        self._early = EarlyMessages(self._link.eager_bytes, early_ops, early_bytes, early_window)
        self._failure: str | None = None
        self._hellos: set[tuple[int, int]] = set()
        self._hello_cond = threading.Condition(self._lock)

    @property
    def early_kept(self) -> int:
        """Messages kept so far because they came before their op started here."""
        return self._early.count

    @property
    def last_seq(self) -> int:
        """The highest seq started on this rank (-1 before the first)."""
        return self._last_seq

    # ------------------------------------------------------------------ connection set-up
    def connect(self, endpoints: Sequence[Sequence[str]], timeout: float = 30.0) -> None:
        """Connect every pair of ranks once, the way collective.tree.dials says (the higher rank dials: a
        transport drops what arrives on its listening side from a peer it dialled itself), say HELLO
        on every channel of the ranks dialled, and wait for the HELLOs of the ranks that dial here: a
        listening side can route a message to a peer only once it has heard from it on that channel.
        Call it on every rank, before any op and not on the I/O thread; SluiceError after `timeout`."""
        transport = self._link.transport
        channels = transport.config.channels
        for other in range(self.size):
            if other != self.rank and dials(self.rank, other):
                transport.connect(self._link.names[other], endpoints[other])
                for channel in range(channels):
                    transport.send(self._link.names[other], channel,
                                   Message(self._link.done_kind, sender=self.rank, key=HELLO, chunk=channel))
        needed = {(other, channel) for other in range(self.size) if other != self.rank and dials(other, self.rank)
                  for channel in range(channels)}
        with self._hello_cond:
            if not self._hello_cond.wait_for(lambda: needed <= self._hellos, timeout):
                missing = sorted({other for other, _ in needed - self._hellos})
                raise SluiceError(f"rank {self.rank}: no HELLO after {timeout:g} s from ranks {missing}, which "
                                  "should have connected here")

    # ------------------------------------------------------------------ operations (any thread)
    def allreduce(self, seq: int, array: np.ndarray, dtype: str, op: str, priority: int, algorithm: str = "ring",
                  parent: int | None = None, children: Sequence[int] = ()) -> CollectiveHandle:
        """Reduce `array` over all ranks by `op` (sum, average, min, max, product), in place. "tree": up
        the given tree (by default a binary tree over the ring order) to its root, then down; "auto": the
        tree below settings.tree_below_bytes. Average on integers takes the floor of the mean."""
        self._check(array, dtype, flat=True)
        check_reducible(dtype, op)
        if algorithm == "auto":
            algorithm = "tree" if array.nbytes < self.settings.tree_below_bytes else "ring"
        handle, channel = self._handle(f"allreduce ({algorithm})", seq, priority)
        if algorithm == "ring":
            return self._start(RingAllreduce(self._link, seq, dtype, priority, channel, handle, array, op,
                                             self.ring, self._chunk_bytes))
        if algorithm != "tree":
            raise ValueError(f"allreduce algorithm must be ring, tree or auto, got {algorithm!r}")
        if parent is None and not children and self.size > 1:
            parents, kids = heap_tree(self.ring)
            parent, children = parents[self.rank], kids[self.rank]
        if any(not 0 <= r < self.size or r == self.rank for r in [*children, *([] if parent is None else [parent])]):
            raise ValueError(f"tree neighbours {parent}, {list(children)} of rank {self.rank} are not other ranks")
        return self._start(TreeAllreduce(self._link, seq, dtype, priority, channel, handle, array, op, parent,
                                         children, self._chunk_bytes))

    def allgather(self, seq: int, array: np.ndarray, dtype: str, priority: int,
                  out: np.ndarray | None = None) -> CollectiveHandle:
        """Every rank's rows (shape (rows, *rest), rows may differ), concatenated in rank order (into `out`, a flat
        contiguous buffer of exactly their size, when given)."""
        self._check(array, dtype, flat=False)
        if out is not None:
            self._check(out, dtype, flat=True)
        handle, channel = self._handle("allgather", seq, priority)
        return self._start(Exchange(self._link, seq, dtype, priority, channel, handle, "allgather",
                                    [array] * self.size, self._chunk_bytes, self._max_gather_bytes, out))

    def broadcast(self, seq: int, array: np.ndarray, root: int, dtype: str, priority: int) -> CollectiveHandle:
        """The root's `array` into every rank's `array`, pipelined along the ring from the root."""
        self._check(array, dtype, flat=True)
        if not 0 <= root < self.size:
            raise ValueError(f"broadcast root {root} is not a rank (0..{self.size - 1})")
        handle, channel = self._handle("broadcast", seq, priority)
        return self._start(ChainBroadcast(self._link, seq, dtype, priority, channel, handle, array, root,
                                          self.ring, self._chunk_bytes))

    def alltoall(self, seq: int, array: np.ndarray, splits: Sequence[int], dtype: str,
                 priority: int) -> CollectiveHandle:
        """Row block i (`splits[i]` rows) to rank i; the result is what each rank sent here, in rank
        order, and `handle.splits` the rows that came from each."""
        self._check(array, dtype, flat=False)
        if len(splits) != self.size or min(splits, default=0) < 0 or sum(splits) != array.shape[0]:
            raise ValueError(f"alltoall splits {list(splits)} must be {self.size} row counts summing to "
                             f"{array.shape[0]}")
        starts = np.cumsum([0, *splits])
        blocks = [array[starts[r] : starts[r + 1]] for r in range(self.size)]
        handle, channel = self._handle("alltoall", seq, priority)
        return self._start(Exchange(self._link, seq, dtype, priority, channel, handle, "alltoall", blocks,
                                    self._chunk_bytes, self._max_gather_bytes))

    def fail(self, error: str) -> None:
        """Fail every pending op with `error`; later ops fail at once with it too."""
        with self._lock:
            self._failure = self._failure or error
            ops, self._ops = list(self._ops.values()), {}
            self._early.clear()
        for op in ops:
            op.handle.finish(None, error)

    # ------------------------------------------------------------------ incoming (I/O thread)
    def on_message(self, peer: str, msg: Message) -> None:
        """One COLL_DATA or COLL_DONE; refused (counted, logged) if it fails a check; never raises."""
        finished: Finished = []
        try:
            problem = self._receive(peer, msg, finished)
        except Exception as exc:  # a bug here must not end the I/O thread: the op it was for fails
            problem = f"handling it failed ({type(exc).__name__}: {exc})"
            self._fail_op(msg.round, problem, finished)
        if problem:
            self._link.transport.refuse(peer, f"rank {self.rank} dropped {msg.kind.name} step {msg.key} chunk "
                                        f"{msg.chunk} of op {msg.round} from {peer!r:.60}: {problem}")
        for handle, result, error in finished:
            handle.finish(result, error)

    def _receive(self, peer: str, msg: Message, finished: Finished) -> str | None:
        src = self._ranks.get(peer)
        if src is None or src == self.rank:
            return "the sender is not a peer of this data plane"
        if msg.sender != src:
            return f"its header says rank {msg.sender}"
        if msg.kind == self._link.done_kind:
            if msg.payload is not None:
                return "COLL_DONE carries no payload"
            if msg.key == HELLO:
                return self._hello(src, msg.chunk)
        elif msg.kind != self._link.data_kind or msg.payload is None:
            return "not a collective data message"
        with self._lock:
            op = self._ops.get(msg.round)
            if op is None:
                if self._failure is not None or msg.round <= self._last_seq:
                    return f"op {msg.round} is not running here (finished, failed, or never to start)"
                return self._early.keep(src, msg, self._last_seq)  # a faster peer's: kept for later
            problem = self._deliver(op, src, msg)
            self._settle(op, finished)
        return problem

    def _hello(self, src: int, channel: int) -> str | None:
        if not dials(src, self.rank) or channel >= self._link.transport.config.channels:
            return f"HELLO from rank {src} on channel {channel}: a rank that does not dial here, or no channel"
        with self._hello_cond:
            self._hellos.add((src, channel))
            self._hello_cond.notify_all()
        return None

    # ------------------------------------------------------------------ internals (under the lock)
    def _deliver(self, op: Op, src: int, msg: Message) -> str | None:
        if msg.kind == self._link.done_kind:
            return op.on_control(src, msg.key)
        return op.on_data(src, msg)

    def _settle(self, op: Op, finished: Finished) -> None:
        """Retire `op` if it failed or is done (its handle is completed by the caller, after the lock)."""
        if op.error is not None or op.finished():
            if self._ops.get(op.seq) is op:
                del self._ops[op.seq]
            finished.append((op.handle, op.result if op.error is None else None, op.error))

    # ------------------------------------------------------------------ starting and ending ops
    def _check(self, array: np.ndarray, dtype: str, flat: bool) -> None:
        if dtype not in STORAGE:
            raise ValueError(f"dtype {dtype!r} is not a wire dtype")
        shaped = array.ndim == 1 if flat else array.ndim >= 1
        if array.dtype != storage(dtype) or not array.flags.c_contiguous or not shaped:
            shape = "1-D" if flat else "at least 1-D"
            raise ValueError(f"expected a contiguous {shape} array of {storage(dtype)} for {dtype}, got "
                             f"{array.dtype}{list(array.shape)}")

    def _handle(self, what: str, seq: int, priority: int) -> tuple[CollectiveHandle, int]:
        if not 0 <= seq < 1 << 62 or priority < 0:
            raise ValueError(f"seq {seq} and priority {priority} must be non-negative (seq below 2**62)")
        handle = CollectiveHandle(f"{what} seq {seq} on rank {self.rank}", time.monotonic() + self._timeout)
        return handle, self._channel_for(priority)

    def _start(self, op: Op) -> CollectiveHandle:
        handle = op.handle
        finished: Finished = []
        handle.pending = lambda: self._waiting(op)
        handle.expire = lambda: self._expire(op)
        with self._lock:
            if self._failure is not None:
                finished.append((handle, None, self._failure))
            else:
                if op.seq <= self._last_seq:
                    raise ValueError(f"seq {op.seq} is not above the last one started here ({self._last_seq})")
                self._last_seq = op.seq
                self._ops[op.seq] = op
                try:
                    op.begin()
                except BaseException:
                    del self._ops[op.seq]
                    raise
                kept, dropped = self._early.take(op.seq)
                for src, stale in dropped:
                    self._refuse(src, f"dropped a message kept for op {stale}, which never started here")
                for src, msg in kept:
                    problem = self._deliver(op, src, msg)
                    if problem:
                        self._refuse(src, f"dropped a message kept for op {op.seq}: {problem}")
                self._settle(op, finished)
                self._expire_overdue(finished)
        for done, result, error in finished:
            done.finish(result, error)
        return handle

    def _refuse(self, src: int, text: str) -> None:
        self._link.transport.refuse(self._link.names[src], f"rank {self.rank} {text}")

    def _waiting(self, op: Op) -> str:
        with self._lock:
            return op.describe_waiting()

    def _expire(self, op: Op) -> None:
        finished: Finished = []
        with self._lock:
            self._fail_locked(op, finished)
        for handle, result, error in finished:
            handle.finish(result, error)

    def _fail_locked(self, op: Op, finished: Finished, error: str | None = None) -> None:
        if self._ops.get(op.seq) is op:
            del self._ops[op.seq]
            text = error or f"no completion after {self._timeout:g} s; it waits for {op.describe_waiting()}"
            finished.append((op.handle, None, text))

    def _expire_overdue(self, finished: Finished) -> None:
        now = time.monotonic()
        for op in [op for op in self._ops.values() if op.handle.deadline <= now]:
            self._fail_locked(op, finished)

    def _fail_op(self, seq: int, error: str, finished: Finished) -> None:
        with self._lock:
            op = self._ops.get(seq)
            if op is not None:
                self._fail_locked(op, finished, error)
