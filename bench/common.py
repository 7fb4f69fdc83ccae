"""Shared benchmark helpers: options, medians, tables, JSON records and forked child processes."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import signal
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sluice import close_at_exit
from sluice.launch.supervisor import free_port as free_port

ROOT = Path(__file__).resolve().parent.parent

_ctx = mp.get_context("fork")

#: Objects a child keeps until os._exit ends it without running their destructors (see keep_alive).
_kept: list[Any] = []


# ---------------------------------------------------------------------------- options and output
def add_common_options(parser: argparse.ArgumentParser, quick: str, repeats: int = 5) -> None:
    """The options every benchmark has: --quick (which sets what `quick` says), --repeats and --json."""
    parser.add_argument("--quick", action="store_true",
                        help=f"a smoke setting that finishes in seconds, run by the test suite: {quick}")
    parser.add_argument("--repeats", type=int, default=repeats, metavar="N",
                        help="timed repetitions of every measurement; the table quotes their median "
                             "and also shows min and max (default: %(default)s)")
    parser.add_argument("--json", metavar="PATH",
                        help="also write the results to PATH as a JSON list of records "
                             '{"case", "ours", "peer", "peer_name", "ratio", "unit", ...}')


def progress(message: str) -> None:
    print(message, flush=True)


@dataclass(frozen=True)
class Stats:
    median: float
    low: float
    high: float

    def brief(self, digits: int = 3) -> str:
        return f"{self.median:.{digits}f} [{self.low:.{digits}f}..{self.high:.{digits}f}]"


def stats(values: Sequence[float]) -> Stats:
    if not values:
        raise ValueError("no measurements")
    return Stats(statistics.median(values), min(values), max(values))


def print_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    print("\n".join(lines), flush=True)


def better_of(unit: str) -> str:
    """'higher' for rates (a unit per second: GB/s, samples/s), 'lower' for times and everything else."""
    return "higher" if "/s" in unit or unit.endswith("per s") else "lower"


def record(case: str, ours: Stats, peer: Stats, peer_name: str, unit: str, better: str | None = None,
           **extra: Any) -> dict[str, Any]:
    """One JSON record: medians for ours and the peer, their ratio, min/max and any extra fields, and
    `speedup`: how many times better ours is than the peer (> 1: ours ahead), by `better` ("higher" or
    "lower"; by default from the unit). An `extra` speedup (e.g. a median of paired ratios) wins."""
    better = better or better_of(unit)
    if better not in ("higher", "lower"):
        raise ValueError(f"better must be 'higher' or 'lower', got {better!r}")
    ratio = ours.median / peer.median
    return {
        "case": case, "ours": ours.median, "peer": peer.median, "peer_name": peer_name,
        "ratio": ratio, "unit": unit, "better": better, "speedup": ratio if better == "higher" else 1 / ratio,
        "ours_min": ours.low, "ours_max": ours.high, "peer_min": peer.low, "peer_max": peer.high,
        **extra,
    }


def write_json(path: str | None, records: list[dict[str, Any]]) -> None:
    if path is None:
        return
    Path(path).write_text(json.dumps(records, indent=2) + "\n")
    progress(f"wrote {len(records)} records to {path}")


# ---------------------------------------------------------------------------- processes
def keep_alive(*objects: Any) -> None:
    """Never free `objects` in this child: it ends with os._exit, which skips their destructors.

    torch 2.13's gloo ProcessGroup destructor joins its work thread while holding the GIL, and that
    thread may need the GIL to drop its last finished work (seen as a hang after a DDP run: the
    Reducer's release destroyed the group). So gloo children neither destroy their process group nor
    let a DDP model or tensor that references it be freed.
    """
    _kept.extend(objects)


def _child_main(key: str, target: Callable[..., Any], args: tuple[Any, ...], results: Any) -> None:
    code = 0
    try:
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

    def queue(self) -> Any:
        """A fresh queue a child can use to talk to the parent before it returns."""
        return _ctx.Queue()

    def barrier(self, parties: int) -> Any:
        """A barrier for `parties` children (their `wait(timeout)` raises if one of them is missing)."""
        return _ctx.Barrier(parties)

    def start(self, key: str, target: Callable[..., Any], *args: Any) -> None:
        process = _ctx.Process(target=_child_main, args=(key, target, args, self._results), daemon=True)
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

    def __enter__(self) -> Children:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def timed_push_pull(nbytes: int, rounds: int, repeats: int, registered: bool = True) -> tuple[int, list[float]]:
    """In a Sluice worker: check one push_pull of `nbytes` of float32 sums right, then time `rounds`
    rounds per repetition between two barriers; (this worker's rank, seconds per round of each)."""
    import numpy as np

    from sluice.worker.client import Client

    client = Client()
    n = nbytes // 4
    data = client.alloc((n,), "float32") if registered else np.empty(n, np.float32)
    data[:] = 1.0
    out = np.empty(n, np.float32)
    client.declare([("bench", (n,), "float32", None)])
    client.push_pull("bench", data, out).wait()
    if not np.all(out == client.size):
        raise AssertionError(f"push_pull returned a wrong sum (expected {client.size} everywhere)")
    seconds = []
    for rep in range(repeats):
        client.barrier(f"start.{rep}")
        started = time.perf_counter()
        for _ in range(rounds):
            client.push_pull("bench", data, out).wait()
        client.barrier(f"end.{rep}")
        seconds.append((time.perf_counter() - started) / rounds)
    client.close()
    return client.rank, seconds
