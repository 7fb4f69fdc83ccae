"""Peers' shared-memory segments: mapped only when the peer itself announced them, opened safely.

A descriptor on the wire names a segment and an offset. The receiver honours it only for a segment
that the same peer announced on its own (authenticated) connection with SHM_OPEN, and that was, at
that moment, opened without following links and without blocking, and found to be a regular file of
ours in /dev/shm of exactly the announced size. Names must match the segment pattern exactly (a
trailing newline included). So no stranger can make a process map a file of its choosing, block in
`open` on a FIFO, or crash on a directory; and a peer can only point at its own segments.
"""

from __future__ import annotations

import mmap
import os
import re
import stat

SHM_DIR = "/dev/shm"
SEGMENT_NAME = re.compile(r"sluice-(\d+)-\d+-[0-9a-f]{8}")
#: segments one peer may have mapped here, and all peers together
MAX_PER_PEER = 256
MAX_MAPPED = 4096
#: the largest segment a peer may announce (registered tensors beyond the 64 MiB arenas get their own)
MAX_SEGMENT_BYTES = 1 << 40
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY


def valid_segment_name(name: object) -> bool:
    return isinstance(name, str) and SEGMENT_NAME.fullmatch(name) is not None


def open_segment(name: str, size: int) -> memoryview:
    """Map segment `name` read-only after checking it is what a peer of ours announced; ValueError if not."""
    if not valid_segment_name(name):
        raise ValueError(f"segment name {name[:60]!r} is not a Sluice segment")
    if not 0 < size <= MAX_SEGMENT_BYTES:
        raise ValueError(f"segment size {size} is out of range")
    try:
        fd = os.open(os.path.join(SHM_DIR, name), _OPEN_FLAGS)
    except OSError as exc:
        raise ValueError(f"segment {name} cannot be opened: {exc.strerror}") from None
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode):
            raise ValueError(f"segment {name} is not a regular file")
        if found.st_uid != os.geteuid():
            raise ValueError(f"segment {name} belongs to another user (uid {found.st_uid})")
        if found.st_nlink != 1:
            raise ValueError(f"segment {name} has {found.st_nlink} links")
        if found.st_dev != os.stat(SHM_DIR).st_dev:
            raise ValueError(f"segment {name} is not on the {SHM_DIR} file system")
        if found.st_size != size:
            raise ValueError(f"segment {name} holds {found.st_size} bytes, announced {size}")
        try:
            return memoryview(mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ))
        except (OSError, ValueError) as exc:
            raise ValueError(f"segment {name} cannot be mapped: {exc}") from None
    finally:
        os.close(fd)


class PeerSegments:
    """Segments adopted per peer; `view` resolves a descriptor against the sending peer's own only."""

    def __init__(self) -> None:
        self._maps: dict[str, dict[str, memoryview]] = {}
        self._count = 0

    def adopt(self, peer: str, name: str, size: int) -> None:
        """Map a segment `peer` announced; ValueError (nothing mapped) if it is not acceptable."""
        mine = self._maps.get(peer, {})
        if name in mine:
            if mine[name].nbytes != size:
                raise ValueError(f"segment {name} announced again with another size")
            return
        if len(mine) >= MAX_PER_PEER or self._count >= MAX_MAPPED:
            raise ValueError(f"too many shared-memory segments mapped (peer {peer!r:.60}: {len(mine)})")
        mapped = open_segment(name, size)  # a refused one leaves no trace: a flood of names grows nothing
        self._maps.setdefault(peer, {})[name] = mapped
        self._count += 1

    def view(self, peer: str, name: str, offset: int, nbytes: int) -> memoryview:
        """The payload a descriptor from `peer` names; ValueError if it names anything else."""
        mapped = self._maps.get(peer, {}).get(name)
        if mapped is None:
            raise ValueError(f"segment {name[:60]!r} was not announced by {peer!r:.60}")
        if offset + nbytes > mapped.nbytes:
            raise ValueError(f"descriptor [{offset}, {offset + nbytes}) lies outside segment {name} of {mapped.nbytes}")
        return mapped[offset : offset + nbytes]

    def forget(self, peer: str) -> None:
        """Unmap a departed peer's segments (views still held elsewhere keep their pages alive)."""
        self._count -= len(self._maps.pop(peer, {}))
