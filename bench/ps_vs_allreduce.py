"""PS bandwidth advantage on shaped links: Sluice push_pull over W workers + S servers against gloo ring all_reduce."""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/ps_vs_allreduce.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


from bench.common import (
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
    timed_push_pull,
    write_json,
)
from bench.raw_mesh import run_raw_mesh
from testbed.job import emit_result, run_gloo_job, run_sluice_job
from testbed.netbed import Netbed, ready_for

MIB = 1 << 20
GLOO = "torch.distributed gloo all_reduce (ring)"
TARGET_FRACTION, TARGET_RATIO = 0.90, 1.4

DESCRIPTION = """\
Algorithm bandwidth (bytes of one float32 tensor per worker / time of one round) on a testbed where
every host has its own link shaped to RATE Mbit/s both ways (tbf), all on one switch:

  sluice  W workers push_pull the tensor through S servers, each on its own host (worker.client.Client,
          pushing from a Client.alloc array); the scheduler sits on an unshaped host of its own
  gloo    torch.distributed all_reduce (gloo) on the same tensor, one process on each worker host
  raw     (--raw-zmq) the same rounds in raw ZeroMQ (bench/raw_mesh.py): each chunk to its server, the
          server's answer once every worker's copy came, nothing of Sluice (no sums, credit, cipher):
          what the links, the kernel and libzmq carry in these rounds, the floor under Sluice's figure

Link-rate bound: in a PS round each worker sends its bytes once and receives them once (both
directions of its link at once), so a round takes at least bytes / RATE; a ring all_reduce sends
2(W-1)/W of the bytes each way, so its bound is W / (2(W-1)) of that bandwidth. With 1500-byte
frames TCP payload is at most about 95.7% of the link rate (the shaper counts headers too).
Every process does one untimed warm-up round; each repetition times ROUNDS rounds between two
barriers on worker 0's clock. MB/s = 1e6 bytes/s.

Sluice runs as it does by default: security on, so that every payload byte between hosts is sealed
and opened (AES-256-GCM, transport.cipher = aes-gcm: about 3 GB/s a core each way; --cipher curve: CURVE,
about 1 GB/s). --compare-curve (the default but for --quick) runs its job again with transport.curve =
false, and every job records how busy the machine's cores were through its timed rounds (/proc/stat, read
by worker 0): cores full while a link idles say the run is bound by the CPU (the cipher, the kernel's TCP
over the testbed's veths, the processes' own work), not the link.
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256], metavar="MIB",
                        help="tensor sizes in MiB of float32 (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=4, metavar="W", help="worker hosts (default: %(default)s)")
    parser.add_argument("--servers", type=int, default=0, metavar="S",
                        help="server hosts; 0 means as many as workers (default: %(default)s)")
    parser.add_argument("--rate-mbit", type=float, default=1000.0, metavar="RATE",
                        help="link rate of every worker and server host (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=0, metavar="R",
                        help="rounds per repetition; 0 picks max(1, 128 MiB / size) (default: %(default)s)")
    # One 512 KiB chunk in flight per server: the credit then shares each link evenly among its flows
    # (TCP behind one tbf does not), which keeps the servers in step. Measured on this testbed with 64
    # MiB: 1 MiB / 16 MiB gave 95-97 MB/s, 1 MiB / 1 MiB 102-105, 512 KiB / 512 KiB 105-108.
    parser.add_argument("--chunk-bytes", type=int, default=MIB // 2, metavar="B",
                        help="transport.chunk_bytes, fixed so runs compare (default: %(default)s)")
    parser.add_argument("--inflight-bytes", type=int, default=MIB // 2, metavar="B",
                        help="transport.inflight_bytes, fixed so runs compare (default: %(default)s)")
    parser.add_argument("--compare-curve", action=argparse.BooleanOptionalAction, default=True,
                        help="also run Sluice's job with transport.curve = false: on separate hosts every payload "
                             "byte is encrypted (CURVE, the default), which on 2 cores bounds the rate "
                             "(default: %(default)s; --quick: off)")
    parser.add_argument("--cipher", choices=["aes-gcm", "curve"], default="aes-gcm",
                        help="transport.cipher of Sluice's job with security on: aes-gcm seals the data connections "
                             "(the default), curve runs CURVE on them (default: %(default)s)")
    parser.add_argument("--raw-zmq", action=argparse.BooleanOptionalAction, default=True,
                        help="also run the rounds in raw ZeroMQ, nothing of Sluice, with the same chunks "
                             "(bench/raw_mesh.py): what the network carries in them (default: %(default)s)")
    add_cc_option(parser)
    add_transport_cc_option(parser)
    parser.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                        help="give up on one job after this long (default: %(default)s)")
    parser.add_argument("--verbose", action="store_true", help="show every process's output, prefixed")
    # the program each job's workers run (this module, started inside a testbed host)
    parser.add_argument("--worker", choices=["sluice", "gloo"], help=argparse.SUPPRESS)
    parser.add_argument("--bytes", type=int, default=0, help=argparse.SUPPRESS)
    add_common_options(parser, quick="2 workers, 8 MiB, 2 rounds, 2 repeats (overrides those options)")
    args = parser.parse_args(argv)
    if args.quick:
        args.workers, args.sizes, args.rounds, args.repeats, args.compare_curve = 2, [8], 2, 2, False
    if min(args.sizes) < 1 or args.workers < 2 or args.repeats < 1 or args.servers < 0 or args.rounds < 0:
        parser.error("sizes and repeats must be positive, workers at least 2, servers and rounds not negative")
    if args.rate_mbit <= 0:
        parser.error("--rate-mbit must be positive")
    return args


def rounds_for(size_mib: int, rounds: int) -> int:
    return rounds if rounds > 0 else max(1, 128 // size_mib)


# ---------------------------------------------------------------------------- inside the testbed hosts
def sluice_worker(nbytes: int, rounds: int, repeats: int) -> dict[str, Any]:
    """Per-round seconds of each repetition, on this worker's clock, and how busy the machine's cores
    were meanwhile (the warm-up round included)."""
    cores = CoreUse()
    rank, seconds = timed_push_pull(nbytes, rounds, repeats)
    return {"rank": rank, "seconds": seconds, "cores_busy": cores.busy()}


def gloo_worker(nbytes: int, rounds: int, repeats: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=120))
    tensor = torch.ones(nbytes // 4)
    dist.all_reduce(tensor)
    if not bool((tensor == dist.get_world_size()).all()):
        raise AssertionError("all_reduce returned a wrong sum")
    tensor.zero_()  # sums of zeros stay finite however many rounds run
    seconds, cores = [], CoreUse()
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        for _ in range(rounds):
            dist.all_reduce(tensor)
        dist.barrier()
        seconds.append((time.perf_counter() - started) / rounds)
    return {"rank": dist.get_rank(), "seconds": seconds, "cores_busy": cores.busy()}


def worker_main(args: argparse.Namespace) -> int:
    if args.worker == "sluice":
        emit_result(sluice_worker(args.bytes, args.rounds, args.repeats))
        return 0
    emit_result(gloo_worker(args.bytes, args.rounds, args.repeats))
    # no destroy_process_group, no destructors: torch's gloo group can hang in them (bench.common.keep_alive)
    sys.stdout.flush()
    os._exit(0)


# ---------------------------------------------------------------------------- driver
def worker_argv(args: argparse.Namespace, role: str, nbytes: int, rounds: int) -> list[str]:
    return [sys.executable, "-m", "bench.ps_vs_allreduce", "--worker", role, "--bytes", str(nbytes),
            "--rounds", str(rounds), "--repeats", str(args.repeats)]


def bandwidth(nbytes: int, results: list[Any]) -> tuple[Stats, float]:
    """MB/s of worker 0's repetitions, and how busy the cores were through them (by worker 0)."""
    first = next(r for r in results if r["rank"] == 0)
    return stats([nbytes / t / 1e6 for t in first["seconds"]]), float(first["cores_busy"])


