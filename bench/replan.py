"""One rack uplink throttled mid-run: how soon the measured re-plan is in force, and how it does against a fresh one."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

if __package__ in (None, ""):  # run as `python bench/replan.py`: make the repo root importable
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))

import numpy as np

from bench.aggregation_setup import PLANNED, UNSHAPED_MBIT, Layout, build_testbed, job_config
from bench.common import add_common_options, progress
from bench.replan_report import report
from sluice.launch.run_options import ENV_LOG_TIME
from sluice.scheduler.hierarchy.config import AggregationConfig
from testbed.job import emit_result, run_sluice_job
from testbed.netbed import Netbed, ready_for
from testbed.replan_steps import Finding, evidence, false_alarms, false_mends, first_switch, parse_line, steps, switches

#: aggregation.report_s of the kept job: its agents never report within it, so nothing re-plans its first trees
STALE_REPORT_S = 3600.0
DESCRIPTION = f"""\
The aggregation testbed (bench/aggregation.py's racks, planned weighted trees, aggregation.mode =
"plan", agents reporting every --period s), every shaped link serving DSCP classes first as switches
do: network control (CS6, the scheduler's messages, scheduler.control_tos) and AF42 (channel 0: the
nodes' messages to the scheduler, and the one-int vote each round; the gradient goes on channel 1).
Two jobs run in turn:

  re-plan   the job plans for the configured uplinks; --throttle-after s after those first trees came
            into force the uplink of rack r0 is cut to a quarter (netbed set_uplink); the agents' reports
            show the rack's senders backlogged for peers outside it, the manager measures the uplink
            (scheduler/hierarchy/uplinks.py), re-plans, and the workers switch trees between rounds
  fresh     a job started with the uplink already cut, told so in its config (uplinks = r0: RATE),
            so that its first plan is the one a re-plan should reach
  kept      a job started with the uplink already cut whose agents never report (aggregation.report_s
            = {STALE_REPORT_S:g} s), so that it keeps the trees planned for the configured uplinks: what the
            re-plan buys, and what the round in flight at the switch ran on

  mended    in the re-plan job, --restore-after s after the cut r0's uplink is set back to its rate; the
            trees planned around the cut leave it lightly loaded, so it no longer holds the job back: the
            manager counts it at its configured rate again once its traffic crossed it periods running
            without keeping a sender waiting (uplinks.py eased), or at once in such a period when its
            flows were acknowledged much sooner than before (uplinks.py SOONER), and re-plans; its
            rounds after, against the rounds before the cut

Every worker checks every round's sum (integer-valued data: exact), so an update lost or counted twice
across the switch fails the run. Figures: the time from the throttle to the first round under the new
trees, in measurement periods (target <= 2), and where it went (the evidence's period, the scheduler
taking it, the uplink counted, the plan, ROUTES, COMMIT sent and received, the first round on the new
trees: the scheduler's timed log lines and the workers' COMMIT arrivals); the median round time after
it against the fresh plan's (target within 15%); uplinks counted too slow that were not, and switches
with nothing changed (before the cut, and in the fresh job): target 0.
"""

#: aggregation.change: a measured rate this far below the configured one re-plans
CHANGE = AggregationConfig().change
#: how long a job may take to bring its first trees into force before its timeline starts regardless
FIRST_PLAN_S = 60.0
#: the scheduler's lines that say how far a re-plan got (uplinks seen and counted, the plan, the switch's messages)
SCHEDULER_STEPS = r"uplink of rack|re-planning|aggregation plan|routing epoch|planning"
#: the DSCP classes every link serves first, in order, as switches do: network control (CS6, the scheduler's
#: messages: scheduler.control_tos) and AF42 (channel 0: the most urgent tensors, and the nodes' messages to
#: the scheduler, which ride channel 0); the rest shares one FIFO class, as all traffic did without classes
CLASSES = (0xC0, 0x90)


def configured(layout: Layout) -> dict[str, float]:
    """Each rack's uplink as configured (the servers' is not shaped)."""
    return {**{f"r{r}": layout.uplink_mbit for r in range(layout.racks)}, "srv": UNSHAPED_MBIT}


@dataclass(frozen=True)
class Work:
    floats: int
    stop_file: str  # rounds go on (every worker the same number) until this file exists
    stop_at: float  # or until this wall-clock time (a bound, should the runner never write it)


def worker_main(spec: str) -> int:
    from sluice.worker.node import WorkerNode

    work = Work(**json.loads(spec))
    node = WorkerNode()
    client = node.ps
    # declared first, the one-int vote is the urgent tensor (channel 0, AF42); the gradient goes on channel 1
    client.declare([("go", (1,), "int32", None), ("grad", (work.floats,), "float32", None)])
    data, out, go = client.alloc((work.floats,), "float32"), np.empty(work.floats, np.float32), np.zeros(1, np.int32)
    data[:] = client.rank + 1
    want = client.size * (client.size + 1) / 2
    rounds: list[tuple[float, float, int]] = []
    grad = client._tensors["grad"]
    while True:
        started = time.time()
        client.push_pull("grad", data, out).wait()
        # the trees this round's pushes took: a round started during a switch was held until COMMIT and took
        # the new trees, so it started (on the network) when COMMIT came
        epoch = client._router.epoch_of(grad.key, grad.round)
        started = max(started, client._router.committed_at.get(epoch, 0.0))
        rounds.append((started, time.time(), epoch))
        if not (out[0] == want and np.all(out == want)):
            raise SystemExit(f"worker {client.rank}: round {len(rounds)} summed {out[0]}, not {want}")
        going = time.time() < work.stop_at and not os.path.exists(work.stop_file)
        client.push_pull("go", np.array([going], np.int32), go).wait()
        if go[0] < client.size:  # every worker sees the same votes: all stop after the same round
            break
    committed = dict(client._router.committed_at)  # when each epoch's COMMIT reached this worker
    moved = dict(client._router.moved_at)  # when its pushes of a round in flight first left on an epoch's trees
    node.close()
    emit_result({"rank": client.rank, "rounds": rounds, "committed": committed, "moved": moved})
    return 0


@dataclass
class Job:
    """What one job left: each worker's rounds (start, end, epoch), COMMIT arrivals and pushes moved onto the
    new trees inside a round by epoch, the scheduler's timed log lines, and when r0's uplink was cut and set
    back (None: it was not)."""

    workers: list[list[tuple[float, float, int]]]
    committed: list[dict[int, float]]
    moved: list[dict[int, float]]
    lines: list[tuple[float, str]]
    cut: float | None
    restored: float | None = None


def run_job(bed: Netbed, layout: Layout, config: dict[str, Any], seconds: float, args: argparse.Namespace,
            throttle_at: float | None = None, restore_after: float = 0.0) -> Job:
    """Run one job for `seconds` of rounds after its first trees came into force; with `throttle_at` (s after
    that), cut r0's uplink to a quarter then, and with `restore_after`, set it back to its configured rate that
    many seconds later. (Timed from the first trees, not the start: on a loaded machine the start alone took
    more than 5 s.)"""
    stop_file = os.path.join(tempfile.mkdtemp(prefix="sluice-replan-"), "stop")
    spec = json.dumps(asdict(Work(args.mib << 18, stop_file, time.time() + seconds + FIRST_PLAN_S)))
    argv = [sys.executable, "-m", "bench.replan", "--worker", spec]
    cut: list[float] = []
    planned = threading.Event()  # the first trees' COMMIT went out
    ended = threading.Event()  # no change to the links once the job is over (the next job runs on them)

    def timeline() -> None:
        planned.wait(FIRST_PLAN_S)
        began = time.time()
        if throttle_at is not None and not ended.wait(throttle_at):
            bed.set_uplink("r0", layout.uplink_mbit / 4)
            cut.append(time.time())
            progress(f"  uplink of r0 cut to {layout.uplink_mbit / 4:g} Mbit/s")
            if restore_after and not ended.wait(restore_after):
                bed.set_uplink("r0", layout.uplink_mbit)
                cut.append(time.time())
                progress(f"  uplink of r0 back to {layout.uplink_mbit:g} Mbit/s")
        if not ended.wait(max(0.0, began + seconds - time.time())):
            open(stop_file, "w").close()

    threading.Thread(target=timeline, daemon=True).start()
    lines: list[tuple[float, str]] = []

    def scheduler_line(label: str, text: str) -> None:
        if label == "scheduler" and (timed := parse_line(text)) is not None:
            lines.append(timed)
            if switches([timed]):  # a COMMIT: the first trees came into force
                planned.set()

    try:
        results = run_sluice_job(bed, "sched", layout.server_hosts, layout.worker_hosts, config, argv,
                                 aggregators=layout.worker_hosts, timeout=seconds + FIRST_PLAN_S + 120,
                                 echo=args.verbose, env={ENV_LOG_TIME: "1"}, on_line=scheduler_line)
    finally:
        ended.set()
        shutil.rmtree(os.path.dirname(stop_file), ignore_errors=True)
    return Job([[tuple(r) for r in w["rounds"]] for w in results],
               [{int(e): t for e, t in w["committed"].items()} for w in results],
               [{int(e): t for e, t in w["moved"].items()} for w in results], lines, cut[0] if cut else None,
               cut[1] if len(cut) > 1 else None)


def round_times(workers: list[list[tuple[float, float, int]]]) -> list[tuple[float, float, int]]:
    """Round by round: (start of the first worker, seconds of the slowest, epoch of the first worker)."""
    rounds = []
    for i in range(min(len(w) for w in workers)):
        start = min(w[i][0] for w in workers)
        rounds.append((start, max(w[i][1] for w in workers) - start, max(w[i][2] for w in workers)))
    return rounds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--racks", type=int, default=4, help="racks of workers (default: %(default)s)")
    parser.add_argument("--per-rack", type=int, default=4, help="worker hosts per rack (default: %(default)s)")
    parser.add_argument("--servers", type=int, default=4, help="server hosts (default: %(default)s)")
    parser.add_argument("--link-mbit", type=float, default=10.0, help="host links, Mbit/s (default: %(default)s)")
    parser.add_argument("--ratio", type=int, default=4, help="oversubscription of the uplinks (default: %(default)s)")
    parser.add_argument("--mib", type=int, default=1, help="gradient MiB per worker a round (default: %(default)s)")
    parser.add_argument("--chunk-kib", type=int, default=16, help="chunk size in KiB (default: %(default)s)")
    parser.add_argument("--period", type=float, default=1.0, help="aggregation.report_s: the agents' measurement "
                        "period, s (default: %(default)s)")
    parser.add_argument("--throttle-after", type=float, default=30.0, help="seconds after the job's first trees came "
                        "into force that r0's uplink is cut (default: %(default)s)")
    parser.add_argument("--restore-after", type=float, default=25.0, help="seconds after the cut that r0's uplink "
                        "is set back to its configured rate; 0: never (default: %(default)s)")
    parser.add_argument("--seconds", type=float, default=90.0, help="how long each job runs rounds once its "
                        "first trees came into force (default: %(default)s)")
    parser.add_argument("--uplink-periods", type=int, default=AggregationConfig().uplink_periods,
                        help="aggregation.uplink_periods: periods running an uplink must hold the job back before "
                        "it counts (default: %(default)s)")
    parser.add_argument("--verbose", action="store_true", help="echo every process's output")
    parser.add_argument("--worker", metavar="JSON", help=argparse.SUPPRESS)
    add_common_options(parser, "2 racks x 2 workers, 2 servers, 40 Mbit/s links, the uplink cut 3 s into a "
                       "17 s job and set back 8 s later, 7 s fresh and kept jobs (each timed from its first trees)",
                       repeats=1)
    args = parser.parse_args(argv)
    #: how long the fresh and kept jobs run rounds: as long as the re-plan job's under the cut, and 10 s to settle
    args.fresh_seconds = (args.restore_after or args.seconds - args.throttle_after) + 10
    if args.quick:
        args.racks, args.per_rack, args.servers, args.link_mbit = 2, 2, 2, 40.0
        # 8 s under the cut: a loaded machine's clean-clone suite once saw the cut's trees come in after 5 s
        args.throttle_after, args.restore_after, args.seconds, args.fresh_seconds = 3.0, 8.0, 17.0, 7.0
    if args.restore_after and args.throttle_after + args.restore_after + 5 > args.seconds:
        parser.error("--seconds must leave at least 5 s of the job after --throttle-after + --restore-after")
    return args


def replan_run(bed: Netbed, layout: Layout, config: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The re-plan job: when the new trees came into force, the rounds under them, each step's time."""
    job = run_job(bed, layout, config, args.seconds, args, throttle_at=args.throttle_after,
                  restore_after=args.restore_after)
    rounds, cut = round_times(job.workers), job.cut
    assert cut is not None
    before = max((e for s, _, e in rounds if s <= cut), default=0)
    until = job.restored or float("inf")
    switched = [(s, d, e) for s, d, e in rounds if until > s > cut and e > before]
    if not switched:
        raise RuntimeError("no new trees came into force after the throttle\n" + why_no_switch(job, rounds, cut, args))
    # the steps are the first switch's after the cut; a later switch's trees may be the first a round takes
    epoch = first_switch(job.lines, cut) or switched[0][2]
    committed, moved, carried = switch_times(job, epoch, switched[0][0])
    timed = steps(job.lines, cut, args.period, "r0", epoch, committed, switched[0][0], moved)
    flagged = evidence(job.lines, cut, args.period)
    progress(f"  new trees (epoch {switched[0][2]}) carry pushes {carried - cut:.1f} s after the cut, the first round "
             f"under them {switched[0][0] - cut:.1f} s; {len(switched)} rounds under them")
    progress("  " + "; ".join(f"{step} {'-' if t is None else f'{t:.2f}'}" for step, t in timed.items()))
    progress(f"  seen after the cut: {said(flagged)}")
    wrong = false_alarms(job.lines, configured(layout), CHANGE, "r0", cut)
    mended_early = false_mends(job.lines, "r0", cut, job.restored, args.period)
    if mended_early:
        progress(f"  counted mended while still cut: period(s) {', '.join(map(str, mended_early))}")
    # the round the switch waited for: the last one started on the old trees
    in_flight = [d for s, d, e in rounds if s < switched[0][0] and e <= before]
    return {"delay": (carried - cut) / args.period, "first_round": (switched[0][0] - cut) / args.period,
            "after": [d for _, d, _ in switched[2:] or switched[-1:]],
            "steps": timed, "false_alarms": wrong, "false_mends": mended_early,
            "epochs_after_cut": len({e for *_, e in switched}),
            "measured": [m for r, _, m, c, _ in flagged if r == "r0" and c], "round_in_flight": in_flight[-1],
            "switches_before_cut": switches(job.lines, before=cut) - 1,
            "restore": restore_run(job, rounds, planned_rounds(rounds, cut, before), args)}


