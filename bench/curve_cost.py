"""What CURVE costs: push_pull bandwidth and training step time with transport.curve on against off."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/curve_cost.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench import priority_training, ps_vs_allreduce
from bench.common import Stats, add_common_options, print_table, progress, record, stats, timed_push_pull, write_json
from bench.netbed import Netbed, ready_for
from bench.netbed.job import RESULT_PREFIX, run_sluice_job
from bench.netbed.ssh import SshBed, ssh_bed
from bench.netbed.ssh import unavailable as ssh_unavailable
from bench.train_throughput import _sluice_worker as train_worker
from bench.train_throughput import demo
from tests.cluster import LocalCluster

MIB, KIB = 1 << 20, 1 << 10
PEER_NAME = "sluice, transport.curve = false"
LOOPBACK = ("pushpull-shm", "pushpull-tcp", "train")
TESTBED = ("testbed-pushpull", "testbed-train", "ssh-train")
GROUPS = {"loopback": LOOPBACK, "testbed": TESTBED, "all": LOOPBACK + TESTBED}
#: the most CURVE may cost, in percent of the time without it
TARGET_COST = {"loopback": 25.0, "testbed": 10.0}

DESCRIPTION = """\
What authenticating and encrypting every connection (transport.curve = true, the default) costs,
measured against transport.curve = false in the same run. Each repetition is a pair of fresh jobs,
one with CURVE and one without, in alternating order (on/off, then off/on) to cancel drift; within
a job the figures are taken after a warm-up, as in the benchmarks they reuse. Cases (--cases):

  pushpull-shm      loopback: W workers push_pull one float32 tensor through S servers (LocalCluster,
                    pushing from a Client.alloc array; bench/push_pull.py's measurement). Payloads go
                    through shared memory, so CURVE encrypts only headers and descriptors.
  pushpull-tcp      the same with transport.shm = false: CURVE encrypts every payload byte
  train             loopback: bench/train_throughput.py's digits model and job (W workers, S servers,
                    optimizer on the workers), time per training step
  testbed-pushpull  shaped testbed, one role per host, every worker and server link at RATE Mbit/s
                    (bench/ps_vs_allreduce.py's job: fixed chunk and in-flight bytes), payload bytes
                    all encrypted since the hosts are not local to each other
  testbed-train     shaped testbed: bench/priority_training.py's VGG-like job (worker links at RATE
                    Mbit/s with ToS bands, servers unshaped, its "priority" configuration), ms per step
  ssh-train         the same job started as a cluster launches it: `sluice launch -H ... --server-hosts`
                    over OpenSSH (bench/netbed/ssh.py), each worker and server on a host of its own
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
    parser.add_argument("--testbed-steps", type=int, default=20, metavar="N",
                        help="testbed-train, ssh-train: timed steps per repetition (default: %(default)s)")
    parser.add_argument("--testbed-warmup", type=int, default=5, metavar="N",
                        help="testbed-train, ssh-train: untimed steps first, at least 1 (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                        help="give up on one job after this long (default: %(default)s)")
    parser.add_argument("--verbose", action="store_true", help="testbed: show every process's output, prefixed")
    add_common_options(parser, quick="16 MiB (8 MiB on the testbed), 1 pair of jobs, 2 timed repetitions "
                                     "each, 30 training steps (4 on the testbed) (overrides those options)",
                       repeats=6)
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.repeats, args.inner, args.steps, args.warmup = 16, 1, 2, 30, 5
        args.testbed_steps, args.testbed_warmup = 4, 2
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
@dataclass(frozen=True)
class Case:
    name: str
    where: str  # "loopback" or "testbed"
    unit: str
    better: str  # "higher" or "lower"
    describe: str
    #: runs one job (CURVE on or off): the figure of each timed repetition, in `unit`
    run: Callable[[bool], list[float]]
    extra: dict[str, Any] = field(default_factory=dict)


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
    target = TARGET_COST[case.where]
    return record(
        case.name, ours, peer, PEER_NAME, case.unit, better=case.better, speedup=speedup, cost=cost,
        paired_cost=paired, target_cost=target, met=cost <= target, where=case.where, description=case.describe,
        pairs=args.repeats, repetitions_per_job=args.inner, samples=len(measured.on), workers=args.workers,
        servers=args.servers, **case.extra,
    )


# ---------------------------------------------------------------------------- loopback jobs
def _pushpull_worker(nbytes: int, rounds: int, repeats: int) -> list[float]:
    return timed_push_pull(nbytes, rounds, repeats)[1]


def loopback_pushpull(args: argparse.Namespace, shm: bool) -> Case:
    nbytes = args.size * MIB
    rounds = args.rounds or max(2, 256 // args.size)

    def run(curve: bool) -> list[float]:
        config = {"transport": {"curve": curve, "shm": shm}}
        with LocalCluster(args.workers, args.servers, config) as cluster:
            results = cluster.run(_pushpull_worker, nbytes, rounds, args.inner, timeout=args.timeout)
            cluster.wait()
        return [nbytes / s / 1e9 for s in results[0]]

    name = "pushpull-shm" if shm else "pushpull-tcp"
    how = "payloads through shared memory" if shm else "transport.shm = false, payloads over TCP"
    describe = f"loopback push_pull of {args.size} MiB, {args.workers} workers x {args.servers} servers, {how}"
    return Case(name, "loopback", "GB/s", "higher", describe, run,
                {"size_mib": args.size, "rounds": rounds, "shm": shm})


def loopback_train(args: argparse.Namespace) -> Case:
    _, load_data = demo()
    x, y, _, _ = load_data()
    job = argparse.Namespace(batch_size=args.batch_size, warmup=args.warmup, steps=args.steps, repeats=args.inner)

    def run(curve: bool) -> list[float]:
        config = {"worker": {"optimizer_on": "worker"}, "transport": {"curve": curve}}
        with LocalCluster(args.workers, args.servers, config) as cluster:
            results = cluster.run(train_worker, x, y, job, timeout=args.timeout)
            cluster.wait()
        return [s / args.steps * 1000 for s in results[0]["seconds"]]

    describe = (f"loopback training step of bench/train_throughput.py's digits model, {args.workers} workers x "
                f"{args.servers} servers, batch {args.batch_size} per worker, optimizer on the workers")
    return Case("train", "loopback", "ms/step", "lower", describe, run,
                {"batch_size": args.batch_size, "steps": args.steps, "warmup": args.warmup})


# ---------------------------------------------------------------------------- testbed jobs
def testbed_pushpull(args: argparse.Namespace, bed: Netbed) -> Case:
    nbytes = args.size * MIB
    rounds = args.rounds or max(1, 128 // args.size)
    job = argparse.Namespace(repeats=args.inner)
    argv = ps_vs_allreduce.worker_argv(job, "sluice", nbytes, rounds)
    workers, servers = [f"w{i}" for i in range(args.workers)], [f"s{i}" for i in range(args.servers)]

    def run(curve: bool) -> list[float]:
        config = {"transport": {"chunk_bytes": args.chunk_bytes, "inflight_bytes": args.inflight_bytes,
                                "curve": curve}}
        results = run_sluice_job(bed, "sched", servers, workers, config, argv, timeout=args.timeout,
                                 env={"OMP_NUM_THREADS": "1"}, echo=args.verbose)
        seconds = next(r["seconds"] for r in results if r["rank"] == 0)
        return [nbytes / s / 1e6 for s in seconds]

    describe = (f"push_pull of {args.size} MiB across testbed hosts, {args.workers} workers x {args.servers} "
                f"servers, each on its own {args.rate_mbit:g} Mbit/s link, chunk {args.chunk_bytes // KIB} KiB, "
                f"in flight {args.inflight_bytes // KIB} KiB")
    return Case("testbed-pushpull", "testbed", "MB/s", "higher", describe, run,
                {"size_mib": args.size, "rounds": rounds, "rate_mbit": args.rate_mbit,
                 "link_bound": args.rate_mbit / 8})


def _training_job(args: argparse.Namespace) -> tuple[list[str], dict[str, dict[str, Any]], str, dict[str, Any]]:
    """The worker program of priority_training.measure() with its "priority" configuration (sections),
    what it trains (for a description) and the record's extra fields."""
    job = priority_training.parse_args([
        "--workers", str(args.workers), "--servers", str(args.servers), "--global-batch", str(args.global_batch),
        "--steps", str(args.testbed_steps), "--warmup", str(args.testbed_warmup), "--repeats", str(args.inner),
        "--rate-mbit", str(args.rate_mbit),
    ])
    argv = [sys.executable, "-m", "bench.priority_training", "--worker", "sluice",
            "--batch", str(job.global_batch // args.workers), "--width", str(job.width), "--hidden", str(job.hidden),
            "--steps", str(job.steps), "--warmup", str(job.warmup), "--repeats", str(job.repeats)]
    params = sum(p.numel() for p in priority_training.make_model(job.width, job.hidden).parameters())
    model = f"bench/priority_training.py's VGG-like model ({params / 1e6:.2f} M parameters)"
    extra = {"global_batch": args.global_batch, "steps": args.testbed_steps, "warmup": args.testbed_warmup,
             "rate_mbit": args.rate_mbit, "parameters": params}
    return argv, priority_training.sluice_config(job, priority_training.PRIORITY), model, extra


def _with_curve(base: dict[str, dict[str, Any]], curve: bool) -> dict[str, dict[str, Any]]:
    return {**base, "transport": {**base["transport"], "curve": curve}}


def testbed_train(args: argparse.Namespace, bed: Netbed) -> Case:
    argv, base, model, extra = _training_job(args)
    workers, servers = [f"w{i}" for i in range(args.workers)], [f"t{i}" for i in range(args.servers)]

    def run(curve: bool) -> list[float]:
        results = run_sluice_job(bed, servers[0], servers, workers, _with_curve(base, curve), argv,
                                 timeout=args.timeout, env={"OMP_NUM_THREADS": "1"}, echo=args.verbose)
        seconds = next(r["seconds"] for r in results if r["rank"] == 0)
        return [s * 1000 for s in seconds]

    describe = (f"training step of {model}, {args.workers} workers on {args.rate_mbit:g} Mbit/s links with ToS "
                f"bands, {args.servers} servers unshaped, global batch {args.global_batch}, its 'priority' "
                "configuration")
    return Case("testbed-train", "testbed", "ms/step", "lower", describe, run, extra)


def _set_options(sections: dict[str, dict[str, Any]]) -> list[str]:
    """`--set section.key=value` for every key of `sections` (bare values, as --set reads them)."""
    out = []
    for section, values in sections.items():
        for key, value in values.items():
            text = ("true" if value else "false") if isinstance(value, bool) else str(value)
            out += ["--set", f"{section}.{key}={text}"]
    return out


def ssh_train(args: argparse.Namespace, bed: SshBed) -> Case:
    """testbed-train's job as `sluice launch -H` starts it over ssh: workers on h1..hW, servers after them."""
    argv, base, model, extra = _training_job(args)
    addresses = list(bed.hosts.values())
    layout = ["-H", ",".join(f"{a}:1" for a in addresses), "-w", str(args.workers), "-s", str(args.servers),
              "--server-hosts", ",".join(addresses[args.workers:])]

    def run(curve: bool) -> list[float]:
        # one thread per process, as testbed-train's (the launcher would pick cores / processes per host)
        done = bed.launch([*layout, *_set_options(_with_curve(base, curve)), "--", *argv], timeout=args.timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
        if args.verbose:
            print(done.stdout, flush=True)
        found = re.findall(rf"^\[worker 0\] {RESULT_PREFIX}(.*)$", done.stdout, re.M)
        if done.returncode != 0 or not found:
            tail = "\n".join(f"    {line}" for line in done.stdout.splitlines()[-30:])
            raise RuntimeError(f"sluice launch over ssh (transport.curve = {curve}) exited {done.returncode} "
                               f"without worker 0's {RESULT_PREFIX.strip()} line; its last lines:\n{tail}")
        return [s * 1000 for s in json.loads(found[-1])["seconds"]]

    describe = (f"training step of {model} launched over OpenSSH (sluice launch -H), {args.workers} workers on "
                f"hosts of their own with {args.rate_mbit:g} Mbit/s links and ToS bands, {args.servers} servers on "
                f"unshaped hosts (--server-hosts), the scheduler on the launcher's, global batch "
                f"{args.global_batch}, the 'priority' configuration")
    return Case("ssh-train", "testbed", "ms/step", "lower", describe, run, {**extra, "launched": "ssh"})


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
    # The first optimizer a process builds imports torch._dynamo (1.3 s here); do it once before forking.
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.05, momentum=0.9)
    progress(f"curve_cost: cases {', '.join(args.cases)}; {args.repeats} pairs of jobs (CURVE on, off), "
             f"{args.inner} timed repetitions in each")
    started = time.perf_counter()
    done: list[tuple[Case, Measured]] = []
    loopback: list[Case] = []
    for name in args.cases:
        if name in ("pushpull-shm", "pushpull-tcp"):
            loopback.append(loopback_pushpull(args, shm=name == "pushpull-shm"))
        elif name == "train":
            loopback.append(loopback_train(args))
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
    progress(f"\nCURVE on against off, median [min..max] of {args.repeats} pairs of jobs x {args.inner} "
             f"repetitions ({time.perf_counter() - started:.0f} s in all); cost = extra time with CURVE")
    rows = []
    for rec in records:
        digits = 3 if rec["unit"] == "GB/s" else 1
        on = Stats(rec["ours"], rec["ours_min"], rec["ours_max"]).brief(digits)
        off = Stats(rec["peer"], rec["peer_min"], rec["peer_max"]).brief(digits)
        rows.append([rec["case"], rec["unit"], on, off, f"{rec['speedup']:.3f}x", f"{rec['cost']:+.1f}%",
                     f"{rec['paired_cost']:+.1f}%", f"<= {rec['target_cost']:g}%", "met" if rec["met"] else "MISSED"])
    if rows:
        print_table(["case", "unit", "curve on", "curve off", "speedup", "cost", "paired cost", "target", ""], rows)
    write_json(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
