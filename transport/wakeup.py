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

    def fileno(self) -> int:
        return self._fd

    def ring(self) -> None:
        """Wake the waiter; a no-op once closed, so late callers (heartbeats, a failing job) cannot fail."""
        with self._lock:
            if not self._closed:
                os.eventfd_write(self._fd, 1)

    def clear(self) -> None:
        """Take the rings so far (the waiter, before it looks at what changed)."""
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self._fd)

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                os.close(self._fd)