def switch_times(job: Job, epoch: int, first_round: float) -> tuple[list[float], float | None, float]:
    """For the switch to routing `epoch`: when each worker received its COMMIT, when the first pushes of a round
    in flight left on its trees (None: none moved), and from when its trees carried pushes (the earlier of that
    and `first_round`, the start of the first round under them)."""
    committed = [times[epoch] for times in job.committed if epoch in times]
    moved = min((times[epoch] for times in job.moved if epoch in times), default=None)
    return committed, moved, first_round if moved is None else min(first_round, moved)


def why_no_switch(job: Job, rounds: list[tuple[float, float, int]], cut: float, args: argparse.Namespace) -> str:
    """What a run that saw no switch under the cut did: its rounds, the evidence the manager saw, and the
    scheduler's re-planning lines after the cut (a failure in a loaded suite then says which step never came)."""
    timeline = ", ".join(f"{s - cut:+.1f}s {d:.1f}s e{e}" for s, d, e in rounds)
    lines = [f"  {at - cut:+.1f}s {text}" for at, text in job.lines if at >= cut and re.match(SCHEDULER_STEPS, text)]
    return "\n".join([f"rounds (start from the cut, seconds, epoch): {timeline}",
                      f"seen after the cut: {said(evidence(job.lines, cut, args.period))}",
                      "the scheduler after the cut:", *lines[:40]])


