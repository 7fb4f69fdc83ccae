"""Per-channel send queue: most urgent first, FIFO among equals, bounded bytes in flight, an aging bound.

The backlog waits here, where it can still be reordered, instead of in ZeroMQ's FIFO pipes or the
kernel's socket buffers (the P3 / ByteScheduler trick). An item may leave when nothing is in flight
or when it fits under the bound, so a newly queued urgent chunk waits behind at most `bound` bytes.
Strict priority can starve bulk traffic while urgent traffic keeps coming; with an `aging` bound, an
item that has waited that long leaves before any newer item, whatever its priority.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")

# an entry is [priority, seq, nbytes, item, enqueued, live]; lists compare by (priority, seq), seq is unique
_PRIORITY, _SEQ, _NBYTES, _ITEM, _ENQUEUED, _LIVE = range(6)


class ChannelQueue(Generic[T]):
    def __init__(self, bound: int, aging: float | None = None) -> None:
        if bound < 1:
            raise ValueError("in-flight bound must be positive")
        if aging is not None and aging <= 0:
            raise ValueError("the aging bound must be positive")
        self.bound = bound
        self.aging = aging
        self.inflight = 0
        self._heap: list[list[Any]] = []
        self._arrivals: deque[list[Any]] = deque()  # the same entries in arrival order, for aging
        self._live = 0
        self._seq = itertools.count()
        self._front_seq = itertools.count(-1, -1)

    def __len__(self) -> int:
        return self._live

    def push(self, priority: int, nbytes: int, item: T, now: float = 0.0) -> None:
        entry = [priority, next(self._seq), nbytes, item, now, True]
        heapq.heappush(self._heap, entry)
        if self.aging is not None:
            self._arrivals.append(entry)
        self._live += 1

    def push_front(self, priority: int, nbytes: int, item: T, enqueued: float = 0.0) -> None:
        """Return an item that could not be sent; it keeps its place among its priority and its age."""
        entry = [priority, next(self._front_seq), nbytes, item, enqueued, True]
        heapq.heappush(self._heap, entry)
        if self.aging is not None:
            self._arrivals.appendleft(entry)
        self._live += 1
        self.inflight -= nbytes

    def pop_ready(self, now: float = 0.0) -> list[tuple[int, int, T, float]]:
        """Items that may be sent now as (priority, nbytes, item, enqueued), counted in flight.

        Most urgent first, except that items older than the aging bound go first, oldest first.
        """
        ready: list[tuple[int, int, T, float]] = []
        while self._live:
            entry = self._next(now)
            nbytes = entry[_NBYTES]
            if self.inflight and self.inflight + nbytes > self.bound:
                break
            entry[_LIVE] = False
            self._live -= 1
            self.inflight += nbytes
            ready.append((entry[_PRIORITY], nbytes, entry[_ITEM], entry[_ENQUEUED]))
        return ready

    def take(self, match: Callable[[T], bool]) -> list[tuple[int, int, T, float]]:
        """Take out the queued items `match` picks, as (priority, nbytes, item, enqueued) in the order they would
        have left (by priority); what is in flight stays counted."""
        taken = [entry for entry in sorted(self._heap) if entry[_LIVE] and match(entry[_ITEM])]
        for entry in taken:
            entry[_LIVE] = False  # dropped from the heap and the arrivals lazily, as aging's are
        self._live -= len(taken)
        return [(entry[_PRIORITY], entry[_NBYTES], entry[_ITEM], entry[_ENQUEUED]) for entry in taken]

    def _next(self, now: float) -> list[Any]:
        heap = self._heap
        while not heap[0][_LIVE]:  # entries taken out of turn by aging are dropped lazily
            heapq.heappop(heap)
        if self.aging is not None:
            arrivals = self._arrivals
            while not arrivals[0][_LIVE]:
                arrivals.popleft()
            if now - arrivals[0][_ENQUEUED] >= self.aging:
                return arrivals[0]
        return heap[0]

    def ack(self, nbytes: int) -> None:
        self.inflight = max(0, self.inflight - nbytes)
