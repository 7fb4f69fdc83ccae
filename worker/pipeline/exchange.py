"""A stage's messages: activations and gradients to and from its neighbours, and its replicas' data plane.

Arrivals are checked on the I/O thread (the sender is the neighbour that direction comes from, the step
is the current one or the next, the micro-batch within the step's count, each slot once) and copied or
decoded into a table that `receive` waits on with a deadline naming the stage and worker it waits for.
What a stage holds is bounded: at most two steps' micro-batches and `max_held_bytes` in all; anything
else is refused (counted by the transport) and changes nothing. The job's failure (the scheduler's
SHUTDOWN, a lost peer) ends every wait at once with its cause.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sluice.errors import SluiceError
from sluice.scheduler import culprit
from sluice.transport import lane as lanes
from sluice.transport.base import Transport
from sluice.transport.wire import Kind, Message, WireError
from sluice.worker.collective.config import CollectiveConfig
from sluice.worker.collective.data import DataPlane
from sluice.worker.pipeline.frames import BACKWARD, FORWARD, Assembly, Compression, Received, build, read
from sluice.worker.pipeline.layout import StagePlace
from sluice.worker.pipeline.links import Links

GROUP_KINDS = frozenset((Kind.GROUP_DATA, Kind.GROUP_DONE))
#: micro-batches a step may have before the schedule says how many (messages of a faster neighbour)
MAX_MICRO = 4096
#: what a tensor being assembled costs besides its bytes, counted against max_held_bytes (so that empty
#: tensors cannot make a stage keep objects without bound)
OVERHEAD_BYTES = 1024
WHAT = {FORWARD: "activations", BACKWARD: "gradients"}


@dataclass
class _Entry:
    """A micro-batch's tensors in one direction: those complete, those still coming in pieces."""

    of: int = 0
    tensors: dict[int, Received] = field(default_factory=dict)
    partial: dict[int, Assembly] = field(default_factory=dict)
    nbytes: int = 0
    #: a tensor arrived whole but did not decode: the receive fails with this at once
    error: str | None = None

    def complete(self) -> bool:
        return bool(self.of) and len(self.tensors) == self.of


@dataclass(frozen=True)
class Neighbours:
    """Names and hosts of the job's workers by rank, as the scheduler's address book gives them."""

    names: Sequence[str]
    hosts: Sequence[str]

    def describe(self, place: StagePlace, rank: int) -> str:
        return f"stage {rank % place.stages} (worker {rank} on {self.hosts[rank]})"


