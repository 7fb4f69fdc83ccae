"""What server recovery (ps.recover) costs in step time, and how soon a job whose server was killed trains again."""

from __future__ import annotations

import argparse
import glob
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/recovery.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench import priority_training
from bench.common import Stats, add_common_options, print_table, progress, record, stats, write_json
from bench.recovery_kill import kill_record
from bench.recovery_testbed import run_testbed_job, testbed
from bench.train_throughput import demo, timed_repeats, worker_batches
from sluice.ps.snapshot import STATE_DIR, remove_state_files, state_tag
from sluice.scheduler.recovery import chosen_mirror_every
from testbed.cluster import LocalCluster
from testbed.netbed import ready_for

COST_CASES = ("digits-sum", "digits-server-momentum", "digits-server-adam", "digits-aggregated", "large-adam")
KILL_CASE = "resume-after-kill"
CASES = (*COST_CASES, KILL_CASE)
PEER_NAME = "sluice, ps.recover = false"
REPLICAS_PEER_NAME = "sluice, ps.recover = true, ps.replicas = 0"
TARGET_COST = 10.0  # percent of the step time without recovery
LARGE = (32, 2048)  # bench/priority_training.py's VGG-like model, width and hidden: 8.55 M parameters

DESCRIPTION = f"""\
What server recovery (--set ps.recover=true) costs, and what it buys. With it, every server copies
its shard's committed state (values, momentum or Adam moments) into a /dev/shm file each round,
before it replies; a server killed with SIGKILL is restarted by the launcher and the workers send
it again what it left unanswered. Cases (--cases):

  digits-sum              bench/train_throughput.py's digits model and job: W workers, S servers,
                          collective.mode = ps (every tensor through the servers), SGD with
                          momentum on the workers (the servers sum), ms per step
  digits-server-momentum  the same with worker.optimizer_on = server, SGD with momentum
  digits-server-adam      the same with Adam on the servers (two moments per value to copy)
  digits-aggregated       digits-server-momentum through aggregators: workers in pairs, each pair
                          pushing to an aggregator, which forwards one sum to the servers
                          (aggregation.mode = static, one tree); an aggregator keeps and replays
                          its sums as workers do theirs
  large-adam              bench/priority_training.py's VGG-like model (width {LARGE[0]}, hidden {LARGE[1]}: 8.55 M
                          parameters), Adam on the servers, LW workers x S servers: the most state
                          to copy per round
  {KILL_CASE}       a `sluice launch` job (digits model, Adam on the servers, KW workers x S
                          servers, ps.recover = true) in which worker 0 SIGKILLs server 0 as step K
                          starts (bench/recovery_kill.py); every step's end is time-stamped

The first four are loopback LocalCluster jobs; each repetition is a pair of fresh jobs, recovery on
and off, in alternating order (on/off, then off/on) to cancel drift, each timing INNER repetitions
of STEPS steps after a warm-up. ours = ps.recover on, peer = off; cost = how much more time a step
takes with recovery, in percent (target <= {TARGET_COST:g}%); paired_cost = the median of each pair's
cost; state_mib = the size of the servers' state files, as a worker saw them after its last step.
With --replicas the same cost cases compare ps.replicas = 1 (each server's committed state also
mirrored on another server, ps/mirror.py; ps.mirror_same_host, as every server of a LocalCluster
is on this host) against ps.replicas = 0, ps.recover on in both: ours = replicas, peer = without;
their records' case names start with "replicas-". With --testbed (and --replicas) every process
of a job runs on a host of its own of the network-namespace testbed (root only), servers and workers
on links shaped to --rate-mbit (bench/recovery_testbed.py): the servers' mirrors cross real links,
so ps.mirror_same_host is not set; their case names start with "testbed-replicas-" ("testbed-bands-replicas-"
with --tos-bands). --replica-count N: ours keeps each server's state on N other hosts (give --servers N + 1
or more); the case names end in "-N-copies".

{KILL_CASE}: ours = seconds from the kill to the end of step K (the step that needed the
replacement for all of server 0's rounds: training resumed); peer = a normal step's time (the
median step of the same runs, steps 2.. but K and K+1), so ratio (= steps_lost) says how many
steps the recovery costs. Also: restart_s and back_s, from the kill to the launcher's
"restarting it" and the scheduler's "is back" lines as this process read them (behind by the
pipes); lost_s, how much longer step K took than a normal step; equal, whether every run ended
with bit-identical parameters to the same job without the kill.
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", choices=CASES,
                        help="cases to run (default: all; with --replicas, the cost cases)")
    parser.add_argument("--workers", type=int, default=4, metavar="W", help="digits-*: workers (default: %(default)s)")
    parser.add_argument("--servers", type=int, default=2, metavar="S",
                        help="servers of every case (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=16, metavar="B",
                        help="samples per worker per step, every case (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=100, metavar="N",
                        help="digits-*: timed steps per repetition (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=20, metavar="N",
                        help="digits-*: untimed steps first (default: %(default)s)")
    parser.add_argument("--inner", type=int, default=2, metavar="N",
                        help="timed repetitions inside each cost job (default: %(default)s)")
    parser.add_argument("--large-workers", type=int, default=2, metavar="LW",
                        help="large-adam: workers (default: %(default)s)")
    parser.add_argument("--large-steps", type=int, default=15, metavar="N",
                        help="large-adam: timed steps per repetition (default: %(default)s)")
    parser.add_argument("--large-warmup", type=int, default=3, metavar="N",
                        help="large-adam: untimed steps first (default: %(default)s)")
    parser.add_argument("--kill-workers", type=int, default=2, metavar="KW",
                        help=f"{KILL_CASE}: workers (default: %(default)s)")
    parser.add_argument("--kill-steps", type=int, default=60, metavar="N",
                        help=f"{KILL_CASE}: training steps of each job (default: %(default)s)")
    parser.add_argument("--kill-at", type=int, default=30, metavar="K",
                        help=f"{KILL_CASE}: the step at whose start server 0 is killed (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                        help="give up on one job after this long (default: %(default)s)")
    parser.add_argument("--replicas", action="store_true",
                        help="cost cases: ps.replicas = 1 against 0 (both with ps.recover) instead of ps.recover on "
                             "against off")
    parser.add_argument("--replica-count", type=int, default=1, choices=(1, 2, 3), metavar="N",
                        help="with --replicas: ps.replicas of the replicated jobs (default: %(default)s; N > 1 needs "
                             "--servers N + 1 or more to place every copy on another host)")
    parser.add_argument("--testbed", action="store_true",
                        help="with --replicas: run the cost cases on the network-namespace testbed (root)")
    parser.add_argument("--rate-mbit", type=float, default=1000.0, metavar="RATE",
                        help="--testbed: each server's and worker's link, both ways (default: %(default)s)")
    parser.add_argument("--mirror-every", type=int, default=None, metavar="N",
                        help="with --replicas: ps.mirror_every of the replicated jobs (default: what sluice launch "
                             "chooses for the case's worker count); the case names get -every-N")
    parser.add_argument("--peer-off", action="store_true",
                        help="with --replicas: the peer runs with ps.recover off too (what `sluice launch` chose "
                             "before replicas became its default for jobs whose servers span hosts); case names "
                             "get -vs-off")
    parser.add_argument("--tos-bands", action="store_true",
                        help="--testbed: the links honour the transport's ToS marks (pfifo_fast's three bands under "
                             "the shaper, as a switch that queues by DSCP): a MIRROR, on the least urgent channel, "
                             "then waits for the replies of the channels before it")
    add_common_options(parser, quick="1 pair of jobs, 2 digits workers, 1 timed repetition of 2 warm-up + 5 digits "
                                     "steps (1 + 2 large-adam steps), one killed job of 7 steps, killed at step 3 "
                                     "(overrides those options)", repeats=5)
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.inner, args.workers, args.steps, args.warmup = 1, 1, 2, 5, 2
        args.large_steps, args.large_warmup, args.kill_steps, args.kill_at = 2, 1, 7, 3
    if min(args.workers, args.servers, args.batch_size, args.steps, args.inner, args.repeats, args.large_workers,
           args.large_steps, args.kill_workers) < 1 or min(args.warmup, args.large_warmup) < 0:
        parser.error("workers, servers, batch size, steps, inner and repeats must be positive; warm-ups not negative")
    if not 3 <= args.kill_at <= args.kill_steps - 4:
        parser.error("--kill-at must leave 3 steps before it and 3 after it (normal steps to compare with)")
    args.cases = [c for c in CASES if c in (args.cases or (COST_CASES if args.replicas else CASES))]
    if args.replica_count != 1 and not (args.replicas and args.testbed):
        parser.error("--replica-count places copies on other hosts: give --replicas --testbed too")
    if args.testbed and not args.replicas:
        parser.error("--testbed measures ps.replicas: give --replicas too")
    if args.peer_off and not args.testbed:
        parser.error("--peer-off is a --testbed comparison: give --replicas --testbed too")
    if args.replicas and KILL_CASE in args.cases:
        parser.error(f"--replicas compares the cost cases only: leave {KILL_CASE} out of --cases")
    return args


# ---------------------------------------------------------------------------- step-time cost
@dataclass(frozen=True)
class Job:
    """One cost case's training job, as its workers run it."""

    model: str  # "digits" or "large"
    optimizer: str  # "sgd" (momentum 0.9) or "adam"
    optimizer_on: str  # worker.optimizer_on
    workers: int
    servers: int
    batch: int
    warmup: int
    steps: int
    inner: int
    aggregators: int = 0  # each sums the pushes of two consecutive workers (`aggregation`)


