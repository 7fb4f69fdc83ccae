"""A wake-up for a thread that waits in poll(): an eventfd any thread may ring, safe to ring once closed."""

from __future__ import annotations

import contextlib
import os
import threading


class Wakeup:
    """Poll `fileno()` for input; `ring()` from any thread ends the wait until `clear()`."""

    def __init__(self) -> None:
        self._fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._lock = threading.Lock()  # so that a ring never writes to a closed (and perhaps reused) number
        self._closed = False
        #: rung since the waiter last cleared: a burst of sends wakes it with one system call, not one each
        self._rung = False

    def fileno(self) -> int:
        return self._fd

    def ring(self) -> None:
        """Wake the waiter; a no-op once closed, so late callers (heartbeats, a failing job) cannot fail."""
        if self._rung:  # not cleared yet: the waiter will look at what changed before this call anyway
            return
        with self._lock:
            if not self._closed:
                self._rung = True
                os.eventfd_write(self._fd, 1)

    def clear(self) -> None:
        """Take the rings so far (the waiter, before it looks at what changed)."""
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self._fd)
        # after the read: a ring between the two skips its write, and its change is looked at after this
        # call; before it, a ring's write could be taken by this read and leave _rung set with nothing to read
        self._rung = False

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                os.close(self._fd)