class StageExchange:
    def __init__(self, transport: Transport, place: StagePlace, workers: Neighbours, timeout: float,
                 channel_for: Callable[[int], int], *, compress: str = "auto", chunk_bytes: int = 1 << 20,
                 collective: CollectiveConfig | None = None, max_held_bytes: int = 4 << 30,
                 max_elements: int = 1 << 31, direct: bool = True) -> None:
        """`compress`: "on", "off", or "auto" (on towards a neighbour on another host, where the network is
        slower than encoding; off on this host, where a lane is faster). Tensors travel in pieces
        of at most `chunk_bytes` (the job's chunk: a data socket refuses larger frames). `direct`: to a
        neighbour on this host, over a direct lane (transport/lane.py) instead of the transport."""
        if compress not in ("on", "off", "auto"):
            raise ValueError(f"pipeline compression must be on, off or auto, got {compress!r}")
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self.transport, self.place, self.workers, self.timeout = transport, place, workers, timeout
        self._channel_for, self._piece = channel_for, chunk_bytes
        self._max_held, self._max_elements = max_held_bytes, max_elements
        here = workers.hosts[place.rank]
        self.compression = {
            kind: Compression(compress == "on" or (compress == "auto" and rank is not None
                                                   and workers.hosts[rank] != here))
            for kind, rank in ((FORWARD, place.next), (BACKWARD, place.previous))
        }
        self._sources = {FORWARD: place.previous, BACKWARD: place.next}
        self._cond = threading.Condition()
        self._entries: dict[tuple[Kind, int, int], _Entry] = {}
        self._taken: set[tuple[Kind, int, int]] = set()
        self._held = 0
        self._step, self._micro = 0, MAX_MICRO
        self._failure: str | None = None
        #: messages refused, and the last reason, per sending peer: a wait that times out says so
        self._refused: dict[str, tuple[int, str]] = {}
        local = {rank: workers.names[rank] for rank in (place.previous, place.next)
                 if rank is not None and workers.hosts[rank] == here}
        #: direct lanes to the neighbours on this host, or None
        self.links = Links(transport, place.rank, local, place.next if place.next in local else None,
                           channel_for(0)) if direct and lanes.AVAILABLE and local else None
        #: the replicas of this stage average its gradients over their own data plane
        self.group: DataPlane | None = None
        if place.replicas > 1:
            group = place.group
            self.group = DataPlane(transport, place.replica, [workers.names[r] for r in group], list(range(len(group))),
                                   chunk_bytes, collective or CollectiveConfig(), timeout, channel_for,
                                   kinds=(Kind.GROUP_DATA, Kind.GROUP_DONE))

    # ------------------------------------------------------------------ the stage's thread
    def begin(self, step: int, micro_batches: int) -> None:
        """Step `step` (counted from 0, one more each time) with `micro_batches` micro-batches starts:
        what is left of older steps is dropped."""
        with self._cond:
            self._step, self._micro = step, micro_batches
            for key in [k for k in self._entries if k[1] < step]:
                self._held -= self._entries.pop(key).nbytes
            self._taken = {k for k in self._taken if k[1] >= step}

    def send(self, kind: Kind, step: int, micro: int, tensors: Sequence[tuple[np.ndarray[Any, Any], str]],
             priority: int) -> None:
        """The micro-batch's tensors (wire storage, dtype name) to the next stage (FORWARD) or the
        previous one (BACKWARD); queued, never blocks. The arrays must not change afterwards."""
        dest = self.place.next if kind == FORWARD else self.place.previous
        if dest is None:
            raise SluiceError(f"stage {self.place.stage} has no stage to send {WHAT[kind]} to")
        compression, name = self.compression[kind], self.workers.names[dest]
        channel = self._channel_for(priority)
        links = self.links if self.links is not None and dest in self.links else None
        piece = min(self._piece, lanes.piece_bytes()) if links is not None else self._piece
        for slot, (array, dtype) in enumerate(tensors):
            tried = compression.wanted(slot)
            messages = build(kind, self.place.rank, step, micro, slot, len(tensors), array, dtype, priority, tried,
                             piece)
            compression.count(slot, array.nbytes, messages, tried)
            for msg in messages:
                if links is not None:
                    links.send(dest, channel, msg)
                else:
                    self.transport.send(name, channel, msg)

    def receive(self, kind: Kind, step: int, micro: int) -> list[Received]:
        """The tensors of micro-batch `micro` of `step` coming in direction `kind`, in slot order; waits
        at most the deadline, then SluiceError naming the stage and worker that did not send them."""
        source = self._sources[kind]
        if source is None:
            raise SluiceError(f"stage {self.place.stage} receives no {WHAT[kind]}")
        key = (kind, step, micro)
        deadline = time.monotonic() + self.timeout
        links = self.links
        link = links.links.get(source) if links is not None else None
        while True:
            if links is not None:  # the lanes' messages come in here, on this thread
                links.pump(self._take_direct, self._refuse_direct)
            with self._cond:
                entry = self._entries.get(key)
                if entry is not None and entry.complete():
                    del self._entries[key]
                    self._taken.add(key)
                    self._held -= entry.nbytes
                    return [entry.tensors[slot] for slot in range(entry.of)]
                waiting = self._waiting(kind, step, micro, source)
                if entry is not None and entry.error is not None:
                    raise SluiceError(f"{waiting}: a tensor of it is malformed: {entry.error}")
                if self._failure is not None:
                    raise SluiceError(f"{waiting}: the job failed: {self._failure}")
                if link is not None and link.lane is not None and link.lane.closed:
                    error = f"{waiting}: {link.state()} before sending it"
                    # named for the launcher: this worker's own failure follows from it, and may end first
                    culprit.report("worker", source, error)
                    raise SluiceError(error)
                left = deadline - time.monotonic()
                if left <= 0:
                    count, reason = self._refused.get(self.workers.names[source], (0, ""))
                    refused = f"; {count} of its messages were refused, the last as: {reason}" if count else ""
                    lane = f", {link.state()}" if link is not None else ""
                    raise SluiceError(
                        f"{waiting}: not complete after {self.timeout:g} s "
                        f"({f'{len(entry.tensors)} of {entry.of} tensors came whole' if entry else 'nothing came'}"
                        f"{refused}{lane}); {self.workers.describe(self.place, source)} is slow, stuck or gone. If "
                        "its step is this slow, raise scheduler.op_timeout")
                if links is None:
                    self._cond.wait(min(left, 1.0))
                    continue
            links.wait(min(left, 1.0))

    def fail(self, error: str) -> None:
        """The job failed: every wait ends, now and later, with `error`."""
        with self._cond:
            self._failure = self._failure or error
            self._changed()
        if self.group is not None:
            self.group.fail(error)

    def close(self, seconds: float) -> None:
        """Send what still waits for a direct lane (at most `seconds`), then close the lanes."""
        if self.links is not None:
            self.links.close(seconds)

    def _changed(self) -> None:
        """Under the lock: what `receive` waits for may have changed; wake it."""
        self._cond.notify_all()
        if self.links is not None:
            self.links.wake()

    def _take_direct(self, peer: str, msg: Message) -> None:
        """A message from a direct lane, on the stage's thread: taken, or refused (counted, logged)."""
        try:
            problem = self._take(peer, msg, adopt=True)
        except Exception as exc:  # a bug here must not end the stage with a confusing error
            problem = f"handling it failed ({type(exc).__name__}: {exc})"
        if problem:
            self._refuse_direct(peer, f"stage {self.place.stage} dropped {msg.kind.name} of step {msg.round} "
                                      f"micro-batch {msg.chunk} slot {msg.key} from {peer!r:.60}: {problem}")

    def _refuse_direct(self, peer: str, text: str) -> None:
        self._count_refused(peer, text)
        if self.links is not None:
            self.links.rejects.refuse(peer, text, time.monotonic())

    def _count_refused(self, peer: str, reason: str) -> None:
        """One more message from `peer` refused, for the wait that times out on it to say so."""
        with self._cond:
            self._refused[peer] = (self._refused.get(peer, (0, ""))[0] + 1, reason)

    def _waiting(self, kind: Kind, step: int, micro: int, source: int) -> str:
        return (f"{self.workers.describe(self.place, self.place.rank)} waited for the {WHAT[kind]} of micro-batch "
                f"{micro} of step {step} from {self.workers.describe(self.place, source)}")

    # ------------------------------------------------------------------ the I/O thread
    def on_message(self, peer: str, msg: Message) -> None:
        """One pipeline message from worker `peer`; refused (counted, logged) if it fails a check; never raises."""
        try:
            if msg.kind in GROUP_KINDS:
                if self.group is None:
                    problem: str | None = "this stage has no replicas"
                else:
                    self.group.on_message(peer, msg)
                    return
            elif msg.kind == Kind.STAGE_LANE:
                known = 0 <= msg.sender < len(self.workers.names) and self.workers.names[msg.sender] == peer
                if not known or self.links is None:
                    problem = "its sender is not the worker it names" if not known else "this stage takes no lane"
                else:
                    problem = self.links.offered(msg.sender, msg.meta)
            else:
                problem = self._take(peer, msg)
        except Exception as exc:  # a bug here must not end the I/O thread
            problem = f"handling it failed ({type(exc).__name__}: {exc})"
        if problem:
            self._count_refused(peer, problem)
            self.transport.refuse(peer, f"stage {self.place.stage} dropped {msg.kind.name} of step {msg.round} "
                                        f"micro-batch {msg.chunk} slot {msg.key} from {peer!r:.60}: {problem}")

    def _take(self, peer: str, msg: Message, adopt: bool = False) -> str | None:
        """`adopt`: the payload is the message's own (a lane's), so a tensor in one piece keeps it."""
        source = self._sources.get(msg.kind)
        if source is None or peer != self.workers.names[source] or msg.sender != source:
            return f"{WHAT.get(msg.kind, msg.kind.name)} for this stage come only from worker {source}"
        try:
            piece = read(msg, self._max_elements)
        except WireError as exc:
            return str(exc)
        key = (msg.kind, msg.round, msg.chunk)
        with self._cond:
            problem = self._out_of_place(key, msg)
            if problem:
                return problem
            entry = self._entries.setdefault(key, _Entry(of=piece.of))
            if piece.of != entry.of:
                return f"it says the micro-batch has {piece.of} tensors, an earlier one said {entry.of}"
            if piece.slot in entry.tensors:
                return "it came twice"
            assembly = entry.partial.get(piece.slot)
            if assembly is None:
                cost = piece.size + OVERHEAD_BYTES
                if self._held + cost > self._max_held:
                    return f"this stage already holds {self._held} bytes (limit {self._max_held})"
                assembly = entry.partial[piece.slot] = Assembly(piece, adopt)
                entry.nbytes += cost
                self._held += cost
            else:
                problem = assembly.add(piece)
                if problem:
                    return problem
            if not assembly.complete():
                return None
            del entry.partial[piece.slot]
            try:
                entry.tensors[piece.slot] = assembly.tensor()
            except WireError as exc:
                entry.error = f"tensor {piece.slot}: {exc}"
                self._changed()
                return str(exc)
            grown = entry.tensors[piece.slot].array.nbytes - piece.size  # a ZVC frame decodes larger
            entry.nbytes += grown
            self._held += grown
            if entry.complete():
                self._changed()
        return None

    def _out_of_place(self, key: tuple[Kind, int, int], msg: Message) -> str | None:
        if not self._step <= msg.round <= self._step + 1:
            return f"step {msg.round} is neither this stage's step {self._step} nor the next"
        if (msg.round == self._step and msg.chunk >= self._micro) or msg.chunk >= MAX_MICRO:
            return f"micro-batch {msg.chunk} is beyond the step's {self._micro}"
        if key in self._taken:
            return "it came twice"
        return None
