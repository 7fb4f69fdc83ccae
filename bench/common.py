"""Shared benchmark helpers: options, medians, tables, JSON records, keep_alive, a timed push_pull, CPU use."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sluice.launch.master_port import free_port as free_port
from testbed.netbed import Netbed, root_congestion_control

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
#: what `sluice launch --preload` imports once for a torch job's workers (the script's torch, its first optimizer's
#: torch._dynamo, Sluice's shim): a worker forked from that process skips 3 CPU-s of imports (launch_start.py)
TORCH_PRELOAD = "torch,torch._dynamo,sluice.torch"

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


def add_cc_option(parser: argparse.ArgumentParser) -> None:
    """--cc: the TCP congestion control of a testbed's hosts (Netbed.congestion_control)."""
    parser.add_argument("--cc", default="", metavar="NAME",
                        help="TCP congestion control in the testbed's hosts, one the kernel lets a namespace choose "
                             "(net.ipv4.tcp_allowed_congestion_control); default: the root namespace's, which "
                             "every namespace starts with (on Linux cubic unless set otherwise; here "
                             f"{root_congestion_control()})")


def add_transport_cc_option(parser: argparse.ArgumentParser) -> None:
    """--transport-cc: Sluice's own TCP congestion control (transport.congestion_control), put in its jobs' config."""
    parser.add_argument("--transport-cc", default="", metavar="NAME",
                        help="transport.congestion_control of Sluice's jobs: the TCP congestion control its processes "
                             "set on each of their connections, while the peer's keep the hosts' (--cc); default: "
                             "none set, the hosts'")


def apply_cc_option(bed: Netbed, cc: str, program: str) -> str | None:
    """--cc applied to every host of `bed`: the congestion control in force, announced; None, the reason printed,
    where the kernel will not let a namespace choose it (the program then exits 2)."""
    try:
        in_force = bed.congestion_control(cc)
    except ValueError as exc:
        print(f"{program}: --cc {cc}: {exc}", file=sys.stderr)
        return None
    progress(f"TCP congestion control in the hosts: {in_force}")
    return in_force


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
class CoreUse:
    """How busy this machine's cores were, all together, from its creation to `busy()` (/proc/stat):
    the evidence that a run is bound by the cores (both full) rather than by its links."""

    def __init__(self) -> None:
        self._start = _cpu_ticks()

    def busy(self) -> float:
        """The share of all cores' time spent busy since creation, 0..1."""
        (busy0, total0), (busy1, total1) = self._start, _cpu_ticks()
        return (busy1 - busy0) / max(1, total1 - total0)


def _cpu_ticks() -> tuple[int, int]:
    """(busy, all) clock ticks of all cores since boot; idle and iowait are the idle ones."""
    ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)


def thread_cpu(pids: Iterable[int]) -> dict[int, tuple[float, float]]:
    """pid -> CPU seconds of (its Python threads, ZeroMQ's I/O threads), from /proc/<pid>/task/*/stat; threads
    that ended are not counted."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in pids:
        python = libzmq = 0.0
        for task in Path(f"/proc/{pid}/task").glob("*/stat"):
            try:
                raw = task.read_bytes().decode("utf-8", "replace")
            except OSError:
                continue
            fields = raw.rsplit(")", 1)[1].split()
            seconds = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
            if raw[raw.index("(") + 1:].startswith("ZMQbg"):
                libzmq += seconds
            else:
                python += seconds
        out[pid] = (python, libzmq)
    return out


def keep_alive(*objects: Any) -> None:
    """Never free `objects` in this child: it ends with os._exit, which skips their destructors.

    torch 2.13's gloo ProcessGroup destructor joins its work thread while holding the GIL, and that
    thread may need the GIL to drop its last finished work (seen as a hang after a DDP run: the
    Reducer's release destroyed the group). So gloo children neither destroy their process group nor
    let a DDP model or tensor that references it be freed.
    """
    _kept.extend(objects)


def push_pull_round(nbytes: int, registered: bool = True) -> tuple[Any, Callable[[], None]]:
    """In a Sluice worker: its WorkerNode and one push_pull round of a tensor of `nbytes` of float32 (from
    registered memory, or an ordinary array), whose sum was checked once."""
    import numpy as np

    from sluice.worker.node import WorkerNode

    node = WorkerNode()
    client = node.ps
    n = nbytes // 4
    data = client.alloc((n,), "float32") if registered else np.empty(n, np.float32)
    data[:] = 1.0
    out = np.empty(n, np.float32)
    client.declare([("bench", (n,), "float32", None)])
    client.push_pull("bench", data, out).wait()
    if not np.all(out == client.size):
        raise AssertionError(f"push_pull returned a wrong sum (expected {client.size} everywhere)")
    return node, lambda: client.push_pull("bench", data, out).wait()


def timed_push_pull(nbytes: int, rounds: int, repeats: int, registered: bool = True) -> tuple[int, list[float]]:
    """In a Sluice worker: check one push_pull of `nbytes` of float32 sums right, then time `rounds`
    rounds per repetition between two barriers; (this worker's rank, seconds per round of each)."""
    node, one_round = push_pull_round(nbytes, registered)
    seconds = []
    for rep in range(repeats):
        node.barrier(f"start.{rep}")
        started = time.perf_counter()
        for _ in range(rounds):
            one_round()
        node.barrier(f"end.{rep}")
        seconds.append((time.perf_counter() - started) / rounds)
    node.close()
    return node.ps.rank, seconds


def import_example(name: str) -> Any:
    """examples/NAME.py as a module, imported as the examples import each other: from their own directory
    (they are scripts, not a package)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.append(str(EXAMPLES))
    return importlib.import_module(name)
