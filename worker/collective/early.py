"""Messages for collectives a faster peer started before this rank did: copied, bounded, handed over later.

A payload is only valid while the transport's handler runs (it may be the sender's shared memory),
so a message for an op not started here is copied. What one sender may send for one op before our
READY is its eager budget (ops.py); beyond that budget, or beyond `max_ops` distinct ops, `window`
seqs ahead of the last op started, or `max_bytes` in all (each message's bookkeeping counted), a
message is refused: the memory kept is bounded whatever peers send.
"""

from __future__ import annotations

import numpy as np

from sluice.transport.wire import Message

#: beyond the eager budget, an op's early messages may hold an exchange's row counts (8 x 9 bytes at most)
SIZES_BYTES = 128
#: what one kept message costs besides its payload (the Message, the list entry), counted against max_bytes
OVERHEAD_BYTES = 256


class EarlyMessages:
    def __init__(self, eager_bytes: int, max_ops: int, max_bytes: int, window: int) -> None:
        self.eager_bytes, self.max_ops, self.max_bytes, self.window = eager_bytes, max_ops, max_bytes, window
        self._kept: dict[int, list[tuple[int, Message]]] = {}  # seq -> (sender rank, copy), in arrival order
        self._sizes: dict[tuple[int, int], int] = {}  # (seq, sender) -> payload bytes kept
        self._total = 0
        #: messages kept so far (for tests and diagnostics)
        self.count = 0

    def keep(self, src: int, msg: Message, last_seq: int) -> str | None:
        """Keep a copy of `msg` (from rank `src`, for an op after `last_seq`); the reason not to, or None."""
        seq = msg.round
        if seq > last_seq + self.window or (seq not in self._kept and len(self._kept) >= self.max_ops):
            return f"op {seq} is too far ahead of this rank (last started: {last_seq})"
        nbytes = 0 if msg.payload is None else msg.payload.nbytes
        kept = self._sizes.get((seq, src), 0) + nbytes
        if kept > self.eager_bytes + SIZES_BYTES or self._total + nbytes + OVERHEAD_BYTES > self.max_bytes:
            return f"more early data for op {seq} than its eager budget or the early-data bound allow"
        payload = None if msg.payload is None else np.frombuffer(msg.payload, np.uint8).copy()
        copy = Message(msg.kind, sender=msg.sender, key=msg.key, chunk=msg.chunk, round=seq, priority=msg.priority,
                       dtype=msg.dtype, shape=msg.shape, payload=payload)
        self._kept.setdefault(seq, []).append((src, copy))
        self._sizes[(seq, src)] = kept
        self._total += nbytes + OVERHEAD_BYTES
        self.count += 1
        return None

    def take(self, seq: int) -> tuple[list[tuple[int, Message]], list[tuple[int, int]]]:
        """What was kept for op `seq`, and (sender, seq) of what was kept for earlier ops, dropped now:
        ops start in increasing seq order, so those will never start here."""
        dropped = []
        for stale in [s for s in self._kept if s < seq]:
            dropped += [(src, stale) for src, _ in self._forget(stale)]
        return self._forget(seq), dropped

    def _forget(self, seq: int) -> list[tuple[int, Message]]:
        kept = self._kept.pop(seq, [])
        for src, msg in kept:
            self._sizes.pop((seq, src), None)
            self._total -= (0 if msg.payload is None else msg.payload.nbytes) + OVERHEAD_BYTES
        return kept

    def clear(self) -> None:
        self._kept.clear()
        self._sizes.clear()
        self._total = 0
