"""What security costs: push_pull bandwidth and training step time with transport.curve on against off."""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/curve_cost.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench.common import Stats, add_common_options, print_table, progress, record, stats, write_json
from bench.curve_cost_cases import (
    KIB,
    Case,
    loopback_pushpull,
    loopback_train,
    ssh_train,
    testbed_pushpull,
    testbed_train,
    zmq_pair,
)
from testbed.netbed import Netbed, ready_for
from testbed.ssh import ssh_bed
from testbed.ssh import unavailable as ssh_unavailable

PEER_NAME = "sluice, transport.curve = false"
LOOPBACK = ("pushpull-shm", "pushpull-tcp", "train", "zmq-pair", "zmq-pair-sealed")
TESTBED = ("testbed-pushpull", "testbed-train", "ssh-train")
GROUPS = {"loopback": LOOPBACK, "testbed": TESTBED, "all": LOOPBACK + TESTBED}
#: the most CURVE may cost, in percent of the time without it
TARGET_COST: dict[str, float] = {"loopback": 25.0, "testbed": 10.0}

DESCRIPTION = """\
What authenticating and encrypting every connection (transport.curve = true, the default) costs,
measured against transport.curve = false in the same run. Each repetition is a pair of fresh jobs,
one with CURVE and one without, in alternating order (on/off, then off/on) to cancel drift; within
a job the figures are taken after a warm-up, as in the benchmarks they reuse. Cases (--cases):

  pushpull-shm      loopback: W workers push_pull one float32 tensor through S servers (LocalCluster,
                    pushing from a Client.alloc array; bench/push_pull.py's measurement). Payloads go
                    through shared memory, so CURVE encrypts only headers and descriptors.
  pushpull-tcp      the same with transport.shm = false: every payload byte through the sockets, which
                    between processes of one host are Unix sockets (authenticated by a ticket with
                    CURVE on, never encrypted: transport/local_endpoints.py)
  train             loopback: bench/train_throughput.py's digits model and job (W workers, S servers,
                    optimizer on the workers), time per training step
  zmq-pair          ZeroMQ alone (no Sluice): one pyzmq PUSH -> PULL pair in one process over TCP on
                    loopback, 512 KiB messages, CPU seconds of all its threads per GB: the cipher's
                    own price per byte, which no setting of Sluice's changes
  zmq-pair-sealed   the same pair without CURVE, each message sealed with AES-256-GCM by the sending
                    thread and opened by the receiving one (transport/seal.py): "curve on" is sealed,
                    "curve off" the same pair in plain; the price of the cipher that seals data
                    connections between hosts (transport.cipher = aes-gcm, the default)
  testbed-pushpull  shaped testbed, one role per host, every worker and server link at RATE Mbit/s
                    (bench/ps_vs_allreduce.py's job: fixed chunk and in-flight bytes), payload bytes
                    all encrypted since the hosts are not local to each other
  testbed-train     shaped testbed: bench/priority_training.py's VGG-like job (worker links at RATE
                    Mbit/s with ToS bands, servers unshaped, its "priority" configuration), ms per step
  ssh-train         the same job started as a cluster launches it: `sluice launch -H ... --server-hosts`
                    over OpenSSH (testbed/ssh.py), each worker and server on a host of its own
                    running sshd, the scheduler on the launcher's host; needs OpenSSH's server too

"loopback" and "testbed" name the groups. The testbed needs root (network namespaces), and ssh-train
OpenSSH as well; without them those cases are skipped with the reason. --repeats counts pairs (even:
as many on-first as off-first). Every record's ours is CURVE on, peer CURVE off; speedup > 1 means
CURVE on was ahead; cost = how much more time CURVE on takes, in percent (for a bandwidth,
peer/ours - 1; for a time, ours/peer - 1). Targets: cost <= 25% on loopback, <= 10% on
the testbed. The medians and min..max pool every timed repetition of every job of a side;
paired_cost is the median over the pairs of each pair's cost (robust against slow drift).
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", choices=[*GROUPS, *LOOPBACK, *TESTBED], default=["all"],
                        help="cases or groups of cases to run (default: all)")
    parser.add_argument("--workers", type=int, default=2, metavar="W",
                        help="workers of every case (default: %(default)s)")
    parser.add_argument("--servers", type=int, default=2, metavar="S",
                        help="servers of every case (default: %(default)s)")
    parser.add_argument("--size", type=int, default=64, metavar="MIB",
                        help="push_pull tensor size in MiB of float32, loopback and testbed (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=0, metavar="R",
                        help="push_pull rounds per timed repetition; 0 picks max(2, 256 MiB / size) on loopback "
                             "and max(1, 128 MiB / size) on the testbed (default: %(default)s)")
    parser.add_argument("--inner", type=int, default=3, metavar="N",
                        help="timed repetitions inside each job (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=16, metavar="B",
                        help="train: samples per worker per step (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=200, metavar="N",
                        help="train: timed steps per repetition (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=20, metavar="N",
                        help="train: untimed steps first (default: %(default)s)")
    parser.add_argument("--rate-mbit", type=float, default=1000.0, metavar="RATE",
                        help="testbed link rate (default: %(default)s)")
    parser.add_argument("--chunk-bytes", type=int, default=512 * KIB, metavar="B",
                        help="testbed-pushpull: transport.chunk_bytes, fixed so runs compare (default: %(default)s)")
    parser.add_argument("--inflight-bytes", type=int, default=512 * KIB, metavar="B",
                        help="testbed-pushpull: transport.inflight_bytes (default: %(default)s)")
    parser.add_argument("--global-batch", type=int, default=128, metavar="B",
                        help="testbed-train, ssh-train: samples per step over all workers (default: %(default)s)")
    parser.add_argument("--hidden", type=int, default=2048, metavar="H",
                        help="testbed-train, ssh-train: width of the VGG-like model's fully connected layers "
                             "(default: %(default)s, bench/priority_training.py's)")
    parser.add_argument("--testbed-steps", type=int, default=20, metavar="N",
                        help="testbed-train, ssh-train: timed steps per repetition (default: %(default)s)")
    parser.add_argument("--testbed-warmup", type=int, default=5, metavar="N",
                        help="testbed-train, ssh-train: untimed steps first, at least 1 (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                        help="give up on one job after this long (default: %(default)s)")
    parser.add_argument("--io-threads", type=int, default=1, metavar="N",
                        help="transport.io_threads of every job, CURVE on and off: ZeroMQ I/O threads per process, "
                             "which encrypt and decrypt (default: %(default)s)")
    parser.add_argument("--cipher", choices=["aes-gcm", "curve"], default="aes-gcm",
                        help="transport.cipher of the jobs with security on: aes-gcm seals data connections between "
                             "hosts (the default), curve runs CURVE on them (default: %(default)s)")
    parser.add_argument("--verbose", action="store_true", help="testbed: show every process's output, prefixed")
    add_common_options(parser, quick="8 MiB in 2 rounds, 1 pair of jobs, 2 timed repetitions each, 2 warm-up + "
                                     "10 training steps (1 + 2 on the testbed, hidden 512, global batch 32) "
                                     "(overrides those options)", repeats=6)
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.rounds, args.repeats, args.inner, args.steps, args.warmup = 8, 2, 1, 2, 10, 2
        args.testbed_steps, args.testbed_warmup, args.hidden, args.global_batch = 2, 1, 512, 32
    if min(args.workers, args.servers, args.size, args.inner, args.repeats, args.batch_size, args.steps,
           args.testbed_steps, args.testbed_warmup) < 1 or args.rounds < 0 or args.warmup < 0:
        parser.error("workers, servers, size, inner, repeats, batch size, steps and testbed warm-up must be "
                     "positive; rounds and warmup not negative")
    if args.rate_mbit <= 0:
        parser.error("--rate-mbit must be positive")
    if args.global_batch % args.workers:
        parser.error(f"--global-batch {args.global_batch} must divide evenly over {args.workers} workers")
    args.cases = [c for c in GROUPS["all"] if any(c == n or c in GROUPS.get(n, ()) for n in args.cases)]
    return args


# ---------------------------------------------------------------------------- one case
@dataclass
class Measured:
    on: list[float] = field(default_factory=list)
    off: list[float] = field(default_factory=list)
    #: per pair: (median of CURVE on, median of CURVE off)
    pairs: list[tuple[float, float]] = field(default_factory=list)


def cost_percent(ours: float, peer: float, better: str) -> float:
    """How much more time CURVE on takes than off, in percent (negative: it took less)."""
    return ((peer / ours) if better == "higher" else (ours / peer)) * 100 - 100


def measure(case: Case, repeats: int) -> Measured:
    out = Measured()
    for pair in range(repeats):
        order = (True, False) if pair % 2 == 0 else (False, True)
        medians: dict[bool, float] = {}
        for curve in order:
            t0 = time.perf_counter()
            values = case.run(curve)
            (out.on if curve else out.off).extend(values)
            medians[curve] = statistics.median(values)
            figures = " ".join(f"{v:.3g}" for v in values)
            progress(f"  {case.name:<16} pair {pair + 1}/{repeats}  curve {'on ' if curve else 'off'}  "
                     f"{figures} {case.unit}  ({time.perf_counter() - t0:.1f} s)")
        out.pairs.append((medians[True], medians[False]))
    return out


def case_record(case: Case, measured: Measured, args: argparse.Namespace) -> dict[str, Any]:
    ours, peer = stats(measured.on), stats(measured.off)
    speedup = ours.median / peer.median if case.better == "higher" else peer.median / ours.median
    cost = cost_percent(ours.median, peer.median, case.better)
    paired = statistics.median(cost_percent(on, off, case.better) for on, off in measured.pairs)
    target = TARGET_COST.get(case.where)  # none for ZeroMQ alone: a price to know, not Sluice's to meet
    return record(
        case.name, ours, peer, PEER_NAME, case.unit, better=case.better, speedup=speedup, cost=cost,
        paired_cost=paired, target_cost=target, met=None if target is None else cost <= target, where=case.where,
        description=case.describe, pairs=args.repeats, repetitions_per_job=args.inner, samples=len(measured.on),
        workers=args.workers, servers=args.servers, io_threads=args.io_threads,
        **{"cipher": args.cipher, **case.extra},  # ZeroMQ pairs name the cipher they run themselves
    )


def run_ssh_case(args: argparse.Namespace) -> list[tuple[Case, Measured]]:
    """ssh-train in a bed of its own (a Netbed per process at a time: it is built after the other one
    is gone): hosts h1..hW for the workers, their links shaped, then hosts for the servers."""
    if reason := ssh_unavailable():
        progress(f"ssh-train: skipped, the ssh testbed is unavailable here: {reason}")
        return []
    rates: list[float | None] = [args.rate_mbit] * args.workers + [None] * args.servers
    with (tempfile.TemporaryDirectory(prefix="curve-cost-ssh-") as keys,
          ssh_bed(Path(keys), args.workers + args.servers, rates=rates, tos_bands=True) as bed):
        return run_cases([ssh_train(args, bed)], args)


def build_testbed(bed: Netbed, args: argparse.Namespace) -> None:
    """Workers' links shaped with ToS bands (priority_training), push_pull servers' links shaped
    (ps_vs_allreduce), the training servers' and the scheduler's links unshaped."""
    for i in range(args.workers):
        bed.host(f"w{i}", args.rate_mbit, tos_bands=True)
    for i in range(args.servers):
        bed.host(f"s{i}", args.rate_mbit)
        bed.host(f"t{i}")
    bed.host("sched")


# ---------------------------------------------------------------------------- driver
def run_cases(cases: Sequence[Case], args: argparse.Namespace) -> list[tuple[Case, Measured]]:
    done = []
    for case in cases:
        progress(f"{case.name}: {case.describe}")
        done.append((case, measure(case, args.repeats)))
    return done


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    # Sluice's warnings reach stderr, its INFO lines (calibration, priority maps, metrics) do not: with a
    # handler on "sluice", the forked workers add none of their own
    quiet = logging.StreamHandler()
    quiet.setLevel(logging.WARNING)
    logging.getLogger("sluice").addHandler(quiet)
    if any(name in LOOPBACK for name in args.cases):  # the first optimizer a process builds imports
        # torch._dynamo (1.3 s here): do it once before forking (the testbed's workers are processes of their own)
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.05, momentum=0.9)
    progress(f"curve_cost: cases {', '.join(args.cases)}; {args.repeats} pairs of jobs (security on, "
             f"cipher {args.cipher}, and off), {args.inner} timed repetitions in each")
    started = time.perf_counter()
    done: list[tuple[Case, Measured]] = []
    loopback: list[Case] = []
    for name in args.cases:
        if name in ("pushpull-shm", "pushpull-tcp"):
            loopback.append(loopback_pushpull(args, shm=name == "pushpull-shm"))
        elif name == "train":
            loopback.append(loopback_train(args))
        elif name in ("zmq-pair", "zmq-pair-sealed"):
            loopback.append(zmq_pair(args, sealed=name == "zmq-pair-sealed"))
    done += run_cases(loopback, args)
    testbed = [name for name in args.cases if name in TESTBED and name != "ssh-train"]
    if (testbed or "ssh-train" in args.cases) and ready_for("curve_cost"):
        if testbed:
            with Netbed() as bed:
                build_testbed(bed, args)
                makers = {"testbed-pushpull": testbed_pushpull, "testbed-train": testbed_train}
                done += run_cases([makers[name](args, bed) for name in testbed], args)
        if "ssh-train" in args.cases:
            done += run_ssh_case(args)
    records = [case_record(case, measured, args) for case, measured in done]
    progress(f"\nsecurity on (curve on below; transport.cipher {args.cipher}) against off, median [min..max] of "
             f"{args.repeats} pairs of jobs x {args.inner} "
             f"repetitions ({time.perf_counter() - started:.0f} s in all); cost = extra time with CURVE")
    rows = []
    for rec in records:
        digits = 3 if rec["unit"] == "GB/s" else 1
        on = Stats(rec["ours"], rec["ours_min"], rec["ours_max"]).brief(digits)
        off = Stats(rec["peer"], rec["peer_min"], rec["peer_max"]).brief(digits)
        rows.append([rec["case"], rec["unit"], on, off, f"{rec['speedup']:.3f}x", f"{rec['cost']:+.1f}%",
                     f"{rec['paired_cost']:+.1f}%", "" if rec["target_cost"] is None else f"<= {rec['target_cost']:g}%",
                     "" if rec["met"] is None else "met" if rec["met"] else "MISSED"])
    if rows:
        print_table(["case", "unit", "curve on", "curve off", "speedup", "cost", "paired cost", "target", ""], rows)
    write_json(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
