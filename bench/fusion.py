"""Tensor fusion on a 200-tensor model: balanced fusion against no fusion and Horovod-style greedy fusion."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/fusion.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench.common import Stats, add_common_options, print_table, progress, record, stats, write_json
from bench.fusion_worker import Workload, fusion_worker, model_summary, quarter_buffer, worker_main
from sluice.worker.plan.fusion import ALIGN
from testbed.cluster import LocalCluster
from testbed.job import run_sluice_job
from testbed.netbed import Netbed, ready_for

BALANCED, NONE, GREEDY = "balanced", "none", "greedy"
CONFIGS = (BALANCED, NONE, GREEDY)
PEER_NAMES = {
    NONE: "Sluice, no fusion (collective.fusion_bytes = 0: every gradient its own allreduce)",
    GREEDY: "Sluice, Horovod-style greedy fusion (collective.fusion = 'greedy': what one coordinator "
            "cycle decides, copied into buffers of up to fusion_bytes)",
}
#: balanced fusion must be at least this many times faster than each baseline
TARGET_SPEEDUP = {NONE: 2.0, GREEDY: 1.1}
#: largest fused buffer over the mean, at most
TARGET_BALANCE = 1.2
NETWORKS = ("loopback", "testbed")

DESCRIPTION = """\
Training step time of a BERT-like stack of many small tensors: BLOCKS blocks of Linear(d, 4d), GELU,
Linear(4d, d), LayerNorm(d) with a residual (6 parameter tensors each: two weight matrices, four
vectors), and a Linear(d, 16) head; 33 blocks give 200 tensors. Inputs are BATCH rows of d features
from torch.randn (seeded per rank), cross-entropy loss, SGD with momentum, one torch thread per
process. W workers, no servers: pure allreduce (Horovod's setting), optimizer on the workers,
gradients views of registered fusion buffers. Three configurations of the [collective] section, in
the same run:

  balanced  fusion = "balanced", fusion_bytes = F: the gradient buffer (backward order) cut once into
            ceil(total / F) equal groups, each sent when its last gradient is ready
  none      fusion_bytes = 0: every gradient its own allreduce
  greedy    fusion = "greedy", fusion_bytes = F: each gradient negotiated alone; the allreduces one
            coordinator message decides are copied into buffers of up to F (Horovod's tensor fusion)

All use collective.cycle_ms = CYCLE (default 1 ms: Horovod's default cycle since v0.21, horovod
#2468). Networks (--cases): loopback (LocalCluster on this host: peers share memory) and testbed
(each worker in a network namespace of its own, its link shaped to RATE Mbit/s both ways with tbf;
the scheduler on an unshaped host; needs root, else skipped with the reason).

Each job trains WARMUP untimed steps, then times STEPS steps per repetition between two barriers on
rank 0's clock (the last step's updates waited for inside the span). Every configuration runs JOBS
fresh jobs, the configurations in rotated order each round so drift on a shared machine falls on
all of them; the figures pool every repetition of every job: median [min..max]. speedup =
baseline ms / balanced ms (> 1: balanced is ahead); paired: the same ratio of each round's two jobs,
median [min..max] over the rounds. Max/mean fused buffer size: balanced from its plan (the same
every step), greedy from the buffers the engine actually sent in the timed steps. On the testbed no
configuration can step faster than the links carry a ring allreduce of every gradient (printed, and
the records' wire_bound_ms): the larger the model, the more of every step that bound takes.
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", choices=NETWORKS, default=list(NETWORKS),
                        help="networks to measure (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=4, metavar="W", help="worker processes (default: %(default)s)")
    # 64: 4.4 MB of gradients, whose ring allreduce needs 55 ms of wire time on 1 Gbit/s links, of the
    # order of the step's compute; at 128 (17.4 MB, 219 ms) the testbed step is mostly wire time,
    # which no fusion scheme shortens (bench/results/fusion.md has both)
    parser.add_argument("--width", type=int, default=64, metavar="D",
                        help="model width d (the blocks' matrices are d x 4d) (default: %(default)s)")
    parser.add_argument("--blocks", type=int, default=33, metavar="N",
                        help="blocks of 6 tensors; the head adds 2 (default: %(default)s: 200 tensors)")
    parser.add_argument("--batch-size", type=int, default=32, metavar="B",
                        help="rows per worker per step (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=20, metavar="N",
                        help="timed steps per repetition (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=5, metavar="N",
                        help="untimed steps first, at least 2: the first builds the priority map, the fusion "
                             "buffers and the coordinator's operation table (default: %(default)s)")
    parser.add_argument("--jobs", type=int, default=3, metavar="J",
                        help="fresh jobs per configuration and network, in rotated order (default: %(default)s)")
    parser.add_argument("--fusion-bytes", type=int, default=0, metavar="F",
                        help="collective.fusion_bytes of balanced and greedy; 0: a quarter of the model's "
                             "gradient buffer, so balanced fusion makes 4 groups (default: %(default)s)")
    parser.add_argument("--cycle-ms", type=float, default=1.0, metavar="CYCLE",
                        help="collective.cycle_ms of every configuration (default: %(default)s)")
    parser.add_argument("--rate-mbit", type=float, default=1000.0, metavar="RATE",
                        help="testbed: link rate of every worker host (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                        help="give up on one job after this long (default: %(default)s)")
    parser.add_argument("--verbose", action="store_true",
                        help="show the workers' INFO logs (and, on the testbed, every process's output)")
    # the program each testbed worker runs (this module, started inside a testbed host)
    parser.add_argument("--worker", metavar="JSON", help=argparse.SUPPRESS)
    add_common_options(parser, quick="loopback only, 2 workers, width 32, batch 8, 2 warm-up + 2 timed steps, "
                                     "1 job, 2 repeats (overrides those options)", repeats=5)
    args = parser.parse_args(argv)
    if args.quick:
        args.cases, args.workers, args.width, args.batch_size = ["loopback"], 2, 32, 8
        args.warmup, args.steps, args.jobs, args.repeats = 2, 2, 1, 2
    if min(args.workers, args.width, args.blocks, args.batch_size, args.steps, args.jobs, args.repeats) < 1:
        parser.error("workers, width, blocks, batch size, steps, jobs and repeats must be positive")
    if args.warmup < 2:
        parser.error("--warmup must be at least 2: the first step builds the fusion buffers and the operation table")
    if args.fusion_bytes < 0 or 0 < args.fusion_bytes < ALIGN or args.cycle_ms <= 0 or args.rate_mbit <= 0:
        parser.error(f"--fusion-bytes must be 0 (auto) or at least {ALIGN}; --cycle-ms and --rate-mbit positive")
    if args.fusion_bytes == 0:
        args.fusion_bytes = quarter_buffer(args.width, args.blocks)
    return args


# ---------------------------------------------------------------------------- one job
def collective_config(name: str, fusion_bytes: int, cycle_ms: float) -> dict[str, dict[str, Any]]:
    fusion = {
        BALANCED: {"fusion": "balanced", "fusion_bytes": fusion_bytes},
        NONE: {"fusion": "balanced", "fusion_bytes": 0},
        GREEDY: {"fusion": "greedy", "fusion_bytes": fusion_bytes},
    }[name]
    return {"collective": {"mode": "allreduce", "cycle_ms": cycle_ms, **fusion}}


def workload(args: argparse.Namespace) -> Workload:
    return Workload(args.width, args.blocks, args.batch_size, args.warmup, args.steps, args.repeats, args.verbose)


def run_loopback(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """One LocalCluster job (W workers, no servers); rank 0's result."""
    config = collective_config(name, args.fusion_bytes, args.cycle_ms)
    with LocalCluster(args.workers, 0, config) as cluster:
        results = cluster.run(fusion_worker, workload(args), timeout=args.timeout)
        cluster.wait()
    out: dict[str, Any] = results[0]
    return out


def run_testbed(bed: Netbed, args: argparse.Namespace, name: str) -> dict[str, Any]:
    """One job on the testbed: a worker per shaped host, the scheduler on an unshaped one; rank 0's result."""
    argv = [sys.executable, "-m", "bench.fusion", "--worker", json.dumps(asdict(workload(args)))]
    results = run_sluice_job(bed, "sched", [], [f"w{i}" for i in range(args.workers)],
                             collective_config(name, args.fusion_bytes, args.cycle_ms), argv,
                             timeout=args.timeout, env={"OMP_NUM_THREADS": "1"}, echo=args.verbose)
    out: dict[str, Any] = next(r for r in results if r["rank"] == 0)
    return out


# ---------------------------------------------------------------------------- one network
@dataclass
class Measured:
    """Every timed repetition of every job of one configuration on one network."""

    ms: list[float] = field(default_factory=list)
    #: the median of each job, by round (for the paired speedups: rounds drift together)
    job_medians: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    groups: list[int] = field(default_factory=list)  # the plan's group sizes (the same in every job)
    #: per repetition: the sizes of the fused buffers the greedy engine sent
    buffers: list[list[int]] = field(default_factory=list)


def wire_bound_ms(model_bytes: int, workers: int, rate_mbit: float) -> float:
    """The least time the testbed's links allow for one step's gradients: a ring allreduce sends (and
    receives) 2(W-1)/W of the bytes on every worker's link, and with 1500-byte frames TCP payload is at
    most 95.7% of the link rate (the shaper counts headers too). Any fusion scheme moves the same bytes."""
    payload_bytes_per_s = rate_mbit * 1e6 / 8 * 0.957
    return 2 * (workers - 1) / workers * model_bytes / payload_bytes_per_s * 1e3


def balance(sizes: Sequence[int]) -> float:
    """max/mean of buffer sizes (1.0: all equal)."""
    return max(sizes) / (sum(sizes) / len(sizes))


def measure_network(network: str, args: argparse.Namespace,
                    run: Callable[[str], dict[str, Any]]) -> dict[str, Measured]:
    measured = {name: Measured() for name in CONFIGS}
    for job in range(args.jobs):
        for name in CONFIGS[job % len(CONFIGS):] + CONFIGS[:job % len(CONFIGS)]:
            t0 = time.perf_counter()
            result = run(name)
            got = measured[name]
            ms = [s * 1000 for s in result["seconds"]]
            got.ms += ms
            got.job_medians.append(stats(ms).median)
            got.losses.append(result["loss"])
            got.groups = result["groups"]
            got.buffers += result["greedy_buffers"]
            extra = ""
            if result["greedy_buffers"]:
                sent = [size for rep in result["greedy_buffers"] for size in rep]
                extra = f", {len(sent) / (args.steps * args.repeats):.1f} buffers/step, max/mean {balance(sent):.2f}"
            else:
                extra = f", {len(result['groups'])} groups, max/mean {balance(result['groups']):.2f}"
            progress(f"  {network} {name:<8} job {job + 1}/{args.jobs}: {stats(ms).brief(1)} ms/step{extra}, "
                     f"loss {result['loss']:.4g} ({time.perf_counter() - t0:.1f} s)")
    return measured


def network_records(network: str, args: argparse.Namespace, measured: dict[str, Measured],
                    model: dict[str, int]) -> tuple[list[dict[str, Any]], list[list[str]], list[list[str]]]:
    """The records of one network, its rows of the step-time table and of the buffer-size table."""
    testbed = network.startswith("testbed")
    ours = stats(measured[BALANCED].ms)
    plan = measured[BALANCED].groups
    greedy_reps = measured[GREEDY].buffers
    greedy_sent = [size for rep in greedy_reps for size in rep]
    greedy_balance = balance(greedy_sent)
    per_step = len(greedy_sent) / (args.steps * len(greedy_reps))
    common: dict[str, Any] = {
        "network": network, "workers": args.workers, "servers": 0, "mode": "allreduce",
        "rate_mbit": args.rate_mbit if testbed else None,
        "wire_bound_ms": wire_bound_ms(model["model_bytes"], args.workers, args.rate_mbit) if testbed else None,
        "width": args.width, "blocks": args.blocks,
        **model, "batch_size": args.batch_size, "fusion_bytes": args.fusion_bytes, "cycle_ms": args.cycle_ms,
        "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats, "jobs": args.jobs,
        "samples": len(measured[BALANCED].ms),
        "ours_groups": len(plan), "ours_max_mean": balance(plan),
        "ours_group_bytes_min": min(plan), "ours_group_bytes_max": max(plan),
        "greedy_max_mean": greedy_balance, "greedy_buffers_per_step": per_step,
        "greedy_buffer_bytes_mean": sum(greedy_sent) / len(greedy_sent), "greedy_buffer_bytes_max": max(greedy_sent),
        "greedy_buffer_bytes_min": min(greedy_sent),
    }
    records, rows = [], []
    for baseline in (NONE, GREEDY):
        peer = stats(measured[baseline].ms)
        speedup = peer.median / ours.median
        paired = [b / a for a, b in zip(measured[BALANCED].job_medians, measured[baseline].job_medians, strict=True)]
        case = f"{network}-vs-{baseline}"
        target = TARGET_SPEEDUP[baseline]
        records.append(record(case, ours, peer, PEER_NAMES[baseline], "ms/step", better="lower", speedup=speedup,
                              target_speedup=target, met=speedup >= target, paired_speedups=paired,
                              paired_speedup=stats(paired).median, ours_loss=measured[BALANCED].losses,
                              peer_loss=measured[baseline].losses, **common))
        rows.append([case, ours.brief(1), peer.brief(1), f"{speedup:.3f}x", stats(paired).brief(2), f">= {target}x",
                     "met" if speedup >= target else "MISSED"])
    # balanced's plan is one fixed set of sizes; greedy's buffers change per repetition (pooled above)
    plan_stats = Stats(balance(plan), balance(plan), balance(plan))
    greedy_stats = stats([balance(rep) for rep in greedy_reps])
    case = f"{network}-balance"
    records.append(record(case, plan_stats, greedy_stats, "Horovod-style greedy fusion (measured buffers)",
                          "max/mean fused buffer bytes", better="lower",
                          speedup=greedy_stats.median / plan_stats.median, target_ours=TARGET_BALANCE,
                          met=plan_stats.median <= TARGET_BALANCE, **common))
    buffer_row = [case, f"{balance(plan):.3f}", f"{len(plan)}", f"{sum(plan) / len(plan) / 1024:.0f}",
                  f"{greedy_balance:.2f} (per rep {greedy_stats.brief(2)})", f"{per_step:.1f}",
                  f"{sum(greedy_sent) / len(greedy_sent) / 1024:.0f}", f"{max(greedy_sent) / 1024:.0f}",
                  "met" if balance(plan) <= TARGET_BALANCE else "MISSED"]
    return records, rows, [buffer_row]


# ---------------------------------------------------------------------------- driver
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args.worker)
    torch.set_num_threads(1)
    # The first optimizer a process builds imports torch._dynamo (1.3 s here); do it once before forking.
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.01, momentum=0.9)
    model = model_summary(args.width, args.blocks)
    progress(f"fusion: {model['tensors']} tensors, {model['model_bytes'] / 1e6:.2f} MB "
             f"({model['smallest_tensor_bytes']} B to {model['largest_tensor_bytes'] / 1024:.0f} KiB), "
             f"{args.workers} workers, pure allreduce, batch {args.batch_size} per worker, "
             f"fusion_bytes {args.fusion_bytes}, cycle {args.cycle_ms:g} ms; "
             f"{args.warmup} warm-up + {args.steps} timed steps x {args.repeats} repeats x {args.jobs} jobs")
    records: list[dict[str, Any]] = []
    rows: list[list[str]] = []
    buffer_rows: list[list[str]] = []
    started = time.perf_counter()
    for network in args.cases:
        if network == "loopback":
            measured = measure_network(network, args, lambda name: run_loopback(args, name))
        else:
            if not ready_for("fusion (testbed cases)"):
                continue
            with Netbed() as bed:
                for i in range(args.workers):
                    bed.host(f"w{i}", args.rate_mbit)
                bed.host("sched")  # control traffic only: unshaped
                network = f"testbed-{args.rate_mbit / 1000:g}g" if args.rate_mbit >= 1000 else \
                    f"testbed-{args.rate_mbit:g}m"
                progress(f"  {network}: the links allow no step below "
                         f"{wire_bound_ms(model['model_bytes'], args.workers, args.rate_mbit):.1f} ms (ring "
                         f"allreduce of every gradient at {args.rate_mbit:g} Mbit/s)")
                measured = measure_network(network, args, lambda name: run_testbed(bed, args, name))
        got, step_rows, size_rows = network_records(network, args, measured, model)
        records += got
        rows += step_rows
        buffer_rows += size_rows
    if not records:
        return 0
    progress(f"\nstep time in ms/step, median [min..max] of {args.jobs} jobs x {args.repeats} repeats "
             f"({time.perf_counter() - started:.0f} s in all); speedup = baseline / balanced")
    print_table(["case", "balanced", "baseline", "speedup", "paired", "target", ""], rows)
    progress(f"\nfused buffer sizes (KiB); balanced from its plan, greedy as sent in the timed steps; "
             f"target max/mean <= {TARGET_BALANCE}")
    print_table(["case", "balanced max/mean", "groups", "mean KiB", "greedy max/mean", "greedy buffers/step",
                 "mean KiB", "max KiB", ""], buffer_rows)
    write_json(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
