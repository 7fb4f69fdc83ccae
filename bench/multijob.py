"""Several jobs sharing one bottleneck: average job completion time with job priorities ([jobs]) against none."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass

if __package__ in (None, ""):  # run as `python bench/multijob.py`: make the repo root importable
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))

import numpy as np

from bench.common import add_common_options, print_table, progress, write_json
from sluice.transport.config import TransportConfig
from sluice.worker.job_priority import JobLevel, JobsConfig
from testbed.job import emit_result, run_sluice_job
from testbed.netbed import Netbed, ready_for

DESCRIPTION = """\
Six jobs (one worker and one server each, compute stubbed out) arrive one after another and share
one bottleneck: every job's server runs on one host whose link (both ways) is shaped with one htb
class per channel's ToS mark, most urgent first (netbed tos_classes). Four jobs are short and two are
--long-factor times longer; the long ones arrive first. The same schedule runs twice:

  no marks        transport.marks = false: every job's packets in one band, the link shared FIFO
  priorities      [jobs] priorities = true: a job's first --early rounds on channel 0 (the top band),
                  then a level lower each time a worker has pushed --thresholds MiB (PIAS / Tiresias)

and each short job also runs alone. A job's completion time (JCT) runs from its first round's start
to its last round's end. Targets (issue 8): average JCT >= 25% lower with priorities (speedup =
average JCT without / with >= 1.33); no job worse than 1.5x its JCT without priorities; a new job's
first --early rounds within 1.2x of the same rounds alone.
"""

NO_MARKS, PRIORITIES, ALONE = "no marks", "priorities", "alone"
TARGET_SPEEDUP, TARGET_WORST, TARGET_EARLY = 1 / 0.75, 1.5, 1.2
#: each channel's ToS mark, channel 0 (the top level) first: the bottleneck has an htb class per mark
MARKS = TransportConfig(channels=3).channel_tos()
#: the share of a schedule's bytes a class may miss its expected bytes by (headers, acks, control)
BAND_SLACK = 0.1


@dataclass(frozen=True)
class Work:
    floats: int
    rounds: int


def worker_main(spec: str) -> int:
    from sluice.worker.node import WorkerNode

    work = Work(**json.loads(spec))
    node = WorkerNode()
    client = node.ps
    client.declare([("grad", (work.floats,), "float32", None)])
    data, out = np.ones(work.floats, np.float32), np.empty(work.floats, np.float32)
    starts, ends = [], []
    for _ in range(work.rounds):
        starts.append(time.time())  # wall clock: comparable between the jobs' processes
        client.push_pull("grad", data, out).wait()
        ends.append(time.time())
    if not np.all(out == client.size):
        raise SystemExit(f"the round summed {out[0]}, not {client.size}")
    job = client.job_level
    level, promotions = (job.level, job.promotions) if job is not None else (None, 0)
    node.close()
    emit_result({"starts": starts, "ends": ends, "level": level, "promotions": promotions})
    return 0


@dataclass(frozen=True)
class Job:
    name: str
    rounds: int
    arrival: float  # seconds after the schedule starts


def schedule(args: argparse.Namespace) -> list[Job]:
    longs = [Job(f"long{i}", args.short_rounds * args.long_factor, i * args.gap) for i in range(args.long)]
    first_short = args.long * args.gap + args.gap
    shorts = [Job(f"short{i}", args.short_rounds, first_short + i * args.gap) for i in range(args.short)]
    return longs + shorts


def job_config(mode: str, args: argparse.Namespace, bed: Netbed, job: int) -> dict[str, dict[str, object]]:
    transport: dict[str, object] = {"chunk_bytes": args.chunk_kib << 10, "inflight_bytes": args.chunk_kib << 10}
    if mode == NO_MARKS:
        return {"transport": {**transport, "marks": False}}
    return {"transport": transport, "jobs": {"priorities": True, "early_rounds": args.early,
                                             "thresholds_mib": list(args.thresholds)}}


def jobs_config(args: argparse.Namespace) -> JobsConfig:
    return JobsConfig(priorities=True, early_rounds=args.early, thresholds_mib=tuple(args.thresholds))


def expected_mib(jobs: list[Job], mode: str, args: argparse.Namespace) -> dict[int, float]:
    """MiB of pushes each ToS class should carry, by the policy itself (with no promotion): what the
    bottleneck's counters must show if the levels land in the bands."""
    if mode == NO_MARKS:
        return {tos: (sum(j.rounds for j in jobs) * args.mib if tos == 0 else 0.0) for tos in MARKS}
    config = jobs_config(args)
    mib = dict.fromkeys(MARKS, 0.0)
    for job in jobs:
        level = JobLevel(config, len(MARKS))
        for round_ in range(1, job.rounds + 1):
            mib[MARKS[level.on_push(round_, args.mib << 20, 0.0)]] += args.mib
    return mib


