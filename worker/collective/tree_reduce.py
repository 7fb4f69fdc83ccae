"""Tree allreduce: chunks summed up a tree to its root, then the result sent back down, chunk by chunk.

Fewer hops than the ring (2 x depth against 2 x (size - 1)), so it suits small tensors; every rank
but the leaves adds (children) times the tensor. Each node sums a chunk as own + child[0] + child[1]
+ ... in the order its children are listed, whatever order they arrive in: a child's chunk that comes
before its elder siblings' is copied aside until they have been added. So results are bitwise the
same in every run, and the root's result, copied down, is bitwise the same on every rank.

Zero-copy safety: a node sends chunk c up from its array and next writes there the final chunk c,
which the parent can only send after it consumed ours; down-going chunks leave from the array once
final and the op waits for each child's DONE before it completes.

Messages: key UP (child to parent, partial sums) or DOWN (parent to child, the result), chunk = index
among the array's chunks.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sluice.transport.wire import Message
from sluice.worker.collective.ops import CollectiveHandle, Link, Op, as_view
from sluice.worker.collective.reduce import accumulate, divide
from sluice.worker.collective.schedule import chunk_elems, chunk_spans

UP, DOWN = 0, 1


class TreeAllreduce(Op):
    kind = "allreduce (tree)"

    def __init__(self, link: Link, seq: int, dtype: str, priority: int, channel: int, handle: CollectiveHandle,
                 array: np.ndarray, op: str, parent: int | None, children: Sequence[int],
                 chunk_bytes: int) -> None:
        super().__init__(link, seq, dtype, priority, channel, handle)
        self.array = self.result = array
        self.op, self.average = op, op == "average"
        self.parent = parent
        self.children = list(children)
        self.child_index = {child: i for i, child in enumerate(self.children)}
        self.spans = chunk_spans(0, array.size, chunk_elems(chunk_bytes, array.itemsize))
        #: per chunk, how many children (in order) have been added into it
        self.added = [0] * len(self.spans)
        #: (child index, chunk) -> a copy of a child's chunk that came before an elder sibling's
        self.stash: dict[tuple[int, int], np.ndarray] = {}
        self.seen_down = bytearray(len(self.spans))

    def begin(self) -> None:
        count, nbytes = len(self.spans), self.array.nbytes
        if not count:
            return
        for neighbour in [*self.children, *([] if self.parent is None else [self.parent])]:
            self.expect_from(neighbour, count, nbytes)
            self.open_gate(neighbour, count, nbytes)
        if not self.children:
            if self.parent is None:  # a job of one rank: the sum is the array
                return
            for chunk in range(count):
                self.summed(chunk)

    def on_data(self, src: int, msg: Message) -> str | None:
        chunk = msg.chunk
        if chunk >= len(self.spans):
            return f"tree chunk {chunk} out of range ({len(self.spans)} chunks)"
        start, length = self.spans[chunk]
        problem = self.check_chunk(msg, length)
        if problem:
            return problem
        dst = self.array[start : start + length]
        index = self.child_index.get(src)
        if msg.key == UP and index is not None:
            added = self.added[chunk]
            if index < added or (index, chunk) in self.stash:
                return f"tree chunk {chunk} from child {src} arrived twice"
            if index > added:  # an elder sibling's chunk is still to come: keep this one for later
                self.stash[(index, chunk)] = as_view(msg.payload, self.array.dtype).copy()
            else:
                accumulate(dst, as_view(msg.payload, self.array.dtype), self.dtype, self.op)
                added += 1
                while (added, chunk) in self.stash:
                    accumulate(dst, self.stash.pop((added, chunk)), self.dtype, self.op)
                    added += 1
                self.added[chunk] = added
                if added == len(self.children):
                    self.summed(chunk)
        elif msg.key == DOWN and src == self.parent and self.parent is not None:
            if self.seen_down[chunk]:
                return f"tree chunk {chunk} from the parent arrived twice"
            self.seen_down[chunk] = 1
            np.copyto(dst, as_view(msg.payload, self.array.dtype))
            for child in self.children:
                self.send(child, DOWN, chunk, dst)
        else:
            return f"tree step {msg.key} from rank {src}, which is neither a child nor the parent of this rank"
        self.received(src)
        return None

    def summed(self, chunk: int) -> None:
        """Own chunk plus every child's: up to the parent, or, at the root, final: down to the children."""
        start, length = self.spans[chunk]
        dst = self.array[start : start + length]
        if self.parent is not None:
            self.send(self.parent, UP, chunk, dst)
            return
        if self.average:
            divide(dst, len(self.link.names), self.dtype)
        for child in self.children:
            self.send(child, DOWN, chunk, dst)
