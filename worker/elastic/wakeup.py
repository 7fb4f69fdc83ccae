"""A signal acted on as it comes, even while the main thread waits in native code (a TF graph, say).

Python runs a signal's handler in the main thread, between two bytecodes: while that thread waits in
native code (a tf.function's graph, whose Python ops run on TF's own threads, waiting on a peer that
is gone) the handler runs only once the wait ends by itself. `on_signal` therefore also takes
Python's wakeup fd (signal.set_wakeup_fd), into which the C-level handler writes each signal's number
at once, and a thread reads it and acts. Each signal is acted on once, by whichever of the two sees it
first. Where something else holds the wakeup fd already (an event loop in the main thread), it is
left alone and the handler acts alone.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable

log = logging.getLogger("sluice.worker")

_actions: dict[int, Callable[[], None]] = {}
#: (signal, "handler" or "reader") -> how many of that signal each of the two has seen
_seen: dict[tuple[int, str], int] = {}
_lock = threading.Lock()
#: set once this process tried to take the wakeup fd
_tried: list[bool] = []


def on_signal(signum: int, act: Callable[[], None]) -> None:
    """Run `act()` once for each `signum` that arrives, at once (call it from the main thread; again for
    the same signal replaces the action)."""
    _actions[signum] = act
    signal.signal(signum, _handler)
    _take_wakeup_fd()


def _first(signum: int, who: str) -> bool:
    """Count this signal for `who`; True where the other has not seen it yet (`who` acts on it)."""
    other = "reader" if who == "handler" else "handler"
    with _lock:
        seen = _seen[(signum, who)] = _seen.get((signum, who), 0) + 1
        return seen > _seen.get((signum, other), 0)


def _handler(signum: int, frame: object) -> None:
    act = _actions.get(signum)
    if act is not None and _first(signum, "handler"):
        act()


def _take_wakeup_fd() -> None:
    if _tried:
        return
    _tried.append(True)
    read, write = os.pipe()
    os.set_blocking(write, False)  # the C-level handler must never block
    try:
        previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    except ValueError:  # not the main thread: the handler alone
        previous = None
    if previous is not None and previous != -1:
        signal.set_wakeup_fd(previous)  # someone's: it stays theirs
    if previous is None or previous != -1:
        os.close(read)
        os.close(write)
        return
    threading.Thread(target=_read, args=(read,), name="sluice-signals", daemon=True).start()


def _read(fd: int) -> None:
    while True:
        try:
            data = os.read(fd, 256)
        except OSError:
            return
        if not data:
            return
        for signum in data:  # one byte per signal that has a Python handler: ours are acted on
            act = _actions.get(signum)
            if act is not None and _first(signum, "reader"):
                try:
                    act()
                except Exception:  # the reader serves every later signal too
                    log.exception("acting on signal %d", signum)
