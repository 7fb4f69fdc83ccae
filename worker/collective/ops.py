"""What every collective operation shares: its handle, its peers' progress, and sends gated by the receiver's READY.

Messages between workers (the data plane's wire protocol):

    COLL_DATA  sender = the sending rank (must match the peer's name), round = seq of the op, key =
               step (what a step means is the op's), chunk = chunk index within that step, priority
               = the op's, dtype/shape = the chunk (1-D), meta = nil
    COLL_DONE  sender, round as above, no payload; key = READY ("I have started op seq: send me the
               rest"), DONE ("I have consumed every message of yours for op seq"), or HELLO (set-up,
               round 0, chunk = the channel it came on: DataPlane.connect)

A sender sends at most `eager_bytes` to a peer before that peer's READY, so a rank that starts an op
late keeps (copies) only that much per peer; the receiver sends READY only when it expects more, so
small ops cost no extra message. Every op waits for DONE from each peer it sent data to before it
completes: its memory may have been sent with no copy (shared memory), and the caller may overwrite
it the moment the op completes. Except where an op sends a peer at most COPY_BELOW bytes in all:
then it sends copies, and neither side sends or waits for DONE, which saves small ops a hop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sluice.errors import CollectiveError, SluiceError
from sluice.transport.base import Transport
from sluice.transport.wire import Kind, Message

READY, DONE, HELLO = 0, 1, 2
#: an op that sends a peer at most this many bytes sends copies, and needs no DONE from it (both sides
#: decide alike, from the op's schedule): a memcpy of 64 KiB costs less than a message's hop
COPY_BELOW = 64 << 10


class Completion:
    """Done once, with a result or an error; callbacks run once, on the thread that completes it."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._error: str | None = None
        self._result: Any = None
        self._callbacks: list[Callable[[Any], None]] = []

    def done(self) -> bool:
        return self._event.is_set()

    @property
    def error(self) -> str | None:
        return self._error

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        """Call fn(self) once, when it completes or fails (at once if it already has)."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def finish(self, result: Any = None, error: str | None = None) -> None:
        """Complete (or fail) and run the callbacks on this thread; later calls do nothing."""
        with self._lock:
            if self._event.is_set():
                return
            self._result, self._error = result, error
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)

    def _raise_failure(self) -> None:
        if self._error is not None:
            raise SluiceError(f"{self.what} failed: {self._error}")


class OpHandle(Completion):
    """Completion of one collective as its caller sees it: negotiated, then run; `wait` has a deadline."""

    def __init__(self, what: str, timeout: float) -> None:
        super().__init__(what)
        self._timeout = timeout
        #: when the coordinator's decision launched it (monotonic seconds; the timeline's NEGOTIATE ends here)
        self.started: float | None = None

    def wait(self, timeout: float | None = None) -> None:
        limit = self._timeout if timeout is None else timeout
        if not self._event.wait(limit):
            raise SluiceError(f"{self.what}: not finished after {limit:.0f} s (see collective.stall_timeout "
                              "for operations some ranks never submit)")
        if self.error is not None:
            raise CollectiveError(f"{self.what} failed: {self.error}")

    def result(self) -> Any:
        self.wait()
        return self._result


class CollectiveHandle(Completion):
    """Completion of one collective on this rank; `wait` has a deadline (the op's, by default)."""

    def __init__(self, what: str, deadline: float) -> None:
        super().__init__(what)
        self.deadline = deadline
        #: rows received from each rank (allgather, alltoall), known once the op completes
        self.splits: list[int] | None = None
        #: set by the data plane: what the op still waits for, in words; fail it (past its deadline)
        self.pending: Callable[[], str] = lambda: "nothing"
        self.expire: Callable[[], None] = lambda: None

    def wait(self, timeout: float | None = None) -> None:
        """Return once the op completed; SluiceError if it failed, or is not done after `timeout` s
        (default: until the op's deadline, when it fails for good, naming the ranks it waits for)."""
        limit = self.deadline - time.monotonic() if timeout is None else timeout
        if not self._event.wait(max(limit, 0.0)):
            if time.monotonic() < self.deadline:
                raise SluiceError(f"{self.what}: not done after {max(limit, 0.0):.1f} s; it waits for {self.pending()}")
            self.expire()  # past the op's own deadline: it fails for good, naming whom it waited for
            if not self._event.is_set():
                raise SluiceError(f"{self.what}: timed out; it waits for {self.pending()}")
        self._raise_failure()

    def result(self) -> np.ndarray:
        """The op's output (allgather, alltoall: the concatenation; allreduce, broadcast: the array)."""
        self.wait()
        assert self._result is not None
        result: np.ndarray = self._result
        return result


@dataclass(frozen=True)
class Link:
    """How ops reach their peers: the transport, this rank and the peers' names."""

    transport: Transport
    rank: int
    names: Sequence[str]
    eager_bytes: int
    copy_below: int = COPY_BELOW
    #: the kinds of this plane's data and control messages: a sub-group's plane has its own (GROUP_*)
    data_kind: Kind = Kind.COLL_DATA
    done_kind: Kind = Kind.COLL_DONE

    def send(self, dest: int, channel: int, msg: Message) -> None:
        self.transport.send(self.names[dest], channel, msg)


@dataclass
class _Gate:
    """Sends to one peer: free once it said READY (or when all of them fit in the eager budget)."""

    open: bool
    budget: int
    unsent: int  # messages the op has yet to hand to the transport for this peer (held ones included)
    copy: bool  # send copies (and expect no DONE)
    held: list[Message] = field(default_factory=list)


class Op:
    """One collective on this rank; the data plane calls it under its lock, on any thread."""

    kind = "collective"

    def __init__(self, link: Link, seq: int, dtype: str, priority: int, channel: int, handle: CollectiveHandle) -> None:
        self.link, self.seq, self.dtype, self.priority, self.channel = link, seq, dtype, priority, channel
        self.handle = handle
        self.expect: dict[int, int] = {}  # rank -> data messages still to come from it
        self.confirm: set[int] = set()  # ranks whose data we confirm with DONE once all of it is consumed
        self.awaiting_done: set[int] = set()  # ranks we sent data to that have not said DONE
        self.gates: dict[int, _Gate] = {}
        self.result: np.ndarray | None = None
        #: a protocol-valid message showed the op cannot succeed (e.g. ranks disagree on shapes)
        self.error: str | None = None

    # ---------------------------------------------------------------- what subclasses provide
    def begin(self) -> None:
        """Start: announce READY where needed, send what can be sent now."""
        raise NotImplementedError

    def on_data(self, src: int, msg: Message) -> str | None:
        """Take one COLL_DATA from rank `src`; the reason to refuse it, or None."""
        raise NotImplementedError

    def complete(self) -> bool:
        """Beyond messages: is this rank's own part done (e.g. an exchange knows its layout)?"""
        return True

    def waiting_for(self) -> dict[int, str]:
        """Rank -> what this op still waits for from it (subclasses add their own)."""
        out: dict[int, str] = {}
        for rank, left in self.expect.items():
            if left:
                out[rank] = f"{left} data message{'s' if left > 1 else ''}"
        for rank, gate in self.gates.items():
            if gate.held and rank not in out:
                out[rank] = "READY (it has not started this op)"
        for rank in self.awaiting_done:
            out.setdefault(rank, "DONE (it has not consumed all we sent)")
        return out

    # ---------------------------------------------------------------- shared machinery
    def finished(self) -> bool:
        if self.error is not None or self.awaiting_done or any(self.expect.values()):
            return False
        return not any(gate.unsent for gate in self.gates.values()) and self.complete()

    def describe_waiting(self) -> str:
        waiting = self.waiting_for()
        if not waiting:
            return "nothing"
        ranks = ", ".join(str(r) for r in sorted(waiting))
        return f"ranks {ranks} ({'; '.join(f'rank {r}: {what}' for r, what in sorted(waiting.items()))})"

    def expect_from(self, src: int, messages: int, nbytes: int, eager: int | None = None) -> None:
        """`messages` data messages (`nbytes` in all) will come from `src`: ask for them if they exceed
        what it may send before our READY."""
        self.expect[src] = messages
        if messages and nbytes > self.link.copy_below:
            self.confirm.add(src)
        if messages and nbytes > (self.link.eager_bytes if eager is None else eager):
            self.control(src, READY)

    def open_gate(self, dest: int, messages: int, nbytes: int, eager: int | None = None) -> None:
        """We will send `messages` data messages (> 0, `nbytes` in all) to `dest`, then wait for its DONE."""
        budget = self.link.eager_bytes if eager is None else eager
        copy = nbytes <= self.link.copy_below
        self.gates[dest] = _Gate(open=nbytes <= budget, budget=budget, unsent=messages, copy=copy)
        if not copy:
            self.awaiting_done.add(dest)

    def send(self, dest: int, key: int, chunk: int, view: np.ndarray) -> None:
        gate = self.gates[dest]
        msg = Message(self.link.data_kind, sender=self.link.rank, key=key, chunk=chunk, round=self.seq,
                      priority=self.priority, dtype=self.dtype, shape=(view.size,),
                      payload=view.copy() if gate.copy else view)
        if not gate.open:
            if gate.held or view.nbytes > gate.budget:
                gate.held.append(msg)  # a view of our own array (or a small copy) waits, nothing more
                return
            gate.budget -= view.nbytes
        gate.unsent -= 1
        self.link.send(dest, self.channel, msg)

    def control(self, dest: int, key: int) -> None:
        msg = Message(self.link.done_kind, sender=self.link.rank, key=key, round=self.seq, priority=self.priority)
        self.link.send(dest, self.channel, msg)

    def received(self, src: int) -> None:
        """One more data message of `src` consumed; the last one is confirmed with DONE."""
        left = self.expect[src] - 1
        self.expect[src] = left
        if not left and src in self.confirm:
            self.control(src, DONE)

    def on_control(self, src: int, key: int) -> str | None:
        if key == READY:
            gate = self.gates.get(src)
            if gate is None or gate.open:
                return f"unexpected READY from rank {src}"
            gate.open = True
            held, gate.held = gate.held, []
            gate.unsent -= len(held)
            for msg in held:
                self.link.send(src, self.channel, msg)
            return None
        if key == DONE:
            gate = self.gates.get(src)
            if src not in self.awaiting_done or gate is None or gate.unsent:  # it cannot have consumed it all
                return f"unexpected DONE from rank {src}"
            self.awaiting_done.discard(src)
            return None
        return f"unknown COLL_DONE key {key}"

    def check_chunk(self, msg: Message, length: int) -> str | None:
        if msg.dtype != self.dtype or msg.shape != (length,):
            got = f"{msg.dtype}{list(msg.shape)}"
            return f"chunk {msg.chunk} of step {msg.key} is {got}, expected {self.dtype}[{length}]"
        return None


def as_view(payload: Any, dtype: np.dtype[Any]) -> np.ndarray:
    """A received payload as an array, without a copy (it may be the sender's read-only shared memory)."""
    return np.frombuffer(payload, dtype)


def flatten(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """An allreduce's arrays as one flat array: a view of a single contiguous one, else a copy of them all."""
    if len(arrays) == 1 and arrays[0].flags.c_contiguous:
        return arrays[0].reshape(-1)
    return np.concatenate([a.reshape(-1) for a in arrays])


def scatter(flat: np.ndarray, arrays: Sequence[np.ndarray]) -> None:
    """`flat`'s elements written back into `arrays` in order (an allreduce of several arrays, or of one)."""
    offset = 0
    for array in arrays:
        array.reshape(-1)[...] = flat[offset:offset + array.size]
        offset += array.size


def copy_back(source: np.ndarray, target: np.ndarray) -> None:
    if not np.shares_memory(source, target):
        target.reshape(-1)[...] = source


def settle(handle: OpHandle, data: CollectiveHandle, finish: Callable[[], Any]) -> None:
    """Complete the caller's handle from the data plane's, running `finish` (copy-backs) first."""
    try:
        data.wait(0)
        handle.finish(result=finish())
    except Exception as exc:
        handle.finish(error=str(exc))
