"""Training speed while a separate process floods every server and the scheduler with rejected messages."""

from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing as mp
import queue
import re
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/flood.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench.common import Stats, add_common_options, print_table, progress, record, stats, write_json
from bench.flooder import CURVE_OFF, CURVE_OFF_BANNED, MEMBER, SPIN, STRANGERS, flooder_main, targets_for
from bench.train_throughput import demo, sluice_demo, train, worker_batches
from testbed.children import Children
from testbed.cluster import LocalCluster

_ctx = mp.get_context("fork")

CLEAN_ON, CLEAN_OFF = "clean", "clean-curve-off"
MODES = (STRANGERS, MEMBER, CURVE_OFF, CURVE_OFF_BANNED, SPIN)
#: the clean job each mode is compared with (the same transport.curve)
BASELINE = {STRANGERS: CLEAN_ON, MEMBER: CLEAN_ON, SPIN: CLEAN_ON, CURVE_OFF: CLEAN_OFF, CURVE_OFF_BANNED: CLEAN_OFF}
PEER_NAME = {CLEAN_ON: "sluice, the same job without a flood (transport.curve = true)",
             CLEAN_OFF: "sluice, the same job without a flood (transport.curve = false)"}
LABELS = {
    STRANGERS: "CURVE on, strangers without the secret: connection attempts and garbage, nothing gets in",
    MEMBER: "CURVE on, a compromised member (the job secret, another server's key and name) sends garbage",
    CURVE_OFF: "CURVE off, strangers with random identities send garbage, a new identity before each ban",
    CURVE_OFF_BANNED: "CURVE off, strangers that keep their identities: banned after 100 refusals, and cut",
    SPIN: "control: a process that only spins one core (no messages), to separate CPU contention",
}
#: what `sent` counts, by mode
SENT_UNIT = {STRANGERS: "TCP connections carrying a garbage greeting", MEMBER: "messages", CURVE_OFF: "messages",
             CURVE_OFF_BANNED: "messages", SPIN: ""}
TARGET_RATIO = 0.5
_STOPPED = re.compile(r"server (\d+) stopped \((\d+) messages rejected, (\d+) connections refused\)")
_BANNED = "messages and little else: its messages are dropped from now on"
#: a server that lost the route to a worker (its ROUTER identity forgotten): the reply is gone
_NO_ROUTE = re.compile(r"no route to peer 'worker-\d+'; message dropped")

