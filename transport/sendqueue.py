"""Per-channel send queue: most urgent first, FIFO among equals, bounded bytes in flight.

The backlog waits here, where it can still be reordered, instead of in ZeroMQ's FIFO pipes or the
kernel's socket buffers (the P3 / ByteScheduler trick). An item may leave when nothing is in flight
or when it fits under the bound, so a newly queued urgent chunk waits behind at most `bound` bytes.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Generic, TypeVar

T = TypeVar("T")


class ChannelQueue(Generic[T]):
    def __init__(self, bound: int) -> None:
        if bound < 1:
            raise ValueError("in-flight bound must be positive")
        self.bound = bound
        self.inflight = 0
        self._heap: list[tuple[int, int, int, T]] = []
        self._seq = itertools.count()
        self._front_seq = itertools.count(-1, -1)

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, priority: int, nbytes: int, item: T) -> None:
        heapq.heappush(self._heap, (priority, next(self._seq), nbytes, item))

    def push_front(self, priority: int, nbytes: int, item: T) -> None:
        """Return an item that could not be sent; it keeps its place among its priority."""
        heapq.heappush(self._heap, (priority, next(self._front_seq), nbytes, item))
        self.inflight -= nbytes

    def pop_ready(self) -> list[tuple[int, int, T]]:
        """Items that may be sent now, most urgent first, as (priority, nbytes, item); counted in flight."""
        ready: list[tuple[int, int, T]] = []
        heap = self._heap
        while heap:
            nbytes = heap[0][2]
            if self.inflight and self.inflight + nbytes > self.bound:
                break
            priority, _, nbytes, item = heapq.heappop(heap)
            self.inflight += nbytes
            ready.append((priority, nbytes, item))
        return ready

    def ack(self, nbytes: int) -> None:
        self.inflight = max(0, self.inflight - nbytes)
