"""Copies a role's output to the session without ever making the role wait: a bounded buffer between two threads.

A remote stub whose role must outlive the launcher (a job with a standby scheduler, launch/remote.py)
cannot hand the role the session's own descriptors: when the launcher's host is lost without a
word, the session's sshd keeps the channel open and stops reading, the pipe fills, and the role
blocks in its next print. So the stub reads the role's output itself into a buffer of at most
`limit` bytes, and a second thread writes it to the session at whatever pace the session takes; what
does not fit is dropped (and counted), as is everything once the session is gone.
"""

from __future__ import annotations

import os
import threading
from collections import deque

LIMIT_BYTES = 8 << 20
_READ_BYTES = 1 << 16


class Relay:
    """Output from `source` (a pipe's read end, closed at its end) to `target` (not closed), in order."""

    def __init__(self, source: int, target: int, limit: int = LIMIT_BYTES) -> None:
        self.source, self.target, self.limit = source, target, limit
        self.dropped = 0
        self._buffer: deque[bytes] = deque()
        self._held = 0
        self._ended = False
        self._broken = False
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, name="sluice-relay-read", daemon=True)
        self._writer = threading.Thread(target=self._write, name="sluice-relay-write", daemon=True)
        self._reader.start()
        self._writer.start()

    def join(self, timeout: float) -> None:
        """Wait until the role's output ended and, for up to `timeout` seconds, until it was written."""
        self._reader.join()
        self._writer.join(timeout)

    def _read(self) -> None:
        try:
            while data := os.read(self.source, _READ_BYTES):
                with self._cond:
                    if self._broken or self._held + len(data) > self.limit:
                        self.dropped += len(data)
                        continue
                    self._buffer.append(data)
                    self._held += len(data)
                    self._cond.notify()
        except OSError:
            pass
        finally:
            os.close(self.source)
            with self._cond:
                self._ended = True
                self._cond.notify()

    def _write(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._buffer) or self._ended)
                if not self._buffer:
                    return
                data = self._buffer.popleft()
                self._held -= len(data)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(self.target, view):]
            except OSError:  # the session is gone: what comes now has nowhere to go
                with self._cond:
                    self._broken = True
                    self.dropped += sum(map(len, self._buffer))
                    self._buffer.clear()
                    self._held = 0


def relayed_pipe(target: int) -> tuple[int, Relay]:
    """A pipe's write end for the role (the caller closes it once the role has it), and the relay from its
    read end to `target`."""
    read_end, write_end = os.pipe()
    return write_end, Relay(read_end, target)