Run = tuple[Stats, float]  # MB/s, and the share of the machine's cores busy through the job


def measure(bed: Netbed, args: argparse.Namespace, size: int,
            servers: int) -> tuple[Run, Run, Run | None, Stats | None]:
    """Sluice's MB/s (CURVE on, the default), gloo's, and Sluice's with CURVE off (with --compare-curve),
    each with how busy the cores were; raw ZeroMQ's (with --raw-zmq)."""
    nbytes, rounds = size * MIB, rounds_for(size, args.rounds)
    workers = [f"w{i}" for i in range(args.workers)]
    env = {"OMP_NUM_THREADS": "1"}

    def sluice(curve: bool) -> Run:
        t0 = time.perf_counter()
        config = {"transport": {"chunk_bytes": args.chunk_bytes, "inflight_bytes": args.inflight_bytes,
                                "curve": curve, "cipher": args.cipher, "congestion_control": args.transport_cc}}
        results = run_sluice_job(bed, "sched", [f"s{i}" for i in range(servers)], workers, config,
                                 worker_argv(args, "sluice", nbytes, rounds), timeout=args.timeout, env=env,
                                 echo=args.verbose)
        ours, busy = bandwidth(nbytes, results)
        progress(f"  {size:>4} MiB  sluice {ours.brief(1)} MB/s{'' if curve else ' (CURVE off)'}, cores {busy:.0%} "
                 f"busy  ({time.perf_counter() - t0:.1f} s)")
        return ours, busy

    ours = sluice(True)
    t0 = time.perf_counter()
    results = run_gloo_job(bed, workers, worker_argv(args, "gloo", nbytes, rounds), timeout=args.timeout, env=env,
                           echo=args.verbose)
    gloo, busy = bandwidth(nbytes, results)
    progress(f"  {size:>4} MiB  gloo   {gloo.brief(1)} MB/s, cores {busy:.0%} busy  ({time.perf_counter() - t0:.1f} s)")
    raw = None
    if args.raw_zmq:
        t0 = time.perf_counter()
        raw = run_raw_mesh(bed, workers, [f"s{i}" for i in range(servers)], nbytes, args.chunk_bytes, rounds,
                           args.repeats, args.timeout)
        progress(f"  {size:>4} MiB  raw ZeroMQ rounds {raw.brief(1)} MB/s  ({time.perf_counter() - t0:.1f} s)")
    return ours, (gloo, busy), sluice(False) if args.compare_curve else None, raw


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    if not ready_for("ps_vs_allreduce"):
        return 0
    servers, w = args.servers or args.workers, args.workers
    link = args.rate_mbit * 1e6 / 8 / 1e6  # MB/s each way
    ring = link * w / (2 * (w - 1))
    progress(f"ps_vs_allreduce: {w} workers, {servers} servers, every host on its own {args.rate_mbit:g} Mbit/s link; "
             f"sizes {args.sizes} MiB, {args.repeats} repeats")
    progress(f"link-rate bound: PS {link:.1f} MB/s, ring all_reduce {ring:.1f} MB/s (algorithm bandwidth)")
    rows, records = [], []
    started = time.perf_counter()
    with Netbed() as bed:
        for i in range(w):
            bed.host(f"w{i}", args.rate_mbit)
        for i in range(servers):
            bed.host(f"s{i}", args.rate_mbit)
        bed.host("sched")  # control traffic only: unshaped
        cc = apply_cc_option(bed, args.cc, "ps_vs_allreduce")
        if cc is None:
            return 2
        for size in args.sizes:
            (ours, ours_busy), (gloo, gloo_busy), without_curve, raw = measure(bed, args, size, servers)
            plain, plain_busy = without_curve or (None, 0.0)
            case = f"{size}MiB-w{w}-s{servers}-{args.rate_mbit:g}mbit"
            fraction, ratio = ours.median / link, ours.median / gloo.median
            rows.append([case, ours.brief(1), f"{link:.1f}", f"{fraction:.1%}", gloo.brief(1),
                         f"{gloo.median / ring:.1%}", f"{ratio:.2f}x",
                         "" if plain is None else f"{plain.brief(1)} ({plain.median / link:.0%}, "
                                                  f"{plain.median / gloo.median:.2f}x)",
                         "" if raw is None else f"{raw.brief(1)} ({raw.median / link:.0%})"])
            without = {} if plain is None else {
                "curve_off": plain.median, "curve_off_min": plain.low, "curve_off_max": plain.high,
                "curve_off_fraction_of_bound": plain.median / link, "curve_off_ratio": plain.median / gloo.median,
                "curve_off_cores_busy": plain_busy}
            floor = {} if raw is None else {
                "raw_zmq": raw.median, "raw_zmq_min": raw.low, "raw_zmq_max": raw.high,
                "raw_zmq_fraction_of_bound": raw.median / link, "ratio_to_raw_zmq": ours.median / raw.median}
            records.append(record(
                case, ours, gloo, GLOO, "MB/s", size_mib=size, workers=w, servers=servers, rate_mbit=args.rate_mbit,
                rounds=rounds_for(size, args.rounds), repeats=args.repeats, link_bound=link, cc=cc,
                transport_cc=args.transport_cc or cc,
                fraction_of_bound=fraction, peer_bound=ring, peer_fraction_of_bound=gloo.median / ring,
                target_fraction=TARGET_FRACTION, target_ratio=TARGET_RATIO, curve=True, cipher=args.cipher,
                cores_busy=ours_busy, peer_cores_busy=gloo_busy, **without, **floor,
            ))
    progress(f"\nalgorithm bandwidth in MB/s, median [min..max] of {args.repeats} repeats "
             f"({time.perf_counter() - started:.0f} s in all)")
    print_table(["case", "sluice", "PS bound", "sluice/bound", "gloo", "gloo/ring bound", "sluice/gloo",
                 "sluice, CURVE off (bound, gloo)", "raw ZeroMQ rounds (bound)"], rows)
    for rec in records:
        fraction_met = "met" if rec["fraction_of_bound"] >= TARGET_FRACTION else "MISSED"
        ratio_met = "met" if rec["ratio"] >= TARGET_RATIO else "MISSED"
        progress(f"{rec['case']}: {rec['fraction_of_bound']:.1%} of the link-rate bound "
                 f"(target {TARGET_FRACTION:.0%}: {fraction_met}), {rec['ratio']:.2f}x gloo "
                 f"(target {TARGET_RATIO}x: {ratio_met})")
    write_json(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
