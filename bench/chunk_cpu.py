"""CPU microseconds per chunk of a push_pull on each hop (worker send, server receive, sum, reply), against raw ZeroMQ.

W workers push_pull a float32 tensor through S servers on this host with `transport.shm = false`, so every
chunk crosses a socket (a Unix socket: on one host nothing is encrypted; between hosts CURVE's cipher adds to
libzmq's column, bench/curve_cost.py), and the CPU each chunk costs is split by where it went:

  submit       the worker's push_pull cutting the tensor into chunk messages (Client._push)
  receive      reading, checking and decoding a message (Receiver._take), either side
  sum, reply   the server adding a chunk into its shard and making the replies (ShardStore.handle)
  send         encoding a message and handing it to ZeroMQ (Sender._send_message), either side
  into tensor  the worker copying a reply into its output (Client._on_reply)
  credit ACKs  acknowledging received bytes in ACKs of their own (Receiver.flush_acks)
  rest         the rest of the Python threads: the I/O loop's polls, wake-ups, pyzmq's garbage collector
  libzmq       ZeroMQ's own I/O threads: the socket calls

The hops are timed by each thread's own CPU clock (time.thread_time_ns) around those methods, wrapped in
the benchmark before the processes fork; counters live in shared memory, one row per process. The
threads' CPU comes from /proc/<pid>/task/*/stat. Worker 0 reads both just before and after its timed
rounds (between barriers), so set-up and warm-up are left out. Per chunk: over every chunk every worker
pushed in that window (W x tensor / chunk a round); the worker column sums the workers' CPU, the server
column the servers'.

peer  raw ZeroMQ rounds over Unix sockets (bench/raw_mesh.py: each chunk to its server, the server's
      answer once every worker's copy came; no sums, credit, checks or copies), the same W, S, tensor
      and chunk: its processes' CPU (os.wait4) over a long run less that of a one-round run, per chunk.
      Not a rival, a floor: what moving these chunks costs with nothing of Sluice in it.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from functools import wraps
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/chunk_cpu.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import raw_mesh
from bench.common import (
    add_common_options,
    print_table,
    progress,
    push_pull_round,
    record,
    stats,
    thread_cpu,
    write_json,
)
from testbed.job import RESULT_PREFIX
from testbed.launch import children

HOPS = ("submit", "receive", "sum, reply", "send", "into tensor", "credit ACKs")
#: rows of the shared counters: one per process of the job (scheduler, servers, workers)
ROWS = 64
MIB, KIB = 1 << 20, 1 << 10


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2, metavar="W", help="workers (default: %(default)s)")
    parser.add_argument("--servers", type=int, default=2, metavar="S", help="servers (default: %(default)s)")
    parser.add_argument("--size", type=int, default=64, metavar="MIB", help="tensor MiB (default: %(default)s)")
    parser.add_argument("--chunk-kib", type=int, default=512, metavar="KIB",
                        help="transport.chunk_bytes and the in-flight bound, in KiB (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=20, help="rounds per repetition (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                        help="give up on one job after this long (default: %(default)s)")
    add_common_options(parser, "8 MiB, 30 rounds, 1 repeat", repeats=3)
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.rounds, args.repeats = 8, 30, 1
    if (args.size * MIB) % (args.chunk_kib * KIB * args.servers):
        parser.error("the tensor must cut into chunks spread evenly over the servers")
    return args


# ---------------------------------------------------------------------------- counters in shared memory
class Counters:
    """Per process row: [pid, then CPU ns and calls of each hop]; made before the fork, so every process
    of the job shares them."""

    WIDTH = 1 + 2 * len(HOPS)

    def __init__(self) -> None:
        self.cells = mp.RawArray(ctypes.c_int64, ROWS * self.WIDTH)
        self._lock = mp.Lock()
        self._row: tuple[int, int] | None = None  # (pid, row) of this process

    def row(self) -> int:
        pid = os.getpid()
        if self._row is None or self._row[0] != pid:
            with self._lock:
                free = next(r for r in range(ROWS) if self.cells[r * self.WIDTH] == 0)
                self.cells[free * self.WIDTH] = pid
            self._row = (pid, free)
        return self._row[1]

    def add(self, hop: int, nanoseconds: int) -> None:
        base = self.row() * self.WIDTH + 1 + 2 * hop
        self.cells[base] += nanoseconds
        self.cells[base + 1] += 1

    def read(self) -> dict[int, list[int]]:
        """pid -> [CPU ns of each hop]."""
        out = {}
        for r in range(ROWS):
            pid = self.cells[r * self.WIDTH]
            if pid:
                out[pid] = [self.cells[r * self.WIDTH + 1 + 2 * h] for h in range(len(HOPS))]
        return out


def instrument(counters: Counters) -> None:
    """Wrap each hop's method so that its thread's CPU time is added to this process's row."""
    from sluice.ps.store import ShardStore
    from sluice.transport.zmq_receive import Receiver
    from sluice.transport.zmq_send import Sender
    from sluice.worker.client import Client

    def timed(owner: type, name: str, hop: int) -> None:
        method = getattr(owner, name)

        @wraps(method)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.thread_time_ns()
            try:
                return method(*args, **kwargs)
            finally:
                counters.add(hop, time.thread_time_ns() - started)

        setattr(owner, name, wrapper)

    for hop, (owner, name) in enumerate(((Client, "_push"), (Receiver, "_take"), (ShardStore, "handle"),
                                         (Sender, "_send_message"), (Client, "_on_reply"), (Receiver, "flush_acks"))):
        timed(owner, name, hop)


