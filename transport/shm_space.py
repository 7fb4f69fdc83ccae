"""Our /dev/shm segments, reserved before they are mapped: a full /dev/shm is an error, never a SIGBUS.

A file in tmpfs grown with ftruncate is sparse: its pages are allocated when first touched, and a
page that cannot be allocated then kills the process with SIGBUS, in the middle of whatever wrote to
it. `posix_fallocate` allocates them up front instead, or fails with ENOSPC while nothing has
happened yet (tmpfs gives back what it allocated of a range it could not fill).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import mmap
import os
import secrets

import numpy as np

from sluice.errors import SluiceError
from sluice.transport.shm_peers import SHM_DIR

_counter = itertools.count()
#: the remedy, in every shortage message: a container's /dev/shm is 64 MiB unless it is given more
SHM_FIX = ("mount a larger /dev/shm (docker run --shm-size=SIZE; on Kubernetes an emptyDir with medium: Memory and "
           "a sizeLimit mounted at /dev/shm, which `sluice kubernetes --model-bytes BYTES` or --shm-size SIZE writes)")


def mebibytes(nbytes: int) -> str:
    """`nbytes` for a person: bytes and MiB."""
    return f"{nbytes} bytes ({nbytes / (1 << 20):.1f} MiB)"


def space_of(directory: str) -> tuple[int, int] | None:
    """(bytes free, bytes in all) of the file system holding `directory`; None if it cannot be asked."""
    try:
        found = os.statvfs(directory)
    except OSError:
        return None
    return found.f_bavail * found.f_frsize, found.f_blocks * found.f_frsize


def shortage(purpose: str, nbytes: int, directory: str, held: int = 0, alternative: str = "") -> str:
    """The message for `nbytes` more of `directory` that could not be had: how much, how much is free, the fix."""
    space = space_of(directory)
    free = f"; {directory} has {mebibytes(space[0])} free of {mebibytes(space[1])}" if space else ""
    holding = f" (this process holds {mebibytes(held)} there already)" if held else ""
    return (f"{purpose} needs {mebibytes(nbytes)} more of shared memory in {directory}{holding}{free}: "
            f"{SHM_FIX}{alternative}")


def reserve(fd: int, offset: int, nbytes: int, purpose: str, directory: str, held: int = 0,
            alternative: str = "") -> None:
    """Allocate bytes [offset, offset + nbytes) of the tmpfs file `fd`; SluiceError saying what to do if
    the file system is full. `purpose` names what needs the memory, `alternative` adds another way out."""
    if nbytes <= 0:
        return
    try:
        os.posix_fallocate(fd, offset, nbytes)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM, errno.EFBIG):
            raise SluiceError(shortage(purpose, nbytes, directory, held, alternative)) from None
        raise SluiceError(f"{purpose}: cannot allocate {mebibytes(nbytes)} in {directory}: {exc.strerror}"
                          f"{alternative}") from None


class Segment:
    """A /dev/shm file of ours, mapped read-write; unlinked on close.

    Its memory is reserved (posix_fallocate) before anything touches it: all of it at once, or with
    `lazily`, range by range as reserve() is called (an arena reserves what it hands out, so a small
    job holds no more /dev/shm than it uses)."""

    #: bytes this process reserved in /dev/shm, for the shortage message
    reserved_here = 0

    def __init__(self, size: int, purpose: str = "a shared-memory segment", lazily: bool = False) -> None:
        self.name = f"sluice-{os.getpid()}-{next(_counter)}-{secrets.token_hex(4)}"
        self.path = os.path.join(SHM_DIR, self.name)
        self.purpose = purpose
        self._fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(self._fd, size)
            if not lazily:
                self.reserve(0, size)
            self._map = mmap.mmap(self._fd, size)
        except BaseException:  # nothing of a segment that could not be made stays in /dev/shm
            self.unlink()
            raise
        if not lazily:
            self._close_fd()
        self.size = size
        self.bytes = np.frombuffer(self._map, np.uint8)

    def reserve(self, offset: int, nbytes: int) -> None:
        """Allocate [offset, offset + nbytes) before it is touched; SluiceError naming the size and the fix."""
        reserve(self._fd, offset, nbytes, self.purpose, SHM_DIR, Segment.reserved_here)
        Segment.reserved_here += nbytes

    def _close_fd(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def unlink(self) -> None:
        """Remove the name; the memory lives on while this process (and peers that mapped it) hold it."""
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        self._close_fd()
