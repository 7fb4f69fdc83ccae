"""Partition planner: cuts declared tensors into chunks and spreads them evenly over servers.

Pure: plain data in, plain data out. Every message costs Python tens of microseconds at each hop, so
chunks should be as large as balance allows. The planner starts with chunks of `chunk_bytes` (each
tensor cut into equal pieces), places them longest-processing-time first (largest chunk onto the
least loaded server), and halves the chunk size until every server holds within 10% of every other.
It always gets there once chunks are at most 1/12 of a server's fair share: LPT leaves max - min
load below one chunk, so max/min <= 1 + (1/12)/(11/12) < 1.1. Chunks never go below
MIN_CHUNK_BYTES, so tables under about 12 KiB per server balance only as well as their tensors allow.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sluice.transport.wire import DTYPES

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


BALANCE = 1.10


def split(spec: TensorSpec, cap_bytes: int) -> list[tuple[int, int]]:
    """(offset, length) in elements of the equal pieces of at most `cap_bytes` that make up `spec`."""
    numel = max(spec.numel, 1)
    pieces = max(1, -(-spec.nbytes // max(cap_bytes, 1)))
    step = -(-numel // pieces)
    return [(offset, min(step, numel - offset)) for offset in range(0, numel, step)]


def place(sizes: Sequence[int], loads: Sequence[int]) -> tuple[list[int], list[int]]:
    """LPT: each size (largest first, ties by index) onto the least loaded server (ties by rank)."""
    new_loads = list(loads)
    servers = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        server = min(range(len(new_loads)), key=lambda s: (new_loads[s], s))
        new_loads[server] += sizes[index]
        servers[index] = server
    return servers, new_loads


def balanced(loads: Sequence[int]) -> bool:
    return max(loads) <= BALANCE * min(loads)


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
    cap = max(chunk_bytes, 1)
    while True:
        pieces = [(index, piece) for index, spec in enumerate(specs) for piece in split(spec, cap)]
        sizes = [length * DTYPES[specs[index].dtype] for index, (_, length) in pieces]
        owners, new_loads = place(sizes, loads)
        if balanced(new_loads) or cap <= MIN_CHUNK_BYTES:
            break
        cap = max(cap // 2, MIN_CHUNK_BYTES)
    chunks: list[list[ChunkPlan]] = [[] for _ in specs]
    for (index, (offset, length)), server in zip(pieces, owners, strict=True):
        chunks[index].append(ChunkPlan(len(chunks[index]), offset, length, server))
    plans = [TensorPlan(first_key + i, spec, i, tuple(chunks[i])) for i, spec in enumerate(specs)]
    return plans, new_loads
