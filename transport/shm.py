"""Shared-memory payloads between peers on one host: registered buffers, send rings, read-only maps.

On one machine a parameter server moves twice the bytes of a ring all-reduce (worker -> server ->
worker), and over loopback TCP every byte is copied by the kernel twice. Here a payload instead lies
in a /dev/shm segment and the ZeroMQ message carries only (segment, offset): a registered buffer (the
server's published values) is sent with no copy at all, any other payload is copied once into a
per-route ring whose space the receiver's credit acknowledgements free again, in FIFO order.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Iterable
from typing import Any, Literal

import numpy as np

from sluice.errors import SluiceError
from sluice.transport.shm_peers import SEGMENT_NAME, SHM_DIR, PeerSegments
from sluice.transport.shm_space import Segment

_ALIGN = 64
_ARENA_BYTES = 64 << 20
log = logging.getLogger("sluice.transport")


def _round_up(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def remove_segments_of(pid: int) -> int:
    """Delete the segments a (dead) process left behind; the launcher calls this for every child."""
    removed = 0
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    for name in names:
        match = SEGMENT_NAME.fullmatch(name)
        if match and int(match.group(1)) == pid:
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed += 1
            except OSError:
                pass
    return removed


class Ring:
    """FIFO space allocator over one segment: allocations are freed in the order they were made."""

    def __init__(self, size: int) -> None:
        self.segment = Segment(size, "a send ring to a process on this host")
        self._live: deque[tuple[int, int]] = deque()  # (start, end) of each allocation, oldest first

    def alloc(self, nbytes: int) -> int | None:
        """Offset of `nbytes` of contiguous free space, or None until older allocations are freed."""
        size, cap = _round_up(max(nbytes, 1)), self.segment.size
        if not self._live:
            start = 0 if size <= cap else None
        else:
            head, tail = self._live[-1][1], self._live[0][0]
            if head > tail:  # live data is one block [tail, head)
                start = head if cap - head >= size else (0 if tail >= size else None)
            else:  # live data wraps around the end
                start = head if tail - head >= size else None
        if start is not None:
            self._live.append((start, start + size))
        return start

    def free_oldest(self) -> None:
        self._live.popleft()

    def free_newest(self) -> None:
        self._live.pop()



class Registry:
    """Arrays callers allocate in shared memory, so sending them needs no copy (bump arenas).

    A registered array is recognised by identity (the registry keeps it alive, so its id is never
    reused): a dict lookup per message. A slice of one (a chunk of a registered tensor) is recognised
    by its base, the segment's array, and located by its address.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: every segment, in order of creation; appended to (under the lock) from callers' threads
        self.segments: list[Segment] = []
        self._used = 0
        self._arrays: dict[int, tuple[np.ndarray, Segment, int]] = {}
        self._bases: dict[int, tuple[Segment, int]] = {}  # id(segment.bytes) -> (segment, address)

    def alloc(self, count: int, dtype: np.dtype) -> np.ndarray:
        """A zeroed array in shared memory; SluiceError naming the size and the fix when /dev/shm is full."""
        nbytes = count * dtype.itemsize
        size = _round_up(max(nbytes, 1))
        purpose = f"a shared array of {count} {dtype} (fusion buffers, a server's or aggregator's sums)"
        with self._lock:
            if size > _ARENA_BYTES:
                segment, start = self._new_segment(size, purpose), 0
            else:
                if not self.segments or self.segments[-1].size != _ARENA_BYTES or self._used + size > _ARENA_BYTES:
                    self._new_segment(_ARENA_BYTES, purpose, lazily=True)
                    self._used = 0
                segment, start = self.segments[-1], self._used
                segment.purpose = purpose
                segment.reserve(start, size)
                self._used += size
            array = segment.bytes[start : start + nbytes].view(dtype)
            self._arrays[id(array)] = (array, segment, start)
        return array

    def _new_segment(self, size: int, purpose: str, lazily: bool = False) -> Segment:
        segment = Segment(size, purpose, lazily)
        self.segments.append(segment)
        self._bases[id(segment.bytes)] = (segment, segment.bytes.ctypes.data)
        return segment

    def locate(self, payload: object) -> tuple[Segment, int] | None:
        """(segment, offset) if `payload` is an array this registry allocated, or a view of one."""
        found = self._arrays.get(id(payload))
        if found is not None:
            return found[1], found[2]
        base = self._bases.get(id(getattr(payload, "base", None)))
        if base is None or not isinstance(payload, np.ndarray) or not payload.flags.c_contiguous:
            return None
        return base[0], payload.ctypes.data - base[1]

    def close(self) -> None:
        for segment in self.segments:
            segment.unlink()


Route = tuple[str, int]

#: below this a payload travels inline: a small ZeroMQ frame costs less than the bookkeeping
SHM_MIN_BYTES = 16 << 10


