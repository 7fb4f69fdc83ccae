"""Pure schedules of the collectives: segments, chunks, ring steps, chain and tree shapes (no sockets, no clocks)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

Span = tuple[int, int]  # (first element, element count)


def split(count: int, parts: int) -> list[Span]:
    """`count` elements in `parts` contiguous near-equal spans; the first count % parts are one longer."""
    base, extra = divmod(count, parts)
    spans, start = [], 0
    for part in range(parts):
        length = base + (part < extra)
        spans.append((start, length))
        start += length
    return spans


def chunk_spans(start: int, length: int, chunk_elems: int) -> list[Span]:
    """A span cut into chunks of at most `chunk_elems` elements (none for an empty span)."""
    return [(first, min(chunk_elems, start + length - first)) for first in range(start, start + length, chunk_elems)]


def chunk_elems(chunk_bytes: int, itemsize: int) -> int:
    """Elements per chunk: as many as fit in chunk_bytes, at least one."""
    return max(1, chunk_bytes // itemsize)


@dataclass(frozen=True)
class RingSchedule:
    """Ring allreduce at ring position `position` of `size`: reduce-scatter, then allgather.

    Steps 0..size-2 reduce: at step s a rank sends segment (p - s) and adds what its predecessor
    sends into segment (p - s - 1). After the last one it holds segment (p + 1) summed over all
    ranks. Steps size-1..2*size-3 gather: at gather step g it sends segment (p + 1 - g) and receives
    segment (p - g). Segment k's sum thus always starts at position k and runs along the ring, the
    same order whatever the timing: results are bitwise reproducible.
    """

    size: int
    position: int
    segments: tuple[Span, ...]
    chunks: tuple[tuple[Span, ...], ...]  # per segment
    #: per step, the index of its first message among all the messages from the predecessor
    offsets: tuple[int, ...]

    @classmethod
    def build(cls, count: int, size: int, position: int, elems_per_chunk: int) -> RingSchedule:
        segments = tuple(split(count, size))
        chunks = tuple(tuple(chunk_spans(start, length, elems_per_chunk)) for start, length in segments)
        offsets, total = [], 0
        for step in range(2 * (size - 1)):
            offsets.append(total)
            total += len(chunks[(position - step - 1 if step < size - 1 else position - step + size - 1) % size])
        offsets.append(total)
        return cls(size, position, segments, chunks, tuple(offsets))

    @property
    def steps(self) -> int:
        return 2 * (self.size - 1)

    def send_segment(self, step: int) -> int:
        p, n = self.position, self.size
        return (p - step) % n if step < n - 1 else (p + 1 - (step - n + 1)) % n

    def recv_segment(self, step: int) -> int:
        p, n = self.position, self.size
        return (p - step - 1) % n if step < n - 1 else (p - (step - n + 1)) % n

    @property
    def messages(self) -> int:
        """Messages each rank gets from its predecessor (and sends to its successor)."""
        return self.offsets[-1]

    def bytes_per_rank(self, itemsize: int) -> int:
        """Payload bytes each rank gets from its predecessor."""
        return sum(self.segments[self.recv_segment(s)][1] for s in range(self.steps)) * itemsize


def chain(order: Sequence[int], root: int) -> list[int]:
    """The ring `order` rotated to start at `root`: the path a pipelined broadcast takes."""
    start = list(order).index(root)
    return [*order[start:], *order[:start]]


def heap_tree(order: Sequence[int]) -> tuple[dict[int, int | None], dict[int, list[int]]]:
    """A binary tree over `order` (order[0] the root, order[i]'s parent order[(i-1)//2]): ring
    neighbours, which share hosts, share subtrees. (parent of each rank, children of each rank)."""
    parent: dict[int, int | None] = {order[0]: None}
    children: dict[int, list[int]] = {rank: [] for rank in order}
    for index in range(1, len(order)):
        up = order[(index - 1) // 2]
        parent[order[index]] = up
        children[up].append(order[index])
    return parent, children
