"""Latency of one small allreduce (the demo model's gradients) through Sluice's collective engine against gloo,
and where Sluice's time goes: the negotiation (submit to decision) and the data (decision to done).

Each of P processes runs `--iters` allreduces of `--floats` float32, with `--work` ms of compute (a matmul
loop) before each, as a training step has; the first fifth are a warm-up. Sluice: the engine a worker's
DistributedOptimizer uses (worker.collective.engine.CollectiveEngine.allreduce, the arrays in registered
memory), in a LocalCluster without servers. Gloo: torch.distributed.all_reduce, one thread per process, as
DDP's. `last submit -> last done` is, per allreduce, from the moment the last rank submitted it to the moment
the last rank had its result: the critical path a synchronous step waits for.

    .venv/bin/python bench/allreduce_latency.py --json bench/results/allreduce_latency.json
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
import torch.distributed as dist

from bench.common import add_common_options, free_port, print_table, progress, record, stats, write_json
from sluice.launch.config import ConfigError, load_config
from testbed.children import Children
from testbed.cluster import LocalCluster

#: the demo model's parameters (examples/train_digits.py): what its one fused group holds
DEMO_FLOATS = 38282
#: rows of (processes, compute ms before each allreduce)
CASES = ((2, 0.0), (4, 0.0), (4, 3.0))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--floats", type=int, default=DEMO_FLOATS, help="float32 elements per allreduce "
                        "(default: %(default)s, the demo model's parameters)")
    parser.add_argument("--iters", type=int, default=400, help="allreduces per process and repetition "
                        "(default: %(default)s; the first fifth are a warm-up)")
    parser.add_argument("--timeout", type=float, default=180.0,
                        help="one job's limit in seconds (default: %(default)s)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", dest="settings",
                        help="a Sluice setting, as `sluice launch --set` takes it, e.g. collective.carry_bytes=0 "
                             "(repeatable)")
    add_common_options(parser, "2 processes, no compute between, 60 allreduces, one repetition", repeats=3)
    args = parser.parse_args(argv)
    try:
        args.config = load_config(None, {}, args.settings).to_sections()
    except ConfigError as exc:
        parser.error(str(exc))
    args.cases = CASES
    if args.quick:
        args.cases, args.iters, args.repeats = ((2, 0.0),), 60, 1
    if min(args.floats, args.iters, args.repeats) < 1:
        parser.error("--floats, --iters and --repeats must be positive")
    return args


def compute(ms: float) -> None:
    """About `ms` of one core's work, as a training step's forward and backward would take."""
    started, a = time.perf_counter(), torch.ones(64, 64)
    while time.perf_counter() - started < ms / 1e3:
        a = a @ a * 0.001


def _sluice_rank(floats: int, iters: int, work: float) -> list[tuple[float, float, float]]:
    """In a worker: (submitted, decided, done) of each allreduce, monotonic seconds."""
    import sluice.torch as hvd
    from sluice.worker.torch.state import require

    torch.set_num_threads(1)
    hvd.init()
    engine = require().collectives
    assert engine is not None
    array = require().ps.alloc((floats,), "float32")
    array[:] = 1.0
    times = []
    for _ in range(iters):
        compute(work)
        submitted = time.monotonic()
        handle = engine.allreduce("latency", [array], "float32", "sum")
        handle.wait()
        times.append((submitted, handle.started or float("nan"), time.monotonic()))
    hvd.barrier()
    hvd.shutdown()
    return times


def _gloo_rank(rank: int, size: int, port: int, floats: int, iters: int, work: float) -> list[tuple[float, float]]:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=60))
    tensor, times = torch.ones(floats), []
    for _ in range(iters):
        compute(work)
        submitted = time.monotonic()
        dist.all_reduce(tensor)
        times.append((submitted, time.monotonic()))
    dist.barrier()
    return times


def critical_path(submitted: np.ndarray, done: np.ndarray) -> float:
    """Median over allreduces (columns) of the last rank's done minus the last rank's submit, in ms."""
    return float(np.median(done.max(axis=0) - submitted.max(axis=0)) * 1e3)


def measure_sluice(args: argparse.Namespace, size: int, work: float) -> dict[str, float]:
    with LocalCluster(size, 0, args.config) as cluster:
        ranks = cluster.run(_sluice_rank, args.floats, args.iters, work, timeout=args.timeout)
        cluster.wait()
    kept = np.array([rows[args.iters // 5:] for rows in ranks])  # rank x allreduce x (submitted, decided, done)
    return {"latency": float(np.median((kept[:, :, 2] - kept[:, :, 0]) * 1e3)),
            "negotiation": float(np.median((kept[:, :, 1] - kept[:, :, 0]) * 1e3)),
            "data": float(np.median((kept[:, :, 2] - kept[:, :, 1]) * 1e3)),
            "critical": critical_path(kept[:, :, 0], kept[:, :, 2])}


def measure_gloo(args: argparse.Namespace, size: int, work: float) -> dict[str, float]:
    port = free_port()
    with Children() as children:
        for rank in range(size):
            children.start(f"rank {rank}", _gloo_rank, rank, size, port, args.floats, args.iters, work)
        found = children.collect([f"rank {r}" for r in range(size)], args.timeout)
    kept = np.array([found[f"rank {r}"][args.iters // 5:] for r in range(size)])
    return {"latency": float(np.median((kept[:, :, 1] - kept[:, :, 0]) * 1e3)),
            "critical": critical_path(kept[:, :, 0], kept[:, :, 1])}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    records: list[dict[str, Any]] = []
    rows = []
    for size, work in args.cases:
        case = f"{args.floats}f-p{size}-work{work:g}ms"
        ours: list[dict[str, float]] = []
        peer: list[dict[str, float]] = []
        for repeat in range(args.repeats):
            progress(f"{case}: repetition {repeat + 1}/{args.repeats}, Sluice then gloo ...")
            ours.append(measure_sluice(args, size, work))
            peer.append(measure_gloo(args, size, work))
        part = {key: stats([o[key] for o in ours]).median for key in ("negotiation", "data")}
        records.append(record(case, stats([o["critical"] for o in ours]), stats([p["critical"] for p in peer]),
                              "gloo (torch.distributed.all_reduce)", "ms", "lower", processes=size, work_ms=work,
                              floats=args.floats, metric="last submit -> last done",
                              ours_latency=stats([o["latency"] for o in ours]).median,
                              peer_latency=stats([p["latency"] for p in peer]).median,
                              negotiation_ms=part["negotiation"], data_ms=part["data"], settings=args.settings))
        rec = records[-1]
        rows.append([case, f"{rec['ours']:.3f}", f"{rec['peer']:.3f}", f"{rec['speedup']:.2f}x",
                     f"{rec['ours_latency']:.3f}", f"{rec['peer_latency']:.3f}", f"{part['negotiation']:.3f}",
                     f"{part['data']:.3f}"])
    print_table(["case", "critical ms (sluice)", "critical ms (gloo)", "speedup", "per-rank ms (sluice)",
                 "per-rank ms (gloo)", "sluice: submit->decided", "sluice: decided->done"], rows)
    print(f"medians of {args.repeats} repetitions of {args.iters} allreduces (the first fifth a warm-up)")
    write_json(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