def check_bands(bed: Netbed, before: dict[int | None, int], jobs: list[Job], mode: str, args: argparse.Namespace,
                exact: bool) -> dict[str, dict[str, float]]:
    """The bytes that crossed the bottleneck towards the servers in each ToS class, against the policy's;
    raises if they differ by more than BAND_SLACK (unless a promotion moved a job's later rounds up)."""
    after = bed.class_bytes("srv", "in")
    measured = {tos: (after[tos] - before[tos]) / (1 << 20) for tos in after}
    expected = expected_mib(jobs, mode, args)
    total = sum(expected.values())
    off = [f"0x{tos:02x}: {measured[tos]:.1f} MiB, expected {want:.1f}" for tos, want in expected.items()
           if abs(measured[tos] - want) > BAND_SLACK * total]
    progress(f"  {mode}: MiB into the servers' host by ToS class " + ", ".join(
        f"0x{tos:02x} {measured[tos]:.1f} (policy {expected[tos]:.1f})" for tos in MARKS)
        + f", unclassified {measured[None]:.1f}" + (f"; OFF: {'; '.join(off)}" if off else ""))
    if off and exact:
        raise RuntimeError(f"{mode}: the bytes did not land in the ToS classes the levels map to: {'; '.join(off)}")
    return {f"0x{tos:02x}": {"measured_mib": measured[tos], "expected_mib": expected[tos]} for tos in MARKS}


Results = dict[str, dict[str, float]]  # job name -> jct, early, start, promotions


