"""Training step time on shaped worker links: Sluice with priority, without it, one FIFO channel, and torch DDP."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/priority_training.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F
from torch import nn

from bench.common import (
    ROOT,
    CoreUse,
    Stats,
    add_cc_option,
    add_common_options,
    add_transport_cc_option,
    apply_cc_option,
    print_table,
    progress,
    record,
    stats,
    write_json,
)
from bench.plot import bar_chart, write_svg
from sluice.transport.config import TransportConfig
from testbed.job import emit_result, run_gloo_job, run_sluice_job
from testbed.link_use import LinkProfile, LinkUse
from testbed.netbed import Netbed, ready_for

KIB = 1 << 10
PRIORITY, CHUNKED, FIFO, DDP, UNENCRYPTED = "priority", "chunked", "fifo", "ddp", "priority-nocurve"
CONFIGS = (PRIORITY, CHUNKED, FIFO, DDP, UNENCRYPTED)
LABELS = {
    PRIORITY: "Sluice, priority (forward order, 3 channels, marks)",
    UNENCRYPTED: "Sluice, priority, CURVE off",
    CHUNKED: "Sluice, chunks without priority",
    FIFO: "Sluice, one FIFO channel, tensors uncut",
    DDP: "torch DDP (gloo)",
}
TARGETS = {FIFO: 1.25, CHUNKED: 1.1, DDP: 1.3}
#: --quick: Sluice's priority configuration and one peer, DDP over gloo (the other route a job takes here:
#: run_gloo_job); 14 s here, where all four configurations took 30 s
QUICK_CONFIGS = (PRIORITY, DDP)

DESCRIPTION = """\
Training step time of a VGG-like model (convolutions first, big fully connected layers last;
synthetic 3x32x32 inputs, SGD with momentum) on a testbed where each worker host has its own link
shaped to RATE Mbit/s both ways (tbf with pfifo_fast's three ToS bands under it). The global batch
is fixed, split over the workers, so each step's compute on this machine's cores stays the same.
Every worker runs one torch thread. Configurations, all in the same run:

  priority  Sluice, worker.optimizer_on = OPTIMIZER_ON (either way the next forward pass waits per
            layer for its parameters), worker.priority = "forward", 3 channels with ToS marks, chunked
  chunked   the same with worker.priority = "none": every chunk first come, first served
  fifo      one channel, worker.priority = "none", chunks as large as the largest tensor (not cut)
  ddp       torch DistributedDataParallel over gloo on the same worker hosts, optimizer on each worker
  priority-nocurve
            priority with transport.curve = false: every other Sluice configuration encrypts each byte
            between hosts (CURVE, the default), which DDP does not

Sluice's S servers sit on hosts of their own (links unshaped unless --server-mbit), the scheduler on
the first server's host. Each worker trains WARMUP untimed steps; each repetition then times STEPS
steps between two barriers on worker 0 (Sluice waits for the last parameters inside the span), and
how busy the machine's cores were through them (/proc/stat).
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4], metavar="W",
                        help="worker counts (default: %(default)s)")
    parser.add_argument("--servers", type=int, default=2, metavar="S", help="Sluice servers (default: %(default)s)")
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=None,
                        help=f"configurations to run (default: all; --quick: {' '.join(QUICK_CONFIGS)})")
    parser.add_argument("--rate-mbit", type=float, default=1000.0, metavar="RATE",
                        help="link rate of every worker host (default: %(default)s)")
    parser.add_argument("--optimizer-on", choices=["server", "worker"], default="server",
                        help="worker.optimizer_on of the Sluice configurations: the servers step, or each "
                             "worker steps each parameter as its gradients come back (default: %(default)s)")
    parser.add_argument("--server-mbit", type=float, default=None, metavar="RATE",
                        help="link rate of the server hosts (default: unshaped)")
    parser.add_argument("--global-batch", type=int, default=128, metavar="B",
                        help="samples per step over all workers (default: %(default)s)")
    parser.add_argument("--width", type=int, default=32, metavar="C",
                        help="channels of the first convolutions (default: %(default)s)")
    parser.add_argument("--hidden", type=int, default=2048, metavar="H",
                        help="width of the fully connected layers (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=20, metavar="N",
                        help="timed steps per repetition (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=5, metavar="N", help="untimed steps first (default: %(default)s)")
    parser.add_argument("--chunk-bytes", type=int, default=512 * KIB, metavar="B",
                        help="transport.chunk_bytes of the chunked configurations (default: %(default)s)")
    # An urgent chunk waits behind at most this much on its own channel; the channels are separate
    # sockets with their own ToS band. With 2 workers, 1 MiB gave 410-430 ms per step, 4 MiB 380-395.
    parser.add_argument("--inflight-bytes", type=int, default=4096 * KIB, metavar="B",
                        help="transport.inflight_bytes of the chunked configurations (default: %(default)s)")
    parser.add_argument("--bulk-bytes", type=int, default=TransportConfig.bulk_bytes, metavar="B",
                        help="transport.bulk_bytes of the priority configurations: a tensor of more bytes rides the "
                             "last channel whatever its priority; 0: by priority alone (default: %(default)s)")
    parser.add_argument("--plot", default=str(ROOT / "docs" / "priority_training.svg"), metavar="PATH",
                        help="write a bar chart of the step times here (default: docs/priority_training.svg)")
    parser.add_argument("--cipher", choices=["aes-gcm", "curve"], default="aes-gcm",
                        help="transport.cipher of Sluice's jobs: aes-gcm seals the data connections (the default), "
                             "curve runs CURVE on them (default: %(default)s)")
    parser.add_argument("--link-profile", action="store_true",
                        help="sample worker 0's switch port every 2 ms and report how busy its link was through the "
                             "timed steps (testbed/link_use.py): whether a step waits on the link or on the cores")
    add_cc_option(parser)
    add_transport_cc_option(parser)
    parser.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                        help="give up on one job after this long (default: %(default)s)")
    parser.add_argument("--verbose", action="store_true", help="show every process's output, prefixed")
    parser.add_argument("--worker", choices=["sluice", "ddp"], help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=0, help=argparse.SUPPRESS)
    add_common_options(parser, quick="2 workers, hidden 512, global batch 32, 1 warm-up + 2 timed steps, 1 repeat "
                                     "(overrides those options); priority against ddp only (unless --configs names "
                                     "others)", repeats=3)
    args = parser.parse_args(argv)
    if args.quick:
        args.workers, args.hidden, args.global_batch, args.warmup, args.steps, args.repeats = [2], 512, 32, 1, 2, 1
    if args.configs is None:
        args.configs = list(QUICK_CONFIGS if args.quick else CONFIGS)
    if min(args.workers) < 1 or min(args.servers, args.steps, args.repeats, args.width, args.hidden) < 1:
        parser.error("workers, servers, steps, repeats, width and hidden must be positive")
    if args.warmup < 1:
        parser.error("--warmup must be at least 1: the first step builds the priority map and is slow")
    if any(args.global_batch % w for w in args.workers):
        parser.error(f"--global-batch {args.global_batch} must divide evenly over {args.workers} workers")
    return args