# ---------------------------------------------------------------------------- the Sluice job
def _sluice_worker(counters: Counters, parent: int, nbytes: int, rounds: int, repeats: int) -> list[dict[str, Any]]:
    node, one_round = push_pull_round(nbytes)
    first = node.ps.rank == 0
    windows = []
    for rep in range(repeats):
        node.barrier(f"start.{rep}")
        pids = children(parent) if first else []
        cpu, hops, started = thread_cpu(pids), counters.read(), time.perf_counter()
        for _ in range(rounds):
            one_round()
        node.barrier(f"end.{rep}")
        if first:
            windows.append({"seconds": time.perf_counter() - started, "cpu_before": cpu, "cpu_after": thread_cpu(pids),
                            "hops_before": hops, "hops_after": counters.read()})
    node.close()
    return windows


def per_chunk(window: dict[str, Any], chunks: int) -> dict[str, dict[str, float]]:
    """{worker, server} -> {hop, rest, libzmq, total}: CPU us per chunk in one timed window."""
    before, after = window["hops_before"], window["hops_after"]
    sides: dict[str, dict[str, float]] = {}
    for pid, (python, libzmq) in window["cpu_after"].items():
        was = window["cpu_before"].get(pid)
        if was is None:
            continue
        hops = [(a - b) / 1e3 / chunks for a, b in zip(after.get(pid, [0] * len(HOPS)),
                                                        before.get(pid, [0] * len(HOPS)), strict=True)]
        side = "worker" if hops[0] > 0 else "server" if hops[2] > 0 else None
        if side is None:  # the scheduler
            continue
        row = sides.setdefault(side, dict.fromkeys([*HOPS, "rest", "libzmq", "total"], 0.0))
        python_us, libzmq_us = (python - was[0]) * 1e6 / chunks, (libzmq - was[1]) * 1e6 / chunks
        for hop, value in zip(HOPS, hops, strict=True):
            row[hop] += value
        row["rest"] += python_us - sum(hops)
        row["libzmq"] += libzmq_us
        row["total"] += python_us + libzmq_us
    return sides