def run_schedule(bed: Netbed, jobs: list[Job], mode: str, args: argparse.Namespace) -> tuple[Results, Results]:
    """Every job of the schedule in `mode`, started at its arrival: each job's JCT and early-rounds time;
    and the MiB each ToS class carried towards the servers, measured and by the policy."""
    results: Results = {}
    errors: list[str] = []
    before = bed.class_bytes("srv", "in")
    begin = time.monotonic()

    def one(index: int, job: Job) -> None:
        time.sleep(max(0.0, begin + job.arrival - time.monotonic()))
        host = f"j{index}"
        argv = [sys.executable, "-m", "bench.multijob", "--worker",
                json.dumps(asdict(Work(args.mib << 18, job.rounds)))]
        try:
            got = run_sluice_job(bed, host, ["srv"], [host], job_config(mode, args, bed, index), argv,
                                 timeout=args.timeout, echo=args.verbose)[0]
        except Exception as exc:  # the schedule fails as a whole, naming the job
            errors.append(f"{mode} {job.name}: {exc}")
            return
        starts, ends = got["starts"], got["ends"]
        early = min(args.early, len(starts)) - 1
        results[job.name] = {"jct": ends[-1] - starts[0], "early": ends[early] - starts[0], "start": starts[0],
                             "promotions": got["promotions"]}
        progress(f"  {mode} {job.name}: {job.rounds} rounds in {ends[-1] - starts[0]:.1f} s, first {early + 1} in "
                 f"{ends[early] - starts[0]:.2f} s, level at the end {got['level']}, {got['promotions']} promotions")

    threads = [threading.Thread(target=one, args=(i, job)) for i, job in enumerate(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise RuntimeError("; ".join(errors))
    promotions = sum(int(r["promotions"]) for r in results.values())
    return results, check_bands(bed, before, jobs, mode, args, exact=promotions == 0)


def build(bed: Netbed, jobs: int, args: argparse.Namespace) -> None:
    # htb classes matched on the ToS byte, most urgent first (with a 1% floor each: no band starves
    # outright); pfifo_fast's bands would see only locally made packets' priority, not forwarded ones
    bed.host("srv", args.mbit, tos_classes=MARKS)
    for index in range(jobs):
        bed.host(f"j{index}", args.host_mbit)
    for host in bed.hosts:
        bed.sysctl(host, "net.ipv4.tcp_slow_start_after_idle", "0")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--short", type=int, default=4, help="short jobs (default: %(default)s)")
    parser.add_argument("--long", type=int, default=2, help="long jobs, arriving first (default: %(default)s)")
    parser.add_argument("--short-rounds", type=int, default=12, help="rounds of a short job (default: %(default)s)")
    parser.add_argument("--long-factor", type=int, default=8, help="a long job's rounds over a short one's "
                        "(default: %(default)s)")
    parser.add_argument("--gap", type=float, default=4.0, help="seconds between arrivals (default: %(default)s)")
    parser.add_argument("--mib", type=int, default=1, help="MiB each job's worker pushes (and pulls) a round "
                        "(default: %(default)s)")
    parser.add_argument("--mbit", type=float, default=20.0, help="the bottleneck (the servers' host link), "
                        "Mbit/s each way (default: %(default)s)")
    parser.add_argument("--host-mbit", type=float, default=100.0, help="every worker host's link "
                        "(default: %(default)s)")
    parser.add_argument("--chunk-kib", type=int, default=64, help="chunk size, one chunk in flight per peer "
                        "(default: %(default)s)")
    parser.add_argument("--early", type=int, default=3, help="jobs.early_rounds: rounds at the top band "
                        "(default: %(default)s)")
    parser.add_argument("--thresholds", type=lambda s: [float(v) for v in s.split(",")], default=None,
                        help="jobs.thresholds_mib, comma-separated (default: a quarter of a short job's bytes, "
                             "and all of them: as PIAS derives its thresholds from the size distribution, a short "
                             "job never reaches the bottom level, and a long one gets there once it has sent "
                             "as much as a short job)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a job may take (default: %(default)s)")
    parser.add_argument("--verbose", action="store_true", help="echo every process's output")
    parser.add_argument("--worker", metavar="JSON", help=argparse.SUPPRESS)
    add_common_options(parser, "1 long and 2 short jobs of 3 and 6 rounds, 40 Mbit/s, 0.5 s apart", repeats=1)
    args = parser.parse_args(argv)
    if args.quick:
        args.short, args.long, args.short_rounds, args.long_factor, args.gap, args.mbit = 2, 1, 3, 2, 0.5, 40.0
        args.early = 1
    if args.thresholds is None:
        short_mib = args.short_rounds * args.mib
        args.thresholds = [short_mib / 4, float(short_mib)]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args.worker)
    if not ready_for("multijob"):
        return 0
    jobs = schedule(args)
    runs: dict[str, list[Results]] = {NO_MARKS: [], PRIORITIES: [], ALONE: []}
    bands: dict[str, Results] = {}  # the last repeat's
    with Netbed(queue_ms=1000) as bed:
        build(bed, len(jobs), args)
        for repeat in range(args.repeats):
            for mode in (NO_MARKS, PRIORITIES):
                progress(f"repeat {repeat + 1}/{args.repeats}: {len(jobs)} jobs, {mode} ...")
                results, bands[mode] = run_schedule(bed, jobs, mode, args)
                runs[mode].append(results)
            progress(f"repeat {repeat + 1}/{args.repeats}: a short job alone ...")
            alone = Job("short0", args.short_rounds, 0.0)
            results, bands[ALONE] = run_schedule(bed, [alone], PRIORITIES, args)
            runs[ALONE].append(results)

    def median(mode: str, job: str, what: str) -> float:
        return statistics.median(run[job][what] for run in runs[mode])

    rows, ratios, earlies = [], [], []
    alone_early = median(ALONE, "short0", "early")
    for job in jobs:
        without, with_ = median(NO_MARKS, job.name, "jct"), median(PRIORITIES, job.name, "jct")
        ratios.append(with_ / without)
        early = median(PRIORITIES, job.name, "early")
        if job.name.startswith("short"):
            earlies.append(early / alone_early)
        rows.append([job.name, str(job.rounds), f"{job.arrival:g}", f"{without:.1f}", f"{with_:.1f}",
                     f"{with_ / without:.2f}", f"{early / alone_early:.2f}" if job.name.startswith("short") else ""])
    avg_without = statistics.mean(median(NO_MARKS, j.name, "jct") for j in jobs)
    avg_with = statistics.mean(median(PRIORITIES, j.name, "jct") for j in jobs)
    speedup, worst, worst_early = avg_without / avg_with, max(ratios), max(earlies)
    progress(f"\nJCT in s (median of {args.repeats}); early: the first {args.early} rounds with priorities over "
             f"the same rounds alone ({alone_early:.2f} s)")
    print_table(["job", "rounds", "arrives s", "no marks", "priorities", "with/without", "early vs alone"], rows)
    checks = [("average JCT without / with", speedup, f">= {TARGET_SPEEDUP:.2f}", speedup >= TARGET_SPEEDUP),
              ("worst job, with / without", worst, f"<= {TARGET_WORST}", worst <= TARGET_WORST),
              ("worst early rounds vs alone", worst_early, f"<= {TARGET_EARLY}", worst_early <= TARGET_EARLY)]
    print_table(["measure", "value", "target", ""],
                [[name, f"{value:.2f}", target, "PASS" if ok else "FAIL"] for name, value, target, ok in checks])
    write_json(args.json, [{
        "case": f"{len(jobs)} jobs, {args.long} x{args.long_factor} long", "ours": avg_with, "peer": avg_without,
        "peer_name": "no marks", "unit": "s average JCT", "better": "lower", "ratio": avg_with / avg_without,
        "speedup": speedup, "worst_job_ratio": worst, "worst_early_vs_alone": worst_early,
        "jobs": {j.name: {"rounds": j.rounds, "arrival": j.arrival, "jct_no_marks": median(NO_MARKS, j.name, "jct"),
                          "jct_priorities": median(PRIORITIES, j.name, "jct")} for j in jobs},
        "met": {name: ok for name, _, _, ok in checks},
        "mib_into_servers_by_tos": bands,
        "promotions": {mode: sum(int(r["promotions"]) for run in runs[mode] for r in run.values()) for mode in runs},
    }])
    return 0


if __name__ == "__main__":
    sys.exit(main())