class SharedPayloads:
    """One transport's shared-memory state: its registered buffers, a ring per route, peers' maps.

    A segment is used for a peer only after the peer confirmed (SHM_MAPPED) that it mapped it on our
    announcement (SHM_OPEN); until then payloads travel inline. A ring serves one peer, so its name is
    unlinked as soon as that peer has mapped it: nothing of it is left in /dev/shm to clean up later.
    """

    def __init__(self, ring_bytes: int) -> None:
        self.ring_bytes = ring_bytes
        self.registry = Registry()
        self.peers = PeerSegments()
        self._rings: dict[Route, Ring] = {}
        #: per route, the payload messages sent and not yet acknowledged: (nbytes, used the ring)
        self._unacked: dict[Route, deque[tuple[int, bool]]] = {}
        self._mapped_by: dict[str, set[str]] = {}  # peer -> our segments it confirmed mapping
        self._announced: dict[str, set[str]] = {}  # peer -> our segments announced to it
        #: (peer, segment, size) announcements the transport has yet to send
        self.pending: deque[tuple[str, str, int]] = deque()
        self._registered_seen = 0
        #: routes whose ring could not be had (/dev/shm full): their payloads travel inline
        self._ringless: set[Route] = set()

    def _usable(self, peer: str, name: str, size: int) -> bool:
        """True once `peer` mapped segment `name`; else announce it (once) and send inline meanwhile."""
        mapped = self._mapped_by.get(peer)
        if mapped is not None and name in mapped:
            return True
        announced = self._announced.setdefault(peer, set())
        if name not in announced:
            announced.add(name)
            self.pending.append((peer, name, size))
        return False

    def announce_registered(self, peers: Iterable[str], new_only: bool = False) -> None:
        """Queue announcements of registered segments to `peers` (all, or those made since the last call)."""
        segments = self.registry.segments[self._registered_seen if new_only else 0 :]
        if new_only:
            self._registered_seen += len(segments)
        for peer in peers:
            for segment in segments:
                self._usable(peer, segment.name, segment.size)

    def registered_changed(self) -> bool:
        return len(self.registry.segments) != self._registered_seen

    def confirmed(self, peer: str, name: str) -> None:
        """`peer` mapped our segment `name`: use it from now on; a ring's name is no longer needed."""
        if name not in self._announced.get(peer, ()):
            return
        self._mapped_by.setdefault(peer, set()).add(name)
        for (ring_peer, _), ring in self._rings.items():
            if ring_peer == peer and ring.segment.name == name:
                ring.segment.unlink()

    def prepare(self, route: Route, payload: Any, nbytes: int) -> tuple[str, int, int] | Literal[False] | None:
        """Where `payload` goes for `route`: a descriptor, None to send it inline, False if no room yet."""
        if nbytes < SHM_MIN_BYTES:
            return None
        found = self.registry.locate(payload)
        if found is not None:
            segment, start = found
            return (segment.name, start, nbytes) if self._usable(route[0], segment.name, segment.size) else None
        ring = self._rings.get(route)
        if ring is None:
            if nbytes > self.ring_bytes or route in self._ringless:
                return None
            try:
                ring = self._rings[route] = Ring(self.ring_bytes)
            except SluiceError as exc:  # a ring only saves a copy: the payloads go through the socket instead
                self._ringless.add(route)
                if len(self._ringless) == 1:
                    log.warning("%s; meanwhile payloads to processes on this host travel through sockets", exc)
                return None
        if nbytes > ring.segment.size or not self._usable(route[0], ring.segment.name, ring.segment.size):
            return None
        offset = ring.alloc(nbytes)
        if offset is None:
            return False
        ring.segment.bytes[offset : offset + nbytes] = np.frombuffer(payload, np.uint8)
        return ring.segment.name, offset, nbytes

    def sent(self, route: Route, nbytes: int, descriptor: tuple[str, int, int] | None) -> None:
        ring = self._rings.get(route)
        used_ring = descriptor is not None and ring is not None and descriptor[0] == ring.segment.name
        self._unacked.setdefault(route, deque()).append((nbytes, used_ring))

    def unsent(self, route: Route, descriptor: tuple[str, int, int] | None) -> None:
        """ZeroMQ refused a prepared message: give its ring space back."""
        ring = self._rings.get(route)
        if descriptor is not None and ring is not None and descriptor[0] == ring.segment.name:
            ring.free_newest()

    def acked(self, route: Route, nbytes: int) -> None:
        pending = self._unacked.get(route)
        while pending and pending[0][0] <= nbytes:
            size, used_ring = pending.popleft()
            nbytes -= size
            if used_ring:
                self._rings[route].free_oldest()

    def forget(self, peer: str) -> None:
        """A peer is gone (replaced by a new process of its name, say): unmap its segments, drop our rings
        to it (their names are gone: a new one could not map them), announce our segments afresh."""
        self.peers.forget(peer)
        self._mapped_by.pop(peer, None)
        self._announced.pop(peer, None)
        for route in [r for r in self._rings if r[0] == peer]:
            self._rings.pop(route).segment.unlink()
        for route in [r for r in self._unacked if r[0] == peer]:
            del self._unacked[route]
        self._ringless = {route for route in self._ringless if route[0] != peer}
        kept = [item for item in self.pending if item[0] != peer]
        self.pending.clear()
        self.pending.extend(kept)

    def close(self) -> None:
        for ring in self._rings.values():
            ring.segment.unlink()
        self.registry.close()
