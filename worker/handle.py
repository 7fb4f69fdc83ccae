"""Completion of one parameter-server operation on every chunk of one tensor, with a deadline."""

from __future__ import annotations

import threading
from collections.abc import Callable

from sluice.errors import SluiceError


class Handle:
    """Completion of one operation on every chunk of one tensor; `wait` has a deadline."""

    def __init__(self, what: str, servers: dict[int, str], timeout: float) -> None:
        self.what = what
        self._servers = servers  # chunk -> the server that owns it (or the aggregator on the way), for error messages
        self._owners = dict(servers)
        self._remaining = set(servers)
        self._timeout = timeout
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._error: str | None = None
        self._callbacks: list[Callable[[Handle], None]] = []
        if not self._remaining:
            self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> None:
        limit = self._timeout if timeout is None else timeout
        if not self._event.wait(limit):
            with self._lock:
                missing = sorted(self._remaining)
            owners = sorted({self._servers[c] for c in missing})
            raise SluiceError(
                f"{self.what}: no reply after {limit:.0f} s for chunks {missing[:8]} from {', '.join(owners)}"
            )
        if self._error is not None:
            raise SluiceError(f"{self.what} failed: {self._error}")

    def via(self, chunk: int, aggregator: str | None) -> None:
        """Chunk `chunk` went up an aggregation tree through `aggregator` (None: straight to its server, a push
        moved off a tree inside its round): name it if it never answers."""
        self._servers[chunk] = f"{aggregator} (for {self._owners[chunk]})" if aggregator else self._owners[chunk]

    def add_done_callback(self, fn: Callable[[Handle], None]) -> None:
        """Call fn(self) once the operation completes or fails (at once if it has), on the thread that
        completes it (the client's I/O thread: fn must be quick and must not raise)."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    @property
    def error(self) -> str | None:
        return self._error

    def _part_done(self, chunk: int) -> None:
        with self._lock:
            self._remaining.discard(chunk)
            if self._remaining or self._event.is_set():
                return
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)

    def _fail(self, error: str) -> None:
        with self._lock:
            if self._event.is_set():
                return
            self._error = error
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)
