"""Processes forked from this one that report what they return by key, every one reaped: `Children`."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from sluice import close_at_exit

_ctx = mp.get_context("fork")


def child_tempdir() -> str:
    """A directory for one forked child's temporary files, made by the parent before the fork: the parent
    removes it once the child is reaped, so that a child killed before its end leaves nothing either."""
    return tempfile.mkdtemp(prefix="sluice-child-")


def use_tempdir(path: str) -> None:
    """A forked child's temporary files go to `path` (from `child_tempdir`), which its parent removes: what it leaves
    would outlive it otherwise, as os._exit skips the atexit handlers that remove them (TensorFlow's autograph
    writes a file for each function it converts)."""
    tempfile.tempdir = path


def remove_tempdirs(paths: list[str]) -> None:
    """The directories of reaped children, with whatever a killed one left there."""
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)
    paths.clear()


def _child_main(key: str, target: Callable[..., Any], args: tuple[Any, ...], tempdir: str, results: Any) -> None:
    code = 0
    try:
        use_tempdir(tempdir)
        value = target(*args)
        close_at_exit()  # os._exit below skips what a script's exit runs for Sluice
        results.put((key, "ok", value))
    except BaseException as exc:  # report every failure to the parent, then exit non-zero
        results.put((key, "error", f"{type(exc).__name__}: {exc}"))
        code = 1
    results.close()
    results.join_thread()
    os._exit(code)


class Children:
    """Processes forked from this one that report `target(*args)` by key; all are reaped on exit."""

    def __init__(self) -> None:
        self._processes: dict[str, Any] = {}
        self._results: Any = _ctx.Queue()
        self._early: dict[str, Any] = {}
        self._tempdirs: list[str] = []

    def queue(self) -> Any:
        """A fresh queue a child can use to talk to the parent before it returns."""
        return _ctx.Queue()

    def barrier(self, parties: int) -> Any:
        """A barrier for `parties` children (their `wait(timeout)` raises if one of them is missing)."""
        return _ctx.Barrier(parties)

    def start(self, key: str, target: Callable[..., Any], *args: Any) -> None:
        self._tempdirs.append(child_tempdir())
        process = _ctx.Process(target=_child_main, args=(key, target, args, self._tempdirs[-1], self._results),
                               daemon=True)
        process.start()
        self._processes[key] = process

    def collect(self, keys: Sequence[str], timeout: float) -> dict[str, Any]:
        """The return values of the children named by `keys`; raises on a failure or after `timeout` s."""
        deadline = time.monotonic() + timeout
        out: dict[str, Any] = {k: self._early.pop(k) for k in keys if k in self._early}
        while len(out) < len(keys):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(keys) - set(out))
                raise TimeoutError(f"no result after {timeout:.0f} s from {', '.join(missing)}")
            try:
                key, status, value = self._results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [k for k, p in self._processes.items() if k not in out and p.exitcode not in (None, 0)]
                if dead:
                    codes = ", ".join(f"{k} (exit {self._processes[k].exitcode})" for k in dead)
                    raise RuntimeError(f"died without a result: {codes}") from None
                continue
            if status != "ok":
                raise RuntimeError(f"{key} failed: {value}")
            if key in keys:
                out[key] = value
            else:  # another child finished first: keep its result for whoever asks for it
                self._early[key] = value
        return out

    def close(self, grace: float = 2.0) -> None:
        """Give the children `grace` seconds in all to exit by themselves, then kill the rest."""
        deadline = time.monotonic() + grace
        for process in self._processes.values():
            process.join(max(deadline - time.monotonic(), 0.0))
        for process in self._processes.values():
            if process.is_alive():
                os.kill(process.pid, signal.SIGKILL)
            process.join(5.0)
        self._processes.clear()
        remove_tempdirs(self._tempdirs)

    def __enter__(self) -> Children:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
