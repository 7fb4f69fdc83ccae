"""Allgather and alltoall: every rank sends a block of rows straight to every other rank (one hop).

Row counts differ per rank and only the sender knows its own, so an exchange runs in three moves:
each rank sends every other its row count (and the shape of a row, which must match its own); once
a rank knows every count it allocates its output, copies its own block in, and sends READY to each
rank that has rows for it; a rank sends a block only on the receiver's READY (no eager data), so
every chunk lands directly in its place in the output, never kept aside.

Messages: COLL_DATA key SIZES, chunk 0, int64 [rows, *row shape]; COLL_DATA key BLOCK, chunk c:
chunk c of the sender's block for this rank, flattened.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from sluice.transport.wire import Message
from sluice.worker.collective.ops import CollectiveHandle, Link, Op, as_view
from sluice.worker.collective.schedule import Span, chunk_elems, chunk_spans

SIZES, BLOCK = 0, 1


class Exchange(Op):
    """blocks[r]: the rows (shape (rows, *row_shape)) this rank sends to rank r (its own: kept)."""

    def __init__(self, link: Link, seq: int, dtype: str, priority: int, channel: int, handle: CollectiveHandle,
                 kind: str, blocks: Sequence[np.ndarray], chunk_bytes: int, max_bytes: int,
                 out: np.ndarray | None = None) -> None:
        """`out`: the caller's flat contiguous buffer the rows land in (registered memory: no new array, no copy
        out of it), which must hold exactly every rank's rows; None: a new array."""
        super().__init__(link, seq, dtype, priority, channel, handle)
        self.kind = kind
        self.out = out
        #: why `out` cannot take the rows: the op's error once the exchange is over
        self.mismatch: str | None = None
        self.blocks = list(blocks)
        mine = blocks[link.rank]
        self.row_shape = tuple(int(d) for d in mine.shape[1:])
        self.row_elems = math.prod(self.row_shape)
        self.storage = mine.dtype
        self.elems = chunk_elems(chunk_bytes, mine.itemsize)
        self.max_bytes = max_bytes
        self.rows: list[int | None] = [None] * len(link.names)
        self.rows[link.rank] = int(mine.shape[0])
        self.flat: np.ndarray | None = None  # the output, flattened, once every row count is known
        self.starts: list[int] = []
        self.spans: dict[int, list[Span]] = {}
        self.seen: dict[int, bytearray] = {}

    def begin(self) -> None:
        rank = self.link.rank
        for dest, block in enumerate(self.blocks):
            if dest == rank:
                continue
            sizes = np.array([block.shape[0], *self.row_shape], np.int64)
            self.link.send(dest, self.channel, Message(
                self.link.data_kind, sender=rank, key=SIZES, round=self.seq, priority=self.priority, dtype="int64",
                shape=(sizes.size,), payload=sizes))
            flat = block.reshape(-1)
            spans = chunk_spans(0, flat.size, self.elems)
            if spans:
                self.open_gate(dest, len(spans), flat.nbytes, eager=0)  # held until dest has its output ready
                for chunk, (start, length) in enumerate(spans):
                    self.send(dest, BLOCK, chunk, flat[start : start + length])
        self.maybe_layout()

    def complete(self) -> bool:
        return self.flat is not None

    def finished(self) -> bool:
        done = super().finished()
        if done and self.mismatch is not None:
            self.error = self.mismatch
        return done

    def waiting_for(self) -> dict[int, str]:
        out = super().waiting_for()
        for rank, rows in enumerate(self.rows):
            if rows is None:
                out.setdefault(rank, "its row count")
        return out

    def on_data(self, src: int, msg: Message) -> str | None:
        if msg.key == SIZES:
            return self.on_sizes(src, msg)
        if msg.key != BLOCK:
            return f"{self.kind} step {msg.key} is unknown"
        if self.flat is None or src not in self.spans:
            return f"{self.kind} data from rank {src} before this rank asked for it"
        spans = self.spans[src]
        if msg.chunk >= len(spans):
            return f"{self.kind} chunk {msg.chunk} from rank {src} out of range ({len(spans)} chunks)"
        start, length = spans[msg.chunk]
        problem = self.check_chunk(msg, length)
        if problem:
            return problem
        seen = self.seen[src]
        if seen[msg.chunk]:
            return f"{self.kind} chunk {msg.chunk} from rank {src} arrived twice"
        seen[msg.chunk] = 1
        first = self.starts[src] + start
        np.copyto(self.flat[first : first + length], as_view(msg.payload, self.storage))
        self.received(src)
        return None

    def on_sizes(self, src: int, msg: Message) -> str | None:
        if self.rows[src] is not None:
            return f"{self.kind} row count from rank {src} arrived twice"
        if msg.dtype != "int64" or msg.shape != (1 + len(self.row_shape),):
            return f"{self.kind} row count from rank {src} is {msg.dtype}{list(msg.shape)}"
        values = [int(v) for v in as_view(msg.payload, np.dtype(np.int64))]
        rows, row_shape = values[0], tuple(values[1:])
        if row_shape != self.row_shape:
            self.error = (f"rank {src} has rows of shape {list(row_shape)}, "
                          f"rank {self.link.rank} of {list(self.row_shape)}")
            return None
        if rows < 0 or rows * self.row_elems * self.storage.itemsize > self.max_bytes:
            self.error = f"rank {src} announces {rows} rows, beyond the {self.max_bytes}-byte limit"
            return None
        self.rows[src] = rows
        self.maybe_layout()
        return None

    def maybe_layout(self) -> None:
        """Every row count known: allocate the output, put our own block in, ask for the others."""
        if self.flat is not None or any(rows is None for rows in self.rows):
            return
        rows = [r or 0 for r in self.rows]
        if self.out is not None and self.out.size != sum(rows) * self.row_elems:
            # the exchange still runs, into a new array, so that the other ranks get their rows and stay in step;
            # this rank's op fails once it is done
            self.mismatch = (f"the {self.kind}'s output buffer holds {self.out.size} elements, and the ranks' rows "
                             f"({rows}) make {sum(rows) * self.row_elems}")
        out = (self.out.reshape((sum(rows), *self.row_shape)) if self.out is not None and self.mismatch is None
               else np.empty((sum(rows), *self.row_shape), self.storage))
        self.flat = out.reshape(-1)
        self.starts = [0]
        for count in rows:
            self.starts.append(self.starts[-1] + count * self.row_elems)
        rank = self.link.rank
        own = self.blocks[rank].reshape(-1)
        self.flat[self.starts[rank] : self.starts[rank] + own.size] = own
        for src, count in enumerate(rows):
            if src != rank and count:
                size = count * self.row_elems
                self.spans[src] = chunk_spans(0, size, self.elems)
                self.seen[src] = bytearray(len(self.spans[src]))
                self.expect_from(src, len(self.spans[src]), size * self.storage.itemsize, eager=0)
        self.result = out
        self.handle.splits = rows