def said(flagged: list[Finding]) -> str:
    """The uplink evidence (testbed/replan_steps.py evidence) as the runs print it: the rule that counted, and
    in brackets what was acknowledged across the uplink."""
    return ", ".join(f"{r} p{p} {m:g}{'' if t is None else f' [{t:g}]'}{f' counted ({c})' if c else ''}"
                     for r, p, m, c, t in flagged) or "nothing"


def planned_rounds(rounds: list[tuple[float, float, int]], cut: float, epoch: int) -> list[float]:
    """The last ten rounds' times before the cut on the trees in force then (routing `epoch`, planned for the
    configured uplinks), or the last ten of any trees where none ran on those (a short job's plan came late)."""
    before = [(d, e) for s, d, e in rounds if s <= cut]
    return [d for d, e in before if e == epoch][-10:] or [d for d, _ in before][-10:] or [rounds[0][1]]


def restore_run(job: Job, rounds: list[tuple[float, float, int]], planned: list[float],
                args: argparse.Namespace) -> dict[str, Any] | None:
    """After r0's uplink was set back (None: it was not): when trees planned for it came into force (delay None:
    never), the rounds under them against `planned` (the rounds before the cut, under the configured plan)."""
    restored = job.restored
    if restored is None:
        return None
    in_force = max((e for s, _, e in rounds if s <= restored), default=0)
    back = [(s, d, e) for s, d, e in rounds if s > restored and e > in_force]
    flagged = evidence(job.lines, restored, args.period)
    progress(f"  seen after the uplink was mended: {said(flagged)}")
    if not back:  # the rounds it ran on the trees planned for the cut
        progress("  no new trees came into force after the uplink was mended")
        return {"delay": None, "after": [d for s, d, _ in rounds if s > restored][1:] or [rounds[-1][1]],
                "planned": planned, "steps": {}, "measured": []}
    epoch = first_switch(job.lines, restored) or back[0][2]
    committed, moved, carried = switch_times(job, epoch, back[0][0])
    progress(f"  trees for the mended uplink (epoch {back[0][2]}) carry pushes {carried - restored:.1f} s after it, "
             f"the first round under them {back[0][0] - restored:.1f} s; {len(back)} rounds under them")
    return {"delay": (carried - restored) / args.period, "first_round": (back[0][0] - restored) / args.period,
            "after": [d for _, d, _ in back[2:] or back[-1:]], "planned": planned,
            "steps": steps(job.lines, restored, args.period, "r0", epoch, committed, back[0][0], moved),
            "measured": [m for r, _, m, c, _ in flagged if r == "r0" and c]}


