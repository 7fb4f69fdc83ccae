"""Inside one host, on CPU: a local group's reduce-scatter and allgather by gloo against Sluice's own engine.

The hierarchy of issue 28 sums a gradient inside each host first, sends each worker's share across
hosts, and gathers the shares inside the host again. Which engine takes the two steps inside the host
is what this measures, with P workers of a Sluice job on this machine (`testbed.cluster.LocalCluster`,
CURVE on, shared memory on) and a float32 tensor of SIZE MiB:

  gloo     torch's ProcessGroupGloo as `worker/local_group.py` makes it (loopback TCP): reduce_scatter
           into each worker's share, then allgather of the shares (the hierarchy's two steps)
  sluice   the job's collective engine over shared memory (registered arrays): it has no
           reduce-scatter, so an allreduce of the whole tensor (each worker takes its share from it),
           then an allgather of the shares into a registered buffer (no new array)
  sluice-allreduce  the allreduce alone (what both steps together give back)

Each repetition times ROUNDS of each between two barriers (rank 0's clock), gloo and Sluice
alternating first; GB/s = the tensor's bytes / the time of one round of both steps. Ours is sluice,
the peer gloo.
"""

from __future__ import annotations

import argparse
import secrets
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/local_group.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from bench.common import add_common_options, print_table, progress, record, stats, write_json
from testbed.cluster import LocalCluster

MIB = 1 << 20
WAYS = ("gloo", "sluice", "sluice-allreduce")


def worker(count: int, rounds: int, repeats: int, tag: str) -> dict[str, list[float]]:
    """One worker's seconds per round of each way, per repetition (rank 0's are the ones kept)."""
    import torch

    from sluice.worker.local_group import LocalGroup
    from sluice.worker.node import WorkerNode
    from sluice.worker.topology import share_bounds

    node = WorkerNode()
    engine = node.collectives
    assert engine is not None
    rank, size = node.rank, node.size
    padded, _ = share_bounds(count, size)
    share_count = padded // size
    group = LocalGroup(tag, 0, 0, rank, size)
    flat = torch.zeros(padded)  # zeros while timing: sums of sums stay finite
    share = torch.empty(share_count)
    array = node.ps.alloc((padded,), "float32")
    gathered = node.ps.alloc((padded,), "float32")
    calls = iter(range(1 << 30))

    def gloo() -> None:
        group.reduce_scatter(flat, share).wait()
        group.allgather(share, flat).wait()

    def sluice(gather: bool = True) -> None:
        engine.allreduce(f"ar.{next(calls)}", [array], "float32", "sum").wait(120)
        if gather:
            mine = array[rank * share_count:(rank + 1) * share_count]
            engine.allgather(f"ag.{next(calls)}", mine, "float32", out=gathered).wait(120)  # no new array

    def allreduce_alone() -> None:
        sluice(gather=False)

    ways: dict[str, Callable[[], None]] = {"gloo": gloo, "sluice": sluice, "sluice-allreduce": allreduce_alone}
    for run in ways.values():  # warm-up: connections, shared memory, gloo's pairs
        run()
    seconds: dict[str, list[float]] = {way: [] for way in WAYS}
    for repeat in range(repeats):
        for way in (WAYS if repeat % 2 == 0 else WAYS[::-1]):
            node.barrier(f"{way}.{repeat}")
            started = time.perf_counter()
            for _ in range(rounds):
                ways[way]()
            node.barrier(f"{way}.{repeat}.end")
            seconds[way].append((time.perf_counter() - started) / rounds)
    flat.fill_(1.0)  # and once more with ones, checked: every way sums the workers' tensors
    array[:] = 1.0
    gloo()
    sluice()
    if not (torch.all(flat == size) and np.all(array == size) and np.all(gathered == size)):
        raise AssertionError(f"worker {rank}: a way's sums are wrong")
    group.close()
    node.close()
    return seconds


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4], metavar="P",
                        help="workers on this host, one run each (default: %(default)s)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 64], metavar="MIB",
                        help="tensor sizes in MiB (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per repetition (default: %(default)s)")
    add_common_options(parser, "2 workers, 4 MiB, 2 rounds, 1 repeat", repeats=5)
    args = parser.parse_args(argv)
    if args.quick:
        args.workers, args.sizes, args.rounds, args.repeats = [2], [4], 2, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows, records = [], []
    for workers in args.workers:
        for mib in args.sizes:
            count = mib * MIB // 4
            with LocalCluster(workers, 0, {"collective": {"mode": "allreduce"}}) as cluster:
                seconds = cluster.run(worker, count, args.rounds, args.repeats, secrets.token_hex(8), timeout=600)[0]
            gbps = {way: stats([mib * MIB / s / 1e9 for s in seconds[way]]) for way in WAYS}
            case = f"{workers}p-{mib}MiB"
            progress(f"  {case}: " + ", ".join(f"{way} {gbps[way].brief(3)} GB/s" for way in WAYS))
            rows.append([case, *(gbps[way].brief(3) for way in WAYS),
                         f"{gbps['sluice'].median / gbps['gloo'].median:.2f}x"])
            records.append(record(case, gbps["sluice"], gbps["gloo"], "gloo reduce_scatter + allgather (torch)",
                                  "GB/s", better="higher", workers=workers, mib=mib, rounds=args.rounds,
                                  repeats=args.repeats, sluice_allreduce=gbps["sluice-allreduce"].median))
    progress("\nGB/s = the tensor's bytes / one round of both steps inside the host, median [min..max] of "
             f"{args.repeats} repetitions of {args.rounds} rounds")
    print_table(["case", "gloo RS + AG", "sluice AR + AG", "sluice AR alone", "sluice/gloo"], rows)
    write_json(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
