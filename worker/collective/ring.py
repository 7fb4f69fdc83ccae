"""Ring allreduce (reduce-scatter, then allgather) and the pipelined chain broadcast along the ring.

Every chunk moves on its own: the moment chunk c of a step arrives it is added into (or copied to)
this rank's array, straight from the payload (which may be the predecessor's shared memory), on the
I/O thread, and the same chunk of the next step leaves from the array, with no copy when the array
is registered memory.

Zero-copy safety within the op: a rank only writes a region of its array before sending from it,
or after the successor must have consumed what it sent from there. In the reduce-scatter segment k
is added into at step s-1 and sent at step s. In the allgather a rank overwrites segment p - g,
which it sent at reduce-scatter step g; the final value it receives there was summed by every rank
of the ring after it, the successor first, which therefore consumed our send before. Once the op
is over the caller may overwrite the array: that waits for the successor's DONE (ops.py).

Messages: ring allreduce, from the predecessor only: key = step (0..size-2 reduce-scatter, then
size-1..2*size-3 allgather), chunk = index among the chunks of the segment that step carries.
Broadcast: key 0, chunk = index among the array's chunks.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sluice.transport.wire import Message
from sluice.worker.collective.ops import CollectiveHandle, Link, Op, as_view
from sluice.worker.collective.reduce import accumulate, divide
from sluice.worker.collective.schedule import RingSchedule, chain, chunk_elems, chunk_spans


class RingAllreduce(Op):
    kind = "allreduce (ring)"

    def __init__(self, link: Link, seq: int, dtype: str, priority: int, channel: int, handle: CollectiveHandle,
                 array: np.ndarray, op: str, ring: Sequence[int], chunk_bytes: int) -> None:
        super().__init__(link, seq, dtype, priority, channel, handle)
        self.array = self.result = array
        self.op, self.average = op, op == "average"
        n, position = len(ring), list(ring).index(link.rank)
        self.pred, self.succ = ring[(position - 1) % n], ring[(position + 1) % n]
        elems = chunk_elems(chunk_bytes, array.itemsize)
        self.schedule = RingSchedule.build(array.size, n, position, elems)
        self.successor = RingSchedule.build(array.size, n, (position + 1) % n, elems)
        self.seen = bytearray(self.schedule.messages)

    def begin(self) -> None:
        schedule, itemsize = self.schedule, self.array.itemsize
        if schedule.size == 1:
            if self.average:
                divide(self.array, 1, self.dtype)
            return
        if schedule.messages:
            self.expect_from(self.pred, schedule.messages, schedule.bytes_per_rank(itemsize))
        if self.successor.messages:
            self.open_gate(self.succ, self.successor.messages, self.successor.bytes_per_rank(itemsize))
        for chunk, (start, length) in enumerate(schedule.chunks[schedule.send_segment(0)]):
            self.send(self.succ, 0, chunk, self.array[start : start + length])

    def on_data(self, src: int, msg: Message) -> str | None:
        schedule, step, chunk = self.schedule, msg.key, msg.chunk
        if src != self.pred:
            return f"ring data from rank {src}, which is not this rank's predecessor ({self.pred})"
        if step >= schedule.steps:
            return f"ring step {step} out of range (0..{schedule.steps - 1})"
        spans = schedule.chunks[schedule.recv_segment(step)]
        if chunk >= len(spans):
            return f"chunk {chunk} of ring step {step} out of range ({len(spans)} chunks)"
        start, length = spans[chunk]
        problem = self.check_chunk(msg, length)
        if problem:
            return problem
        slot = schedule.offsets[step] + chunk
        if self.seen[slot]:
            return f"chunk {chunk} of ring step {step} arrived twice"
        self.seen[slot] = 1
        dst = self.array[start : start + length]
        n = schedule.size
        if step < n - 1:  # reduce-scatter: add, then pass the partial sum on
            accumulate(dst, as_view(msg.payload, self.array.dtype), self.dtype, self.op)
            if step == n - 2 and self.average:  # this rank owns the segment's final sum: divide once, here
                divide(dst, n, self.dtype)
            self.send(self.succ, step + 1, chunk, dst)
        else:  # allgather: take the owner's final value, pass it on unless the successor owns it
            np.copyto(dst, as_view(msg.payload, self.array.dtype))
            if step < schedule.steps - 1:
                self.send(self.succ, step + 1, chunk, dst)
        self.received(src)
        return None


class ChainBroadcast(Op):
    """The root's array, chunk by chunk, along the ring starting at the root: each rank copies a chunk
    in and forwards it from its own array. Every link carries the array once (a star would make
    the root's link carry it size - 1 times); a chunk's latency is size - 1 hops, pipelined."""

    kind = "broadcast"

    def __init__(self, link: Link, seq: int, dtype: str, priority: int, channel: int, handle: CollectiveHandle,
                 array: np.ndarray, root: int, ring: Sequence[int], chunk_bytes: int) -> None:
        super().__init__(link, seq, dtype, priority, channel, handle)
        self.array = self.result = array
        path = chain(ring, root)
        index = path.index(link.rank)
        self.prev = path[index - 1] if index > 0 else None
        self.next = path[index + 1] if index + 1 < len(path) else None
        self.spans = chunk_spans(0, array.size, chunk_elems(chunk_bytes, array.itemsize))
        self.seen = bytearray(len(self.spans))

    def begin(self) -> None:
        if not self.spans:
            return
        if self.prev is not None:
            self.expect_from(self.prev, len(self.spans), self.array.nbytes)
        if self.next is not None:
            self.open_gate(self.next, len(self.spans), self.array.nbytes)
            if self.prev is None:
                for chunk, (start, length) in enumerate(self.spans):
                    self.send(self.next, 0, chunk, self.array[start : start + length])

    def on_data(self, src: int, msg: Message) -> str | None:
        if src != self.prev or msg.key != 0:
            return f"broadcast data (step {msg.key}) from rank {src}, which is not this rank's predecessor"
        if msg.chunk >= len(self.spans):
            return f"broadcast chunk {msg.chunk} out of range ({len(self.spans)} chunks)"
        start, length = self.spans[msg.chunk]
        problem = self.check_chunk(msg, length)
        if problem:
            return problem
        if self.seen[msg.chunk]:
            return f"broadcast chunk {msg.chunk} arrived twice"
        self.seen[msg.chunk] = 1
        dst = self.array[start : start + length]
        np.copyto(dst, as_view(msg.payload, self.array.dtype))
        if self.next is not None:
            self.send(self.next, 0, msg.chunk, dst)
        self.received(src)
        return None