def fresh_run(bed: Netbed, layout: Layout, config: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The fresh job, planned for the cut uplink: its round times, and what re-planned it."""
    uplinks = [u for u in config["aggregation"]["uplinks"] if not u.startswith("r0:")]
    cut = [*uplinks, f"r0: {layout.uplink_mbit / 4}"]
    config = {**config, "aggregation": {**config["aggregation"], "uplinks": cut}}
    bed.set_uplink("r0", layout.uplink_mbit / 4)
    job = run_job(bed, layout, config, args.fresh_seconds, args)
    rounds = round_times(job.workers)
    if not any(e > 0 for *_, e in rounds):
        raise RuntimeError("the fresh job's trees never came into force")
    first = min(e for *_, e in rounds if e > 0)
    planned = [d for _, d, e in rounds if e >= first]
    wrong = false_alarms(job.lines, configured(layout), CHANGE, "r0", None)
    if wrong:
        progress(f"  the fresh job counted uplinks it should not have: {', '.join(wrong)}")
    if (extra := switches(job.lines) - 1) > 0:  # what the manager saw, for the switches the summary counts as needless
        seen = said(evidence(job.lines, 0.0, args.period))
        progress(f"  the fresh job switched trees {extra} more time(s); it saw: {seen}")
    # the first rounds under the trees settle; a later epoch is a re-plan of a plan made for the cut uplink
    return {"rounds": planned[2:] or planned[-1:], "replans": len({e for *_, e in rounds if e > first}),
            "false_alarms": wrong, "switches": extra}


def kept_run(bed: Netbed, layout: Layout, config: dict[str, Any], args: argparse.Namespace) -> list[float]:
    """The kept job: the trees planned for the configured uplinks, run with r0's uplink cut; its rounds' times."""
    config = {**config, "aggregation": {**config["aggregation"], "report_s": STALE_REPORT_S}}
    bed.set_uplink("r0", layout.uplink_mbit / 4)
    rounds = round_times(run_job(bed, layout, config, args.fresh_seconds, args).workers)
    epochs = {e for *_, e in rounds if e > 0}
    if len(epochs) != 1:  # no reports, no re-plan: one epoch, that of the trees planned at the start
        raise RuntimeError(f"the kept job's rounds ran on routing epochs {sorted(epochs)}, not on its first trees")
    kept = [d for _, d, e in rounds if e > 0]
    return kept[1:] or kept  # the first round under the cut fills the uplink's queue


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args.worker)
    if not ready_for("replan"):
        return 0
    layout = Layout(args.racks, args.per_rack, args.servers, args.link_mbit, args.ratio)
    replans, freshes, kept = [], [], []
    for repeat in range(args.repeats):
        with Netbed(queue_ms=1000) as bed:
            build_testbed(bed, layout, CLASSES)
            config = job_config(layout, PLANNED, args.chunk_kib, bed)
            config["aggregation"] = {**config["aggregation"], "report_s": args.period,
                                     "uplink_periods": args.uplink_periods}
            progress(f"repeat {repeat + 1}/{args.repeats}: re-plan ...")
            replans.append(replan_run(bed, layout, config, args))
            progress(f"repeat {repeat + 1}/{args.repeats}: fresh plan with the uplink already cut ...")
            freshes.append(fresh_run(bed, layout, config, args))
            progress(f"repeat {repeat + 1}/{args.repeats}: the first trees kept, the uplink cut ...")
            kept.append(kept_run(bed, layout, config, args))
    report(args, layout, replans, freshes, kept)
    return 0


if __name__ == "__main__":
    sys.exit(main())