# ---------------------------------------------------------------------------- the model
def make_model(width: int, hidden: int) -> nn.Sequential:
    """VGG-like for 3x32x32: five 3x3 convolutions in three stages, then three fully connected layers
    holding almost all the parameters (the last layers the largest, as in VGG)."""
    c = width
    return nn.Sequential(
        nn.Conv2d(3, c, 3, padding=1), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(), nn.Conv2d(2 * c, 2 * c, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(2 * c, 4 * c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(4 * c * 4 * 4, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10),
    )


def largest_tensor_bytes(width: int, hidden: int) -> int:
    return max(p.numel() * p.element_size() for p in make_model(width, hidden).parameters())


# ---------------------------------------------------------------------------- inside the worker hosts
def train(args: argparse.Namespace, rank: int, optimizer: torch.optim.Optimizer, model: nn.Module,
          barrier: Callable[[], None], settle: Callable[[], None]) -> dict[str, Any]:
    """Seconds per step of each repetition (between barriers) and the last loss."""
    generator = torch.Generator().manual_seed(rank)
    images = torch.randn(args.batch, 3, 32, 32, generator=generator)
    labels = torch.randint(0, 10, (args.batch,), generator=generator)

    def steps(count: int) -> float:
        loss = torch.zeros(())
        for _ in range(count):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(images), labels)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
        return float(loss.item())

    loss = steps(args.warmup)
    settle()
    seconds, windows, cores = [], [], CoreUse()
    for _ in range(args.repeats):
        barrier()
        started, window = time.perf_counter(), time.monotonic()
        loss = steps(args.steps)
        settle()
        barrier()
        seconds.append((time.perf_counter() - started) / args.steps)
        windows.append((window, time.monotonic()))  # CLOCK_MONOTONIC: the link sampler's clock, in any namespace
    return {"rank": rank, "seconds": seconds, "windows": windows, "loss": loss, "cores_busy": cores.busy()}


def sluice_worker(args: argparse.Namespace) -> dict[str, Any]:
    import sluice.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    model = make_model(args.width, args.hidden)
    # with the optimizer on the servers, wrapping broadcasts rank 0's parameters to every worker
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                         named_parameters=model.named_parameters(), model=model)
    result = train(args, hvd.rank(), optimizer, model, hvd.barrier, hvd.synchronize_parameters)
    hvd.shutdown()
    return result