def measure_sluice(args: argparse.Namespace) -> tuple[list[dict[str, dict[str, float]]], list[float]]:
    from testbed.cluster import LocalCluster

    counters = Counters()
    instrument(counters)  # before the fork: every process of the job inherits the wrapped methods
    nbytes, chunk = args.size * MIB, args.chunk_kib * KIB
    config = {"transport": {"shm": False, "chunk_bytes": chunk, "inflight_bytes": chunk}}
    with LocalCluster(args.workers, args.servers, config) as cluster:
        results = cluster.run(_sluice_worker, counters, os.getpid(), nbytes, args.rounds, args.repeats,
                              timeout=args.timeout)
        cluster.wait()
    chunks = args.rounds * args.workers * (nbytes // chunk)
    windows = results[0]
    return [per_chunk(w, chunks) for w in windows], [w["seconds"] / args.rounds for w in windows]


# ---------------------------------------------------------------------------- raw ZeroMQ rounds
def measure_raw(args: argparse.Namespace) -> list[float]:
    """CPU us per chunk pushed in raw ZeroMQ rounds: each repetition a job of its own, whose worker 0 reads its
    processes' CPU through its timed rounds (bench/raw_mesh.py, CPU_OF)."""
    nbytes, chunk = args.size * MIB, args.chunk_kib * KIB
    chunks, world = args.rounds * args.workers * (nbytes // chunk), args.workers + args.servers
    argv = [sys.executable, "-m", "bench.raw_mesh", "", str(args.workers), str(nbytes), str(chunk), str(args.rounds),
            "1"]
    root, per_chunk_us = Path(__file__).resolve().parent.parent, []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="sluice-raw-") as folder:
            argv[3] = ",".join(f"ipc://{folder}/server-{rank}" for rank in range(args.servers))
            env = {**os.environ, raw_mesh.CPU_OF: str(os.getpid()), "WORLD_SIZE": str(world)}
            processes = [subprocess.Popen(argv, cwd=root, env={**env, "RANK": str(rank)}, text=True,
                                          stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL)
                         for rank in [*range(args.workers, world), *range(args.workers)]]  # servers bind first
            try:
                out, _ = processes[-args.workers].communicate(timeout=args.timeout)  # worker 0's report
                codes = [p.wait(timeout=args.timeout) for p in processes]
            finally:
                for process in processes:
                    process.kill()
                    process.wait()
        reports = [json.loads(line[len(RESULT_PREFIX):]) for line in out.splitlines() if line.startswith(RESULT_PREFIX)]
        if any(codes) or not reports:
            raise RuntimeError(f"raw ZeroMQ rounds failed (exit codes {codes})")
        per_chunk_us.append(reports[0]["cpu_seconds"] * 1e6 / chunks)
    return per_chunk_us


# ---------------------------------------------------------------------------- report
def _median_table(windows: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    return {side: {key: stats([w[side][key] for w in windows]).median for key in windows[0][side]}
            for side in ("worker", "server")}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    progress(f"chunk_cpu: {args.workers} workers x {args.servers} servers on this host, {args.size} MiB in "
             f"{args.chunk_kib} KiB chunks, transport.shm = false, {args.repeats} x {args.rounds} rounds")
    raw = stats(measure_raw(args))
    progress(f"  raw ZeroMQ rounds: {raw.brief(1)} CPU us per chunk")
    windows, seconds = measure_sluice(args)
    table = _median_table(windows)
    total = stats([w["worker"]["total"] + w["server"]["total"] for w in windows])
    progress(f"  Sluice: {total.brief(1)} CPU us per chunk, {stats(seconds).median * 1e3:.1f} ms a round")
    case = f"{args.size}MiB-w{args.workers}-s{args.servers}-{args.chunk_kib}KiB"
    records = [record(case, total, raw, "raw ZeroMQ rounds (bench/raw_mesh.py)", "CPU us per chunk", "lower",
                      ms_per_round=stats(seconds).median * 1e3, worker_us=table["worker"], server_us=table["server"],
                      chunk_kib=args.chunk_kib, workers=args.workers, servers=args.servers)]
    print(f"\nCPU us per {args.chunk_kib} KiB chunk pushed, medians of {args.repeats} windows of {args.rounds} rounds "
          f"(worker: the workers' CPU for it; server: the servers')")
    print_table(["", "worker", "server", "both"],
                [[row, f"{table['worker'][row]:.1f}", f"{table['server'][row]:.1f}",
                  f"{table['worker'][row] + table['server'][row]:.1f}"] for row in [*HOPS, "rest", "libzmq", "total"]])
    print(f"{case}: Sluice {total.median:.1f} CPU us per chunk, raw ZeroMQ rounds {raw.median:.1f} "
          f"({total.median / raw.median:.2f}x)")
    write_json(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
