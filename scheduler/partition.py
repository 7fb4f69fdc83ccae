"""Partition planner: cuts declared tensors into chunks and spreads them evenly over servers.

Pure: plain data in, plain data out. Chunks are at most `chunk_bytes`, and also at most 1/12 of a
server's fair share of the bytes declared in this call. Longest-processing-time placement (largest
chunk first, onto the least loaded server) leaves max - min load below one chunk, so with chunks of
at most mean/12 every server holds within 10% of every other: max/min <= 1 + (1/12)/(11/12) < 1.1.
Chunks never go below MIN_CHUNK_BYTES (per-message cost dominates there), and tensors smaller than a
chunk stay whole, so tables under about 12 KiB per server balance only as well as their tensors allow.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from transport.wire import DTYPES

MIN_CHUNK_BYTES = 1024


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPES[self.dtype]


@dataclass(frozen=True)
class ChunkPlan:
    chunk: int
    offset: int  # in elements, into the flattened tensor
    length: int  # in elements
    server: int  # server rank, 0..servers-1


@dataclass(frozen=True)
class TensorPlan:
    key: int
    spec: TensorSpec
    priority: int
    chunks: tuple[ChunkPlan, ...]


def chunk_elements(spec: TensorSpec, chunk_bytes: int, fair_share_bytes: int) -> int:
    """Elements per chunk for `spec`: the chunk cap, shrunk to 1/12 of a fair share, at least one."""
    limit = min(chunk_bytes, max(fair_share_bytes // 12, MIN_CHUNK_BYTES))
    return max(1, limit // DTYPES[spec.dtype])


def plan_tensors(
    specs: Sequence[TensorSpec],
    first_key: int,
    servers: int,
    chunk_bytes: int,
    load: Sequence[int] | None = None,
) -> tuple[list[TensorPlan], list[int]]:
    """Plan `specs` (keys from `first_key`, priority = declaration order); return plans and new loads."""
    if servers < 1:
        raise ValueError("need at least one server")
    loads = list(load) if load is not None else [0] * servers
    fair_share = sum(s.nbytes for s in specs) // servers
    pieces: list[tuple[int, int, int, int]] = []  # (nbytes, index, chunk, offset)
    lengths: dict[tuple[int, int], int] = {}
    for index, spec in enumerate(specs):
        step = chunk_elements(spec, chunk_bytes, fair_share)
        for chunk, offset in enumerate(range(0, max(spec.numel, 1), step)):
            length = min(step, spec.numel - offset)
            lengths[(index, chunk)] = length
            pieces.append((length * DTYPES[spec.dtype], index, chunk, offset))
    placement: dict[tuple[int, int], int] = {}
    for nbytes, index, chunk, _ in sorted(pieces, key=lambda p: (-p[0], p[1], p[2])):
        server = min(range(servers), key=lambda s: (loads[s], s))
        loads[server] += nbytes
        placement[(index, chunk)] = server
    plans = []
    for index, spec in enumerate(specs):
        chunks = tuple(
            ChunkPlan(chunk, offset, lengths[(i, chunk)], placement[(i, chunk)])
            for _, i, chunk, offset in pieces
            if i == index
        )
        plans.append(TensorPlan(first_key + index, spec, index, chunks))
    return plans, loads