def ddp_worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=120))
    torch.manual_seed(0)
    model = DistributedDataParallel(make_model(args.width, args.hidden))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return train(args, dist.get_rank(), optimizer, model, dist.barrier, lambda: None)


def worker_main(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    if args.worker == "sluice":
        emit_result(sluice_worker(args))
        return 0
    emit_result(ddp_worker(args))
    # no destroy_process_group, no destructors: torch's gloo group can hang in them (bench.common.keep_alive)
    sys.stdout.flush()
    os._exit(0)


# ---------------------------------------------------------------------------- driver
def sluice_config(args: argparse.Namespace, name: str) -> dict[str, dict[str, Any]]:
    chunked = {"chunk_bytes": args.chunk_bytes, "inflight_bytes": args.inflight_bytes, "cipher": args.cipher,
               "congestion_control": args.transport_cc}
    if name in (PRIORITY, UNENCRYPTED):
        off = {"curve": False} if name == UNENCRYPTED else {}  # the default stays unsaid (curve_cost sets it)
        return {"worker": {"optimizer_on": args.optimizer_on, "priority": "forward"},
                "transport": {"channels": 3, "marks": True, "bulk_bytes": args.bulk_bytes, **chunked, **off}}
    if name == CHUNKED:
        return {"worker": {"optimizer_on": args.optimizer_on, "priority": "none"},
                "transport": {"channels": 3, **chunked}}
    whole = max(largest_tensor_bytes(args.width, args.hidden), 4 * KIB)
    return {"worker": {"optimizer_on": args.optimizer_on, "priority": "none"},
            "transport": {"channels": 1, "chunk_bytes": whole, "inflight_bytes": max(whole, args.inflight_bytes),
                          "cipher": args.cipher, "congestion_control": args.transport_cc}}


def measure(bed: Netbed, args: argparse.Namespace, name: str,
            workers: int) -> tuple[Stats, float, LinkProfile | None]:
    """ms a step (worker 0's repetitions), the share of the cores busy through them, and with
    --link-profile how busy worker 0's link was."""
    batch = args.global_batch // workers
    argv = [sys.executable, "-m", "bench.priority_training", "--worker", "sluice" if name != DDP else "ddp",
            "--batch", str(batch), "--width", str(args.width), "--hidden", str(args.hidden),
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--repeats", str(args.repeats)]
    hosts = [f"w{i}" for i in range(workers)]
    env = {"OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    sampler = LinkUse(bed, "w0") if args.link_profile else None
    try:
        if name == DDP:
            results = run_gloo_job(bed, hosts, argv, timeout=args.timeout, env=env, echo=args.verbose)
        else:
            servers = [f"s{i}" for i in range(args.servers)]
            results = run_sluice_job(bed, servers[0], servers, hosts, sluice_config(args, name), argv,
                                     timeout=args.timeout, env=env, echo=args.verbose)
    finally:
        if sampler is not None:
            sampler.stop()
    first = next(r for r in results if r["rank"] == 0)
    link = None
    if sampler is not None:
        try:
            link = sampler.profile(first["windows"])
        except ValueError as exc:  # no sampler output, or timed steps shorter than a bin
            progress(f"     worker 0's link: no profile ({exc})")
    step = stats([s * 1000 for s in first["seconds"]])
    progress(f"  w{workers} {name:<8} {step.brief(1)} ms/step, {args.global_batch / step.median * 1000:.0f} "
             f"samples/s, cores {first['cores_busy']:.0%} busy, last loss {first['loss']:.3g} "
             f"({time.perf_counter() - t0:.1f} s)")
    if link is not None:
        progress(f"     worker 0's link through the timed steps: {link.describe()}")
    return step, float(first["cores_busy"]), link


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    if not ready_for("priority_training"):
        return 0
    model = make_model(args.width, args.hidden)
    params = sum(p.numel() for p in model.parameters())
    progress(f"priority_training: {params / 1e6:.2f} M parameters ({params * 4 / 1e6:.1f} MB, largest tensor "
             f"{largest_tensor_bytes(args.width, args.hidden) / 1e6:.1f} MB), global batch {args.global_batch}, "
             f"worker links {args.rate_mbit:g} Mbit/s, servers' links "
             f"{'unshaped' if args.server_mbit is None else f'{args.server_mbit:g} Mbit/s'}; "
             f"{args.warmup} warm-up + {args.steps} timed steps x {args.repeats} repeats")
    measured: dict[tuple[int, str], Stats] = {}
    busy: dict[tuple[int, str], float] = {}
    links: dict[tuple[int, str], LinkProfile | None] = {}
    started = time.perf_counter()
    with Netbed() as bed:
        for i in range(max(args.workers)):
            bed.host(f"w{i}", args.rate_mbit, tos_bands=True)
        for i in range(args.servers):
            bed.host(f"s{i}", args.server_mbit, tos_bands=args.server_mbit is not None)
        cc = apply_cc_option(bed, args.cc, "priority_training")
        if cc is None:
            return 2
        for workers in args.workers:
            for name in args.configs:
                measured[(workers, name)], busy[(workers, name)], links[(workers, name)] = measure(
                    bed, args, name, workers)
    progress(f"\nstep time in ms, median [min..max] of {args.repeats} repeats; global samples/s "
             f"({time.perf_counter() - started:.0f} s in all)")
    rows, records = [], []
    for workers in args.workers:
        for name in args.configs:
            step = measured[(workers, name)]
            speedup = ""
            if name != PRIORITY and (workers, PRIORITY) in measured:
                speedup = f"{step.median / measured[(workers, PRIORITY)].median:.2f}x"
            rows.append([f"w{workers}", name, step.brief(1), f"{args.global_batch / step.median * 1000:.0f}",
                         f"{busy[(workers, name)]:.0%}", speedup])
    print_table(["workers", "config", "ms/step", "samples/s", "cores busy", "priority speed-up"], rows)
    for workers in args.workers:
        if (workers, PRIORITY) not in measured:
            continue
        # each peer against priority; DDP also against priority with CURVE off (neither then encrypts)
        pairs = [(PRIORITY, name) for name in args.configs if name in TARGETS]
        pairs += [(UNENCRYPTED, DDP)] if {UNENCRYPTED, DDP} <= set(args.configs) else []
        for mine, name in pairs:
            ours, peer = throughput(args, measured[(workers, mine)]), throughput(args, measured[(workers, name)])
            on = "" if args.optimizer_on == "server" else "-opt_worker"
            nocurve = "-nocurve" if mine == UNENCRYPTED else ""
            case = (f"vgg{args.width}-h{args.hidden}-w{workers}-s{args.servers}-b{args.global_batch}{on}{nocurve}"
                    f"-vs-{name}")
            ratio = ours.median / peer.median
            met = "met" if ratio >= TARGETS[name] else "MISSED"
            progress(f"{case}: {mine} {ratio:.2f}x {name} (target {TARGETS[name]}x: {met})")
            records.append(record(
                case, ours, peer, LABELS[name], "samples/s", workers=workers, servers=args.servers,
                global_batch=args.global_batch, rate_mbit=args.rate_mbit, steps=args.steps, warmup=args.warmup,
                repeats=args.repeats, optimizer_on=args.optimizer_on, bulk_bytes=args.bulk_bytes, cc=cc,
                transport_cc=args.transport_cc or cc,
                ours_step_ms=measured[(workers, mine)].median,
                peer_step_ms=measured[(workers, name)].median, target_ratio=TARGETS[name], curve=mine == PRIORITY,
                cores_busy=busy[(workers, mine)], peer_cores_busy=busy[(workers, name)],
                **_link_fields(links.get((workers, mine)), ""), **_link_fields(links.get((workers, name)), "peer_"),
            ))
    write_json(args.json, records)
    if args.plot:
        groups = [f"{w} workers" for w in args.workers]
        values = {(f"{w} workers", LABELS[n]): measured[(w, n)].median for w, n in measured}
        ranges = {(f"{w} workers", LABELS[n]): (s.low, s.high) for (w, n), s in measured.items()}
        svg = bar_chart(groups, [LABELS[n] for n in args.configs], values, ranges=ranges,
                        ylabel="ms per step, median and min..max (lower is better)",
                        title=f"Step time, VGG-like model ({params / 1e6:.1f} M parameters), "
                              f"{args.rate_mbit:g} Mbit/s worker links")
        progress(f"wrote the plot to {write_svg(args.plot, svg)}")
    return 0


def _link_fields(link: LinkProfile | None, prefix: str) -> dict[str, Any]:
    return {} if link is None else {prefix + key: value for key, value in link.fields().items()}


def throughput(args: argparse.Namespace, step_ms: Stats) -> Stats:
    """Global samples/s from step times (the fastest step time gives the highest throughput)."""
    return Stats(args.global_batch / step_ms.median * 1000, args.global_batch / step_ms.high * 1000,
                 args.global_batch / step_ms.low * 1000)


if __name__ == "__main__":
    sys.exit(main())
