"""A worker's timeline: each tensor's round (queued, pushed, at the server, pulled) and collective, on its own track.

Parameter-server rounds: QUEUE from push() to its first chunk leaving, PUSH until its last chunk
left, SERVER until the first reply chunk arrived (the sum, and the way back), PULL until the last.
Collectives: NEGOTIATE from the request to the coordinator's decision, then ALLREDUCE (or the op's
kind) until it completed. The framework adds READY (a gradient is ready) and APPLY (its update ran).
Every slice carries the step (round), priority and channel. The hooks run on the I/O threads: each
is a dict lookup and, at completion, a few formatted strings (transport/timeline.py).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from sluice.transport.timeline import Timeline, now_us
from sluice.transport.wire import Kind, Message

#: rounds followed at once; beyond it new ones go untraced (a job never has this many in flight)
MAX_ROUNDS = 1 << 16


class WorkerTrace:
    def __init__(self, timeline: Timeline) -> None:
        self.timeline = timeline
        self._offset_us = now_us() - time.monotonic() * 1e6  # monotonic (the transport's clock) to wall clock
        self._lock = threading.Lock()
        #: (key, round) -> [name, priority, channel, bytes, queued, first sent, last sent, first reply]
        self._rounds: dict[tuple[int, int], list[Any]] = {}

    @classmethod
    def open(cls, path: str, rank: int) -> WorkerTrace:
        return cls(Timeline(path, f"worker {rank}", os.getpid()))

    def _us(self, mono: float) -> float:
        return mono * 1e6 + self._offset_us

    # ---------------------------------------------------------------- parameter-server rounds
    def round_started(self, name: str, key: int, round_: int, priority: int, channel: int, nbytes: int,
                      handle: Any) -> None:
        """push() of `name` for `round_` (before its chunks are queued)."""
        with self._lock:
            if len(self._rounds) >= MAX_ROUNDS:
                return
            self._rounds[(key, round_)] = [name, priority, channel, nbytes, time.monotonic(), None, None, None]
        handle.add_done_callback(lambda _: self._round_done(key, round_))

    def sent(self, msg: Message, enqueued: float, sent: float) -> None:
        """The transport handed a message to its socket (transport.tracer)."""
        if msg.kind != Kind.PUSH:
            return
        entry = self._rounds.get((msg.key, msg.round))
        if entry is not None:
            if entry[5] is None:
                entry[5] = sent
            entry[6] = sent

    def replied(self, key: int, round_: int) -> None:
        entry = self._rounds.get((key, round_))
        if entry is not None and entry[7] is None:
            entry[7] = time.monotonic()

    def _round_done(self, key: int, round_: int) -> None:
        with self._lock:
            entry = self._rounds.pop((key, round_), None)
        if entry is None:
            return
        name, priority, channel, nbytes, queued, first, last, reply = entry
        done = time.monotonic()
        # pushes through an aggregator's tree are not seen leaving; and the clocks of two threads may
        # disagree by microseconds: each phase starts where the last ended
        first = queued if first is None else max(first, queued)
        last = first if last is None else max(last, first)
        reply = last if reply is None else max(reply, last)
        done = max(done, reply)
        args = {"step": round_, "priority": priority, "channel": channel, "bytes": nbytes}
        for phase, start, end in (("QUEUE", queued, first), ("PUSH", first, last), ("SERVER", last, reply),
                                  ("PULL", reply, done)):
            self.timeline.span(phase, name, self._us(start), self._us(end), args)

    # ---------------------------------------------------------------- collectives and the framework
    def collective(self, name: str, kind: str, priority: int, nbytes: int, handle: Any, members: str = "") -> None:
        """A collective request: NEGOTIATE until the engine launched it (handle.started), then `kind`."""
        submitted = time.monotonic()

        def done(_: Any) -> None:
            started = getattr(handle, "started", None) or submitted
            args: dict[str, Any] = {"priority": priority, "bytes": nbytes}
            if members:
                args["tensors"] = members
            self.timeline.span("NEGOTIATE", name, self._us(submitted), self._us(started), args)
            self.timeline.span(kind.upper(), name, self._us(started), self._us(time.monotonic()), args)

        handle.add_done_callback(done)

    def copy(self, kind: str, name: str, start: float, end: float, nbytes: int) -> None:
        """A device-resident group's share between device and host (`kind` D2H or H2D), as the host saw it: from
        queueing the copy (and the sum inside the host before it, or the gather after) to seeing it done."""
        self.timeline.span(kind, name, self._us(start), self._us(end), {"bytes": nbytes})

    def ready(self, name: str, step: int, priority: int) -> None:
        self.timeline.instant("READY", name, now_us(), {"step": step, "priority": priority})

    def applied(self, name: str, step: int, start: float, end: float) -> None:
        self.timeline.span("APPLY", name, self._us(start), self._us(end), {"step": step})

    def close(self) -> None:
        self.timeline.close()