DESCRIPTION = f"""\
Global training throughput (steps x batch x workers / seconds) of bench/train_throughput.py's digits
model (W workers, S servers, optimizer on the workers, LocalCluster: forked roles on 127.0.0.1),
clean and while one separate process floods every server endpoint (each channel) and the scheduler.
Modes (--modes):

  {STRANGERS:<16} {LABELS[STRANGERS]}.
                   Per endpoint SOCKETS ZeroMQ DEALERs with random CURVE keys (half know the
                   server's public key, half guess it) that reconnect every millisecond after each
                   refused handshake (the servers count them: "connections refused"), while the
                   flooding loop opens TCP connections that send 64 random bytes as a greeting and
                   close with a reset, as fast as it can
  {MEMBER:<16} {LABELS[MEMBER]}:
                   keys derived from the job secret (as a stolen secret allows); server r is told
                   it talks to server r+1, the scheduler to itself, so every message reaches the
                   decoder and is rejected (a member is never banned)
  {CURVE_OFF:<16} {LABELS[CURVE_OFF]}:
                   SOCKETS DEALERs per endpoint, each replaced by one with a new identity after
                   ROTATE messages (a stranger is banned after 100 refused messages)
  {CURVE_OFF_BANNED:<16} {LABELS[CURVE_OFF_BANNED]}
  {SPIN:<16} {LABELS[SPIN]}

The message modes send small malformed messages (a sample of tests/integration/attack.py's raw
attacks; for servers also a well-formed PUSH of an unknown key from a non-worker id) as fast as
ZeroMQ takes them, and wait for room when its queues are full rather than spin. Every repetition
runs each mode's job and both clean jobs (CURVE on and off) in an order that rotates from one
repetition to the next; every job is a fresh cluster with scheduler.op_timeout = OP_TIMEOUT. Each
worker trains WARMUP untimed steps, then STEPS timed steps between barriers (rank 0's clock); the
flood starts before the warm-up and stops when the timed steps are done. A job that fails counts
as 0 samples/s (the record says why); one still training DEADLINE seconds after the flood began
counts the rate of its timed steps so far (0 if it is still warming up), and then the flood stops
and the job finishes. Counts: what the flooder sent (and its rate per second of
flooding), and what each server logged when it stopped ("server N stopped (X messages rejected, Y
connections refused)"); the scheduler prints no such total. ours = samples/s under the flood, peer
= samples/s of the clean jobs with the same transport.curve, ratio = speedup = ours/peer; target
ratio >= {TARGET_RATIO}. This machine has 2 cores, so the flooder's own CPU time is taken from the
training: the busy-loop control shows what that alone costs, and ratio_to_busy_loop (the "vs
busy-loop" column: samples/s under the flood / samples/s beside the busy loop, which runs with
CURVE on) what the flood costs beyond it.
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="flood modes to measure, each against its clean jobs (default: all)")
    parser.add_argument("--workers", type=int, default=2, metavar="W", help="worker processes (default: %(default)s)")
    parser.add_argument("--servers", type=int, default=2, metavar="S", help="server processes (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=16, metavar="B",
                        help="samples per worker per step (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=200, metavar="N",
                        help="timed steps per job (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=20, metavar="N",
                        help="untimed steps first, already under the flood (default: %(default)s)")
    parser.add_argument("--sockets", type=int, default=4, metavar="N",
                        help=f"{STRANGERS}, {CURVE_OFF} and {CURVE_OFF_BANNED}: flooding sockets per endpoint "
                             "(default: %(default)s)")
    parser.add_argument("--rotate", type=int, default=90, metavar="N",
                        help=f"{CURVE_OFF}: messages per identity before its socket is replaced by one with a new "
                             "identity (default: %(default)s)")
    parser.add_argument("--rate", type=float, default=0.0, metavar="PER_SECOND",
                        help="pace the flood at this many messages (strangers: connections) per second in all, "
                             "e.g. 1500 as an outside tester's flood; 0: as fast as ZeroMQ takes them "
                             "(default: %(default)s)")
    parser.add_argument("--deadline", type=float, default=60.0, metavar="SECONDS",
                        help="a job still training this long after the flood began counts the rate of its timed "
                             "steps so far; the flood then stops and the job finishes (default: %(default)s)")
    parser.add_argument("--op-timeout", type=float, default=20.0, metavar="SECONDS",
                        help="scheduler.op_timeout of every job: how long a lost reply stalls a job before it "
                             "fails (default: %(default)s)")
    parser.add_argument("--logs", metavar="DIR",
                        help="keep each job's log (every role's sluice.* lines) in DIR (default: a temporary "
                             "directory, removed)")
    parser.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                        help="give up on one job after this long (default: %(default)s)")
    add_common_options(parser, quick="10 timed steps after 2 warm-up steps, 1 repeat, deadline 10 s, op-timeout "
                                     "5 s (overrides those options)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.repeats, args.deadline, args.op_timeout = 10, 2, 1, 10.0, 5.0
    if min(args.workers, args.servers, args.batch_size, args.steps, args.repeats, args.sockets, args.rotate) < 1:
        parser.error("workers, servers, batch size, steps, repeats, sockets and rotate must be positive")
    if args.warmup < 0 or args.op_timeout <= 0 or args.deadline <= 0 or args.rate < 0:
        parser.error("warmup must not be negative, deadline and op-timeout must be positive")
    return args


# ---------------------------------------------------------------------------- the workers
def flood_worker(x: torch.Tensor, y: torch.Tensor, job: argparse.Namespace, peers: Any, go: Any, done: Any,
                 stopped: Any, progress: Any) -> dict[str, Any]:
    """bench/train_throughput.py's Sluice worker and its timed span (warm-up, settle, barrier, steps,
    settle, barrier), which also hands the servers' endpoints to the benchmark (rank 0), waits for
    the flood to start, and (rank 0) keeps `progress` = [monotonic time of the timed start, timed
    steps done], says when the timed steps are over and leaves the job only once the flood stopped."""
    import sluice.torch as hvd
    from sluice.worker.torch.state import require

    model, optimizer = sluice_demo()
    if hvd.rank() == 0:
        found = [(p.rank, p.name, list(p.endpoints)) for p in require().control.peers if p.role == "server"]
        peers.put(sorted(found))
    if not go.wait(120):
        raise TimeoutError("the benchmark never said go")
    data = worker_batches(x, y, hvd.rank(), hvd.size(), job.batch_size, job.warmup + job.steps)
    loss = train(model, optimizer, data, 0, job.warmup)
    hvd.synchronize_parameters()
    hvd.barrier(name="start")
    started = time.perf_counter()
    if hvd.rank() == 0:
        progress[0] = time.monotonic()
    for step in range(job.steps):
        loss = train(model, optimizer, data, job.warmup + step, 1)
        if hvd.rank() == 0:
            progress[1] = step + 1
    hvd.synchronize_parameters()
    hvd.barrier(name="end")
    seconds = time.perf_counter() - started
    if hvd.rank() == 0:
        done.set()
        stopped.wait(30)
    hvd.shutdown()
    return {"seconds": seconds, "loss": loss}


# ---------------------------------------------------------------------------- one job
@dataclass
class JobResult:
    mode: str
    samples_per_s: float  # 0 when the job failed; the rate so far when it was cut at the deadline
    error: str
    cut: str
    flood: dict[str, Any] | None
    rejected: list[int]
    refused: list[int]
    banned: int
    no_route: int
    codes: list[int | None]
    seconds: float


@contextlib.contextmanager
def captured_log(path: Path) -> Iterator[None]:
    """Every sluice.* line of this process and of those forked meanwhile, from INFO up, to `path`
    (and not to the terminal: with a handler on "sluice", the workers add none of their own)."""
    ours = logging.getLogger("sluice")
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s"))
    saved = ours.level
    ours.addHandler(handler)
    ours.setLevel(logging.INFO)
    try:
        yield
    finally:
        ours.removeHandler(handler)
        ours.setLevel(saved)
        handler.close()


def run_job(mode: str, args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor, log: Path) -> JobResult:
    curve = mode not in (CLEAN_OFF, CURVE_OFF, CURVE_OFF_BANNED)
    config = {"worker": {"optimizer_on": "worker"}, "transport": {"curve": curve},
              "scheduler": {"op_timeout": args.op_timeout}}
    job = argparse.Namespace(batch_size=args.batch_size, warmup=args.warmup, steps=args.steps)
    flood: dict[str, Any] | None = None
    error, cut, samples = "", "", 0.0
    started = time.perf_counter()
    with captured_log(log), LocalCluster(args.workers, args.servers, config) as cluster, Children() as children:
        peers, ready = _ctx.Queue(), _ctx.Queue()
        go, done, stopped = _ctx.Event(), _ctx.Event(), _ctx.Event()
        progress = _ctx.Array("d", 2)
        results = cluster.start_workers(flood_worker, x, y, job, peers, go, done, stopped, progress)
        servers = peers.get(timeout=120)
        if mode in MODES:
            children.start("flooder", flooder_main, mode, targets_for(servers, cluster.endpoint), cluster.secret,
                           args.workers, args.servers, args.sockets, args.rotate, args.timeout, ready, done, stopped,
                           args.rate)
            ready.get(timeout=60)
        else:
            stopped.set()
        go.set()
        reports: dict[int, tuple[str, Any]] = {}
        wait_until = time.monotonic() + args.deadline
        while len(reports) < args.workers and time.monotonic() < wait_until:
            with contextlib.suppress(queue.Empty):
                rank, status, value = results.get(timeout=0.2)
                reports[rank] = (status, value)
        if len(reports) < args.workers:  # too slow to wait for: the rate so far, then let it finish
            begun, steps = progress[0], int(progress[1])
            if begun and steps:
                samples = steps * args.batch_size * args.workers / (time.monotonic() - begun)
            where = f"{steps} of {args.steps} timed steps" if begun else "still in the warm-up"
            cut = f"stopped after {args.deadline:g} s, {where}"
            done.set()
            with contextlib.suppress(queue.Empty):
                reports.update(cluster.collect(results, args.workers - len(reports), args.timeout))
        failed = {rank: value for rank, (status, value) in reports.items() if status != "ok"}
        if failed:
            error = "; ".join(f"worker {rank}: {value}" for rank, value in sorted(failed.items()))
            samples = 0.0
        elif len(reports) < args.workers:
            error = f"the workers did not finish within {args.timeout:g} s of the deadline"
            samples = 0.0
        elif not cut:
            samples = args.steps * args.batch_size * args.workers / reports[0][1]["seconds"]
        done.set()  # stops the flood if rank 0 could not
        if mode in MODES:
            try:
                flood = children.collect(["flooder"], 60)["flooder"]
            except (RuntimeError, TimeoutError) as exc:  # its counts are lost; the training figure stands
                error = "; ".join(filter(None, (error, f"the flooder failed: {exc}")))
        # after a failure the scheduler ends the job once the failed workers miss their heartbeats (8 s)
        codes = cluster.wait(timeout=15 if error else 30)
    text = log.read_text(errors="replace")
    summary = sorted((int(r), int(n), int(c)) for r, n, c in _STOPPED.findall(text))
    return JobResult(mode, samples, error, cut, flood, [s[1] for s in summary], [s[2] for s in summary],
                     text.count(_BANNED), len(_NO_ROUTE.findall(text)), codes, time.perf_counter() - started)


def describe_job(job: JobResult) -> str:
    text = f"{job.samples_per_s:7.0f} samples/s"
    if job.flood is not None and job.mode != SPIN:
        rate = job.flood["sent"] / job.flood["seconds"]
        what = "connections" if job.mode == STRANGERS else "messages"
        text += (f", flooder sent {job.flood['sent']:,} {what} ({rate:,.0f}/s; {job.flood['sent_scheduler']:,} to the "
                 f"scheduler), servers rejected {sum(job.rejected):,} messages and refused "
                 f"{sum(job.refused):,} connections")
        if job.banned:
            text += f", {job.banned} bans"
        if job.mode == CURVE_OFF:
            text += f", {job.flood['sockets_opened']:,} identities"
        if job.no_route:
            text += f", {job.no_route} messages to workers dropped for want of a route"
    if job.cut:
        text += f"; {job.cut}"
    if job.error:
        text += f"; FAILED: {job.error[:300]}"
    elif any(code != 0 for code in job.codes):
        text += f"; exit codes {job.codes}"
    return text


# ---------------------------------------------------------------------------- driver
def mode_record(mode: str, jobs: list[JobResult], clean: list[JobResult], args: argparse.Namespace) -> dict[str, Any]:
    ours = stats([j.samples_per_s for j in jobs])
    peer = stats([j.samples_per_s for j in clean if not j.error] or [0.0])
    ratio = ours.median / peer.median if peer.median else 0.0
    flooded = [j.flood for j in jobs if j.flood is not None]
    seconds = sum(f["seconds"] for f in flooded)
    rates = [f["sent"] / f["seconds"] for f in flooded if mode != SPIN and f["seconds"] > 0]
    rate = stats(rates) if rates else Stats(0.0, 0.0, 0.0)
    rejected = sum(sum(j.rejected) for j in jobs)
    refused = sum(sum(j.refused) for j in jobs)
    return record(
        f"{mode}-w{args.workers}-s{args.servers}-b{args.batch_size}" + (f"-at{args.rate:.0f}" if args.rate else ""),
        ours, peer, PEER_NAME[BASELINE[mode]],
        "samples/s", better="higher", speedup=ratio, mode=mode, description=LABELS[mode],
        curve=BASELINE[mode] == CLEAN_ON, workers=args.workers, servers=args.servers, batch_size=args.batch_size,
        steps=args.steps, warmup=args.warmup, repeats=args.repeats, op_timeout=args.op_timeout, paced_rate=args.rate,
        sockets_per_endpoint=args.sockets if mode not in (MEMBER, SPIN) else (1 if mode == MEMBER else 0),
        rotate=args.rotate if mode == CURVE_OFF else None,
        sent_unit=SENT_UNIT[mode], send_rate=rate.median, send_rate_min=rate.low, send_rate_max=rate.high,
        sent=sum(f["sent"] for f in flooded), sent_scheduler=sum(f["sent_scheduler"] for f in flooded),
        flood_seconds=seconds, sockets_opened=sum(f["sockets_opened"] for f in flooded),
        servers_rejected=rejected, servers_refused_connections=refused,
        servers_rejected_per_s=rejected / seconds if seconds else 0.0,
        servers_refused_per_s=refused / seconds if seconds else 0.0,
        bans=sum(j.banned for j in jobs), worker_messages_without_route=sum(j.no_route for j in jobs),
        rejected_by_job=[j.rejected for j in jobs],
        refused_by_job=[j.refused for j in jobs], samples_by_job=[j.samples_per_s for j in jobs],
        failed_jobs=sum(1 for j in jobs if j.error), errors=[j.error for j in jobs if j.error],
        cut_jobs=sum(1 for j in jobs if j.cut and not j.error), cuts=[j.cut for j in jobs if j.cut],
        clean_failed_jobs=sum(1 for j in clean if j.error),
        exit_codes={str(code): n for code, n in Counter(c for j in jobs for c in j.codes).items()},
        target_ratio=TARGET_RATIO, met=ratio >= TARGET_RATIO,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    _, load_data = demo()
    x, y, _, _ = load_data()
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.05, momentum=0.9)  # imports torch._dynamo once
    order: list[str] = []
    for clean in (CLEAN_ON, CLEAN_OFF):
        modes = [m for m in args.modes if BASELINE[m] == clean]
        order += [clean, *modes] if modes else []
    progress(f"flood: {args.workers} workers x {args.servers} servers, batch {args.batch_size} per worker, "
             f"{args.warmup} warm-up + {args.steps} timed steps per job; {args.repeats} repeats of "
             f"{', '.join(order)}")
    jobs: dict[str, list[JobResult]] = {name: [] for name in order}
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        logdir = Path(args.logs) if args.logs else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        logdir.mkdir(parents=True, exist_ok=True)
        for rep in range(args.repeats):
            shift = rep % len(order)
            for name in order[shift:] + order[:shift]:
                job = run_job(name, args, x, y, logdir / f"{rep}-{name}.log")
                jobs[name].append(job)
                progress(f"  repeat {rep + 1}/{args.repeats}  {name:<16} {describe_job(job)}  ({job.seconds:.1f} s)")
    records = [mode_record(mode, jobs[mode], jobs[BASELINE[mode]], args) for mode in args.modes]
    if SPIN in jobs:  # what a flood costs beyond taking one core, as the busy loop does
        spin = stats([j.samples_per_s for j in jobs[SPIN]]).median
        for rec in records:
            rec["ratio_to_busy_loop"] = rec["ours"] / spin if spin else 0.0
    rows = []
    for rec in records:
        rows.append([
            rec["case"], Stats(rec["ours"], rec["ours_min"], rec["ours_max"]).brief(0),
            Stats(rec["peer"], rec["peer_min"], rec["peer_max"]).brief(0), f"{rec['ratio']:.2f}x",
            f"{rec['send_rate']:,.0f}" if rec["mode"] != SPIN else "-",
            f"{rec['servers_rejected_per_s']:,.0f}", f"{rec['servers_refused_per_s']:,.0f}", str(rec["bans"]),
            str(rec["failed_jobs"]), f"{rec['ratio_to_busy_loop']:.2f}x" if "ratio_to_busy_loop" in rec else "-",
            "met" if rec["met"] else "MISSED",
        ])
    elapsed = time.perf_counter() - started
    progress(f"\nglobal samples/s, median [min..max] of {args.repeats} jobs each ({elapsed:.0f} s "
             "in all); sent/s: messages (strangers: connections) per second of flooding; rejected/s and refused/s: "
             "the servers' own counts, summed, per second of flooding")
    print_table(["case", "under flood", "clean", "ratio", "sent/s", "rejected/s", "refused/s", "bans", "failed",
                 "vs busy-loop", f">= {TARGET_RATIO}x"], rows)
    for rec in records:
        for error in dict.fromkeys(rec["errors"]):
            progress(f"{rec['case']}: a job failed: {error[:400]}")
    write_json(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