def aggregation(job: Job) -> dict[str, Any]:
    """The [aggregation] section of `job`: one static tree, workers 2i and 2i + 1 under aggregator i."""
    if not job.aggregators:
        return {}
    edges = " ".join(f"worker-{w}>aggregator-{w // 2}" for w in range(min(job.workers, 2 * job.aggregators)))
    return {"aggregation": {"mode": "static", "trees": [f"1: {edges}"]}}


def job_config(job: Job, ps: dict[str, Any]) -> dict[str, Any]:
    """The sections every process of `job` gets, with `ps` as its ps section."""
    return {"collective": {"mode": "ps"}, "worker": {"optimizer_on": job.optimizer_on}, "ps": ps, **aggregation(job)}


def jobs(args: argparse.Namespace) -> dict[str, Job]:
    digits = Job("digits", "sgd", "worker", args.workers, args.servers, args.batch_size, args.warmup, args.steps,
                 args.inner)
    return {
        "digits-sum": digits,
        "digits-server-momentum": replace(digits, optimizer_on="server"),
        "digits-server-adam": replace(digits, optimizer="adam", optimizer_on="server"),
        "digits-aggregated": replace(digits, optimizer_on="server", aggregators=(args.workers + 1) // 2),
        "large-adam": Job("large", "adam", "server", args.large_workers, args.servers, args.batch_size,
                          args.large_warmup, args.large_steps, args.inner),
    }


def make_model(job: Job) -> torch.nn.Module:
    return demo()[0]() if job.model == "digits" else priority_training.make_model(*LARGE)


def _state_bytes(tag: str) -> int:
    return sum(os.path.getsize(p) for p in glob.glob(os.path.join(STATE_DIR, f"sluice-state-{tag}-server-*")))


def train_worker(job: Job, x: torch.Tensor, y: torch.Tensor, tag: str) -> dict[str, Any]:
    """In a worker of a LocalCluster job (or a testbed job, bench/recovery_testbed.py): train `job`, timed as
    bench/train_throughput.py does."""
    import sluice.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(0)
    model = make_model(job)
    base = (torch.optim.Adam(model.parameters(), lr=0.001) if job.optimizer == "adam"
            else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    optimizer = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    rank, size, count = hvd.rank(), hvd.size(), job.warmup + job.steps
    if job.model == "digits":
        data = worker_batches(x, y, rank, size, job.batch, count)
    else:  # synthetic images, as bench/priority_training.py's (one batch per step: nothing to learn here)
        generator = torch.Generator().manual_seed(rank)
        data = (torch.randn(count, job.batch, 3, 32, 32, generator=generator),
                torch.randint(0, 10, (count, job.batch), generator=generator))
    result = timed_repeats(model, optimizer, data, job.warmup, job.steps, job.inner,
                           lambda name: hvd.barrier(name=name),
                           hvd.synchronize_parameters)
    result["state_bytes"] = _state_bytes(tag)  # the servers' files, still open: they go at a clean end
    hvd.shutdown()
    return result


def replicas_settings(replicas: bool, mirror_every: int | None, workers: int, peer_off: bool = False,
                      count: int = 1) -> dict[str, Any]:
    """The ps section of a --replicas job: ps.recover on, ps.replicas `count` (with `mirror_every`, if given, else
    what sluice launch chooses for `workers`) or 0 (`peer_off`: with ps.recover off too)."""
    every = mirror_every if mirror_every is not None else chosen_mirror_every(workers, count)
    return {"recover": replicas or not peer_off, "replicas": count if replicas else 0,
            **({"mirror_every": every} if replicas else {})}


def run_cost_job(job: Job, recover: bool, x: torch.Tensor, y: torch.Tensor, timeout: float,
                 replicas: bool | None = None, mirror_every: int | None = None) -> tuple[list[float], int]:
    """One job: ms per step of each timed repetition, and the bytes of the servers' state files. `replicas`
    (not None): ps.recover on, and ps.replicas 1 (True, mirrored on another server of this host) or 0."""
    ps: dict[str, Any] = {"recover": recover}
    if replicas is not None:
        ps = {**replicas_settings(replicas, mirror_every, job.workers), "mirror_same_host": True}
    with LocalCluster(job.workers, job.servers, job_config(job, ps), job.aggregators) as cluster:
        tag = state_tag(cluster.secret)
        try:
            results = cluster.run(train_worker, job, x, y, tag, timeout=timeout)
            cluster.wait()
        finally:  # a failed job leaves its servers' files: they are no one's once the job is gone
            remove_state_files(tag)
    state = int(results[0]["state_bytes"])
    recover = recover or replicas is not None
    if recover and not state:
        raise RuntimeError("ps.recover = true, yet the servers wrote no state file in /dev/shm: did they get the "
                           "setting (LocalCluster's config)?")
    if not recover and state:
        raise RuntimeError(f"ps.recover = false, yet the servers wrote {state} bytes of state files")
    return [s / job.steps * 1000 for s in results[0]["seconds"]], state


def cost_percent(ours: float, peer: float) -> float:
    return (ours / peer - 1) * 100


Runner = Callable[[Job, bool], tuple[list[float], int]]


def measure_cost(case: str, job: Job, args: argparse.Namespace, run: Runner) -> dict[str, Any]:
    """ours: `run(job, True)`, ps.recover on (with --replicas: ps.replicas = 1); peer: `run(job, False)`."""
    what = "replicas" if args.replicas else "recover"
    on: list[float] = []
    off: list[float] = []
    pairs: list[float] = []
    state = 0
    for pair in range(args.repeats):
        medians: dict[bool, float] = {}
        for recover in (True, False) if pair % 2 == 0 else (False, True):
            t0 = time.perf_counter()
            values, nbytes = run(job, recover)
            (on if recover else off).extend(values)
            medians[recover] = statistics.median(values)
            state = max(state, nbytes)
            figures = " ".join(f"{v:.2f}" for v in values)
            progress(f"  {case:<22} pair {pair + 1}/{args.repeats}  {what} {'on ' if recover else 'off'}  "
                     f"{figures} ms/step  ({time.perf_counter() - t0:.1f} s)")
        pairs.append(cost_percent(medians[True], medians[False]))
    ours, peer = stats(on), stats(off)
    cost = cost_percent(ours.median, peer.median)
    parameters = sum(p.numel() for p in make_model(job).parameters())
    where = "on the workers (servers sum)" if job.optimizer_on == "worker" else "on the servers"
    aggregated = f" through {job.aggregators} aggregators (2 workers each)" if job.aggregators else ""
    describe = (f"{job.model} model ({parameters / 1e6:.3g} M parameters), {job.workers} workers x {job.servers} "
                f"servers{aggregated}, batch {job.batch} per worker, collective.mode = ps, "
                f"{'Adam' if job.optimizer == 'adam' else 'SGD with momentum'} {where}")
    prefix = ("testbed-" if args.testbed else "") + ("bands-" if args.testbed and args.tos_bands else "") \
        + ("replicas-" if args.replicas else "")
    if args.testbed:
        describe += f", every process on its own testbed host, links {args.rate_mbit:g} Mbit/s"
        describe += " with ToS bands" if args.tos_bands else ""
    every = f"-every-{args.mirror_every}" if args.replicas and args.mirror_every is not None else ""
    every += "-vs-off" if args.replicas and args.peer_off else ""
    every += f"-{args.replica_count}-copies" if args.replicas and args.replica_count != 1 else ""
    return record(prefix + case + every, ours, peer,
                  (PEER_NAME if args.peer_off else REPLICAS_PEER_NAME) if args.replicas else PEER_NAME, "ms/step",
                  better="lower", cost=cost,
                  paired_cost=statistics.median(pairs), target_cost=TARGET_COST, met=cost <= TARGET_COST,
                  state_mib=state / (1 << 20), parameters=parameters, description=describe, pairs=args.repeats,
                  repetitions_per_job=args.inner, samples=len(on), **asdict(job),
                  **({"mirror_every": replicas_settings(True, args.mirror_every, job.workers,
                                                           count=args.replica_count)["mirror_every"],
                      "replicas": args.replica_count} if args.replicas else {}))


# ---------------------------------------------------------------------------- driver
def print_tables(records: list[dict[str, Any]], args: argparse.Namespace) -> None:
    def brief(rec: dict[str, Any], side: str, digits: int) -> str:
        return Stats(rec[side], rec[f"{side}_min"], rec[f"{side}_max"]).brief(digits)

    rows = [[rec["case"], brief(rec, "ours", 2), brief(rec, "peer", 2), f"{rec['state_mib']:.2f}",
             f"{rec['cost']:+.1f}%", f"{rec['paired_cost']:+.1f}%", f"<= {rec['target_cost']:g}%",
             "met" if rec["met"] else "MISSED"] for rec in records if rec["case"] != KILL_CASE]
    if rows:
        what = ((f"ps.replicas {args.replica_count}", "recover off" if args.peer_off else "0") if args.replicas else
                ("recover on", "recover off"))
        progress(f"\n{what[0]} against {what[1]}, median [min..max] of {args.repeats} pairs x {args.inner} "
                 f"repetitions; cost = extra step time with {what[0]}")
        print_table(["case", f"ms/step {what[0]}", what[1], "state MiB", "cost", "paired cost", "target", ""], rows)
    for rec in records:
        if rec["case"] == KILL_CASE:
            progress(f"\nserver 0 killed as step {rec['kill_at']} starts, median [min..max] of {rec['runs']} jobs; "
                     "steps lost = (kill -> step done) / normal step")
            print_table(["case", "kill -> step done s", "normal step s", "steps lost", "restart line s",
                         "back line s", "equal"],
                        [[rec["case"], brief(rec, "ours", 3), brief(rec, "peer", 4), f"{rec['ratio']:.1f}",
                          f"{rec['restart_s']:.3f}", f"{rec['back_s']:.3f}", str(rec["equal"]).lower()]])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    quiet = logging.StreamHandler()  # Sluice's warnings reach stderr, its INFO lines do not (see curve_cost)
    quiet.setLevel(logging.WARNING)
    logging.getLogger("sluice").addHandler(quiet)
    # The first optimizer a process builds imports torch._dynamo (1.3 s here); do it once before forking.
    torch.optim.Adam([torch.zeros(1, requires_grad=True)], lr=0.001)
    _, load_data = demo()
    x, y, _, _ = load_data()
    pair = f"ps.replicas {args.replica_count}, 0" if args.replicas else "ps.recover on, off"
    killed = f", {args.repeats} killed jobs" if KILL_CASE in args.cases else ""
    progress(f"recovery: cases {', '.join(args.cases)}; {args.repeats} pairs of jobs ({pair}) with "
             f"{args.inner} timed repetitions each{killed}")
    started = time.perf_counter()
    records = []
    cost_cases = {case: job for case, job in jobs(args).items() if case in args.cases}
    if args.testbed and cost_cases:
        if not ready_for("recovery --testbed"):
            return 0
        with testbed(args.rate_mbit, args.tos_bands, max(j.servers for j in cost_cases.values()),
                     max(j.workers for j in cost_cases.values()), max(j.aggregators for j in cost_cases.values())
                     ) as bed:

            def on_testbed(job: Job, replicas: bool) -> tuple[list[float], int]:
                settings = replicas_settings(replicas, args.mirror_every, job.workers, args.peer_off,
                                             args.replica_count)
                return run_testbed_job(bed, job, settings, args.timeout), 0

            for case, job in cost_cases.items():
                progress(f"{case}:")
                records.append(measure_cost(case, job, args, on_testbed))
    else:
        for case, job in cost_cases.items():
            progress(f"{case}:")
            records.append(measure_cost(case, job, args, lambda job, on: run_cost_job(
                job, on, x, y, args.timeout, on if args.replicas else None, args.mirror_every)))
    if KILL_CASE in args.cases:
        progress(f"{KILL_CASE}:")
        records.append(kill_record(KILL_CASE, args))
    progress(f"\n{time.perf_counter() - started:.0f} s in all")
    print_tables(records, args)
    write_json(args.json, records)
    if any(rec.get("equal") is False for rec in records):  # a finding of correctness, not of speed: fail
        print(f"{KILL_CASE}: a job whose server was killed ended with other parameters than the same job "
              "without the kill: recovery lost or repeated an update", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
