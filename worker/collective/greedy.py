"""Horovod's greedy fusion (`collective.fusion = "greedy"`, bench/fusion.py's baseline): one message's ops fused.

What one coordinator message decides is copied into fusion buffers of up to `collective.fusion_bytes`,
one allreduce each. Each gradient is negotiated alone; the root's decisions of one message (the operations every rank
had ready when it decided, Horovod's cycle) are fused in decision order, a new buffer started when
the dtype, the op or the size limit says so. Every rank sees the same messages with the same
decisions, so every rank fuses alike. The sizes of the fused buffers are kept for the benchmark.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

#: fused buffer sizes kept for stats (the latest ones)
KEEP_SIZES = 100_000


class GreedyFusion:
    """Collects the allreduces of one decision message; `flush` hands each fused batch to `launch`."""

    def __init__(self, limit: int, launch: Callable[[list[tuple[Any, Any]]], None]) -> None:
        self.limit = limit
        self._launch = launch
        self._batch: list[tuple[Any, Any]] = []  # (entry, decision)
        self._key: tuple[Any, ...] | None = None
        self._bytes = 0
        self.sizes: deque[int] = deque(maxlen=KEEP_SIZES)

    def offer(self, entry: Any, decision: Any) -> bool:
        """Take a single-tensor allreduce into the current batch (True), or leave it to the caller."""
        request = entry.request
        if request.kind != "allreduce" or len(entry.arrays) != 1:
            return False
        array: np.ndarray = entry.arrays[0]
        key = (decision.batch, request.dtype, request.op)
        if self._batch and (key != self._key or self._bytes + array.nbytes > self.limit):
            self.flush()
        self._batch.append((entry, decision))
        self._key, self._bytes = key, self._bytes + array.nbytes
        return True

    def flush(self) -> None:
        if not self._batch:
            return
        batch, self._batch, self._key = self._batch, [], None
        self.sizes.append(self._bytes)
        self._bytes = 0
        self._launch(batch)
