"""Sluice allreduce (ring and tree, over its own transport) against torch.distributed gloo all_reduce."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/allreduce.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from bench.common import (
    Stats,
    add_common_options,
    print_table,
    progress,
    record,
    write_json,
)
from bench.push_pull import bandwidth, measure_gloo
from sluice.transport.base import Transport
from sluice.transport.config import TransportConfig
from sluice.worker.collective.data import DataPlane
from testbed.ranks import Ranks

MIB = 1 << 20
GLOO = "gloo all_reduce"

DESCRIPTION = """\
Algorithm bandwidth (bytes of the tensor / time of one allreduce) of a float32 sum over P processes
on this host:

  ring    Sluice DataPlane ring allreduce (reduce-scatter then allgather, 1 MiB chunks, pipelined)
  tree    Sluice DataPlane tree allreduce (binary tree over the ranks, up then down, pipelined)
  gloo    torch.distributed all_reduce, gloo backend, TCP store on 127.0.0.1

Sluice runs with realistic settings: CURVE on (keys from a fresh job secret), shared memory on (the
default), the array in registered memory (Transport.alloc) unless the case ends in "-plain" (an
ordinary numpy array: the transport copies each chunk it sends into its ring) or "-staged" (an
ordinary array copied into registered scratch memory, reduced there, copied back). Every process does one
checked warm-up allreduce, then each repetition times ROUNDS allreduces between two barriers (rank
0's clock). speedup > 1 means Sluice is ahead.
"""


# ---------------------------------------------------------------------------- Sluice measurement
def _sluice_rank(plane: DataPlane, transport: Transport, rank: int, size: int, nbytes: int, algorithm: str,
                 memory: str, rounds: int, repeats: int, barrier: Any) -> list[float]:
    """memory: "registered" (Transport.alloc), "plain" (np.empty), or "staged" (a plain array copied
    into a registered scratch buffer, reduced there and copied back, every time)."""
    count = nbytes // 4
    data = transport.alloc(count, np.dtype(np.float32)) if memory == "registered" else np.empty(count, np.float32)
    scratch = transport.alloc(count, np.dtype(np.float32)) if memory == "staged" else data
    seq = 0

    def allreduce() -> None:
        if scratch is not data:
            np.copyto(scratch, data)
        plane.allreduce(seq, scratch, "float32", "sum", 0, algorithm).wait()
        if scratch is not data:
            np.copyto(data, scratch)

    data[:] = rank + 1
    allreduce()
    if not np.all(data == size * (size + 1) // 2):
        raise AssertionError(f"{algorithm} allreduce returned a wrong sum")
    data[:] = 0.0  # sums of zeros stay finite however many rounds run
    times = []
    for _ in range(repeats):
        barrier.wait(60)
        started = time.perf_counter()
        for _ in range(rounds):
            seq += 1
            allreduce()
        barrier.wait(60)
        times.append((time.perf_counter() - started) / rounds)
    return times


def measure_sluice(nbytes: int, size: int, algorithm: str, memory: str, rounds: int, repeats: int,
                   timeout: float) -> list[float]:
    config = TransportConfig(chunk_bytes=MIB, inflight_bytes=16 * MIB)
    with Ranks(size, config, curve=True, timeout=timeout) as ranks:
        barrier = ranks.barrier()
        results = ranks.run(_sluice_rank, nbytes, algorithm, memory, rounds, repeats, barrier, limit=timeout)
    times: list[float] = results[0]
    return times


# ---------------------------------------------------------------------------- driver
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 64, 256], metavar="MIB",
                        help="tensor sizes in MiB of float32 (default: %(default)s)")
    parser.add_argument("--procs", type=int, nargs="+", default=[2, 4], metavar="P",
                        help="process counts; every size runs with every count (default: %(default)s)")
    parser.add_argument("--algorithms", nargs="+", choices=["ring", "tree"], default=["ring", "tree"],
                        help="Sluice algorithms to measure (default: %(default)s)")
    parser.add_argument("--plain-sizes", type=int, nargs="*", default=[64], metavar="MIB",
                        help="sizes that also get ring cases from an ordinary numpy array, sent as it is "
                             "(-plain) and staged through registered memory (-staged) (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=0, metavar="R",
                        help="allreduces timed per repetition; 0 picks max(2, 256 MiB / size) (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                        help="give up on one measurement after this long (default: %(default)s)")
    add_common_options(parser, quick="2 processes, 1 and 4 MiB, ring and tree, 2 repeats", repeats=5)
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.procs, args.plain_sizes, args.repeats, args.rounds = [1, 4], [2], [4], 2, 8
    if min(args.sizes) < 1 or min(args.procs) < 2 or args.repeats < 1 or args.rounds < 0:
        parser.error("sizes and repeats must be positive, procs at least 2, rounds not negative")
    return args


def cases(args: argparse.Namespace) -> list[tuple[str, str, int, int, str]]:
    """(case, algorithm, processes, MiB, memory) in the order they run."""
    out = []
    for procs in args.procs:
        for size in args.sizes:
            out += [(f"{a}-{procs}p-{size}MiB", a, procs, size, "registered") for a in args.algorithms]
            if size in args.plain_sizes:
                out += [(f"ring-{procs}p-{size}MiB-{m}", "ring", procs, size, m) for m in ("plain", "staged")]
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    todo = cases(args)
    progress(f"allreduce bandwidth: {len(todo)} cases, {args.repeats} repeats each, GB/s = 1e9 bytes/s, "
             f"pid {os.getpid()}")
    rows, records = [], []
    gloo: dict[tuple[int, int], Stats] = {}
    started = time.perf_counter()
    for case, algorithm, procs, size, memory in todo:
        nbytes = size * MIB
        rounds = args.rounds or max(2, 256 // size)
        t0 = time.perf_counter()
        ours = bandwidth(nbytes, measure_sluice(nbytes, procs, algorithm, memory, rounds, args.repeats,
                                                args.timeout))
        progress(f"  {case:<22} sluice {ours.brief()} GB/s  ({time.perf_counter() - t0:.1f} s)")
        if (procs, size) not in gloo:
            t0 = time.perf_counter()
            gloo[(procs, size)] = bandwidth(nbytes, measure_gloo(nbytes, procs, rounds, args.repeats, args.timeout))
            progress(f"  {f'{procs}p-{size}MiB':<22} gloo   {gloo[(procs, size)].brief()} GB/s  "
                     f"({time.perf_counter() - t0:.1f} s)")
        peer = gloo[(procs, size)]
        ratio = ours.median / peer.median
        rows.append([case, str(rounds), ours.brief(), peer.brief(), f"{ratio:.2f}x"])
        records.append(record(case, ours, peer, GLOO, "GB/s", better="higher", speedup=ratio, algorithm=algorithm,
                              processes=procs, size_mib=size, memory=memory, rounds=rounds,
                              repeats=args.repeats, curve=True, shm=True, chunk_bytes=MIB))
    progress(f"\nalgorithm bandwidth in GB/s, median [min..max] of {args.repeats} repeats "
             f"({time.perf_counter() - started:.0f} s in all)")
    print_table(["case", "rounds", "sluice", "gloo", "sluice/gloo"], rows)
    write_json(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
