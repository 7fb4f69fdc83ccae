"""Sluice's pipeline schedules: idle time against each schedule's bubble bound, samples/s against torch's.

Sluice's pipeline parallelism (sluice.worker.torch.pipelining under `sluice launch -w P -s 0`) for P
stages and M micro-batches a step, by GPipe, 1F1B, interleaved 1F1B (V chunks per stage: NAME:V) and
zero bubble (ZB-H1; interleaved with NAME:V); every process runs bench/pipeline_job.py with one torch
thread.

  idle     stages of fixed compute: each stage's forward takes COMPUTE_MS and its backward as long.
           They sleep rather than compute, so that P processes sharing two cores measure the schedule,
           not the cores. Per stage and timed step: idle = 1 - busy / wall, busy the seconds its
           forwards and backwards took, wall its step's seconds (in the steady state every stage's
           step lasts the pipeline's period); each stage's median over IDLE_STEPS steps after WARMUP.
           ours = the worst stage's median, against the schedule's order as Sluice runs it replayed at
           those times (whole_backward_bound: with whole backwards, (P-1)/(M+P-1), torch's): GPipe's
           and 1F1B's backwards on a stage with one before it compute and send the inputs' gradient
           first, then the weights' (sluice.worker.pipeline.schedule.inputs_first), so the stage
           before starts half a backward sooner on each hop; met within 3 points. Interleaved
           stages run V chunks of COMPUTE_MS/V each: (P-1)/(VM+P-1) for M >= P. Zero bubble splits
           each backward into I and W of half its time each (the sleeping stage's input and weight
           branches): (P-1)/(2VM+P-1) for M >= P. Either bound is the schedule's order replayed
           against its dependencies at those times (worker/pipeline/schedule.py clock_table). The bound
           assumes nothing but compute; what each of a step's 2(M+P-1) slots costs beyond it (Python,
           passing the result on, waking up) is overhead_ms_per_slot, and raises idle by about
           (1 - bound) o / (T + o) for o ms of it on T ms stages. torch's idle on the same stages is
           recorded too (torch_idle, torch_overhead_ms_per_slot).
  samples  an MLP of LAYERS Linear(WIDTH, WIDTH)+ReLU blocks (the last to 10 classes), split evenly,
           BATCH samples a step, SGD: samples/s against torch.distributed.pipelining's ScheduleGPipe /
           Schedule1F1B over gloo on 127.0.0.1, the same stages, batches and schedule. Each side times
           REPEATS repetitions of STEPS steps (between barriers, on the first stage) after WARMUP;
           the sides alternate, ROUNDS launches each. The first step's loss must agree within 1e-5,
           so both compute the same thing. met at a speedup of 1.2. cpu_ms_per_step: the CPU time
           of all processes' threads a step (the libraries' own threads included). compute_bound:
           the samples/s of the schedule with nothing but the compute, measured once a round (the
           median taken): bench/pipeline_compute.py times each stage's forward, backward and
           optimizer step in min(P, cores) processes at once, one torch thread each, and the
           schedule is replayed at those times, one action a core at a time, in the order Sluice runs
           it (whole_backward_compute_bound: whole backwards, as torch's GPipe and 1F1B run them).
           bound_speedup = compute_bound / torch's: the most a library running Sluice's order could
           beat torch's by on this machine (exact for P <= cores; an estimate beyond, where the OS's
           time slices share the cores, not the replay's queue).

torch's Schedule1F1B refuses M < P; there (1F1B's order then being GPipe's on all but the last
stage) torch runs ScheduleGPipe, and the record says so (peer_schedule). The other schedules run
against torch's class of the same name: ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble
(with one stage per rank, ZB-H1), with the same V chunks per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/pipeline.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    ROOT,
    Stats,
    add_common_options,
    print_table,
    progress,
    record,
    stats,
    write_json,
)
from bench.pipeline_launch import launch, run_processes
from sluice.worker.pipeline.schedule import (
    SCHEDULES,
    SPLIT_BACKWARD,
    Action,
    canonical,
    clock_table,
    idle_fraction,
    inputs_first,
    replay,
    schedule,
)

COMPUTE = ROOT / "bench" / "pipeline_compute.py"
COMPUTED = re.compile(r"PIPELINE_COMPUTE (\{.*\})$", re.M)
#: the cores this benchmark's processes may run on (the compute alone is replayed on as many)
CORES = len(os.sched_getaffinity(0))
TORCH = "torch.distributed.pipelining (gloo)"
BOUND = "bubble bound, the inputs' gradients first (I = W = B/2), replayed (whole backwards: (P-1)/(M+P-1))"
TARGET_POINTS = 0.03
TARGET_SPEEDUP = 1.2
LOSS_TOLERANCE = 1e-5
#: torch's Schedule1F1B refuses fewer micro-batches than stages; then 1F1B's order is GPipe's on all
#: but the last stage, and torch's ScheduleGPipe stands in for it
GPIPE_INSTEAD = " ScheduleGPipe (its Schedule1F1B needs M >= P)"
#: the bound each schedule's idle cases are measured against (peer_name)
BOUNDS = {"gpipe": BOUND, "1f1b": BOUND, "interleaved1f1b": "bubble bound (P-1)/(VM+P-1), replayed",
          "interleavedzerobubble": "zero-bubble bound (P-1)/(2VM+P-1) (I = W = B/2), replayed"}
DEFAULT_SCHEDULES = ["1f1b", "gpipe", "interleaved1f1b:2", "interleavedzerobubble"]


def schedule_spec(text: str) -> tuple[str, int]:
    """NAME or NAME:V (V chunks per stage) as (the schedule's name, V)."""
    name, _, chunks = text.partition(":")
    try:
        key, virtual = canonical(name), int(chunks or 1)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    if virtual < 1 or (virtual > 1 and key in ("gpipe", "1f1b")):
        raise argparse.ArgumentTypeError(f"{key} cannot run {virtual} chunks per stage")
    return key, virtual


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4], metavar="P",
                        help="pipeline stages, one process each (default: %(default)s)")
    parser.add_argument("--micro", type=int, nargs="+", default=[2, 4, 8], metavar="M",
                        help="micro-batches per step (default: %(default)s)")
    parser.add_argument("--schedules", nargs="+", type=schedule_spec, default=DEFAULT_SCHEDULES, metavar="NAME[:V]",
                        help=f"schedules to measure, of {', '.join(SCHEDULES)} (or torch's class names), each with "
                             "V chunks per stage (interleaved; default 1) (default: %(default)s)")
    parser.add_argument("--parts", nargs="+", choices=["idle", "samples"], default=["idle", "samples"],
                        help="idle: fixed-compute stages against the bubble bound; samples: samples/s of an MLP "
                             "against torch's (default: %(default)s)")
    parser.add_argument("--compute-ms", type=float, default=50.0,
                        help="idle: each stage's forward ms, and its backward's (default: %(default)s)")
    parser.add_argument("--idle-steps", type=int, default=10, help="idle: timed steps (default: %(default)s)")
    parser.add_argument("--width", type=int, default=512, help="samples: MLP width (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=8,
                        help="samples: MLP blocks, a multiple of every P (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=128, help="samples: samples per step (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=10,
                        help="samples: steps per timed repetition (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=16,
                        help="samples: untimed steps first (Sluice's GPipe and 1F1B stages try their backwards "
                             "split and whole in the first 15) (default: %(default)s)")
    parser.add_argument("--idle-warmup", type=int, default=3,
                        help="idle: untimed steps first (Sluice's stages split their backwards: see --inputs-first) "
                             "(default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="samples: launches of each side per case, alternating (default: %(default)s)")
    parser.add_argument("--inputs-first", choices=["auto", "on", "off"], default="auto",
                        help="Sluice's GPipe and 1F1B: send each backward's inputs' gradient before computing its "
                             "weights' where that measures faster, always or never; the bounds follow (default: "
                             "%(default)s)")
    parser.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                        help="give up on one launch after this long (default: %(default)s)")
    parser.add_argument("--profile", metavar="DIR",
                        help="samples: cProfile each process's timed steps into DIR/SIDE-case.rankN.prof")
    add_common_options(parser, "P=2, M=2, 10 ms stages, 3 steps, 1 warm-up, 1 repeat; idle of interleaved 1F1B "
                               "(V=2), samples of zero bubble (ZB-H1)", repeats=5)
    args = parser.parse_args(argv)
    args.schedules = [spec if isinstance(spec, tuple) else schedule_spec(spec) for spec in args.schedules]
    #: which schedules each part measures (--quick: one each, as cheap as one schedule in both)
    args.part_schedules = {"idle": args.schedules, "samples": args.schedules}
    if args.quick:
        args.stages, args.micro, args.compute_ms = [2], [2], 10.0
        args.part_schedules = {"idle": [("interleaved1f1b", 2)], "samples": [("interleavedzerobubble", 1)]}
        args.idle_steps, args.steps, args.warmup, args.repeats, args.rounds = 3, 3, 1, 1, 1
        args.idle_warmup = 1
    if min(args.stages) < 2 or min(args.micro) < 1:
        parser.error("a pipeline needs at least 2 stages and 1 micro-batch")
    if min(args.idle_steps, args.steps, args.repeats, args.rounds, args.batch, args.warmup + 1,
           args.idle_warmup + 1) < 1:
        parser.error("steps, repeats, rounds and batch must be positive, warmup not negative")
    if any(args.layers % (p * v) for p in args.stages for _, v in args.part_schedules["samples"]) or (
            max(args.micro) > args.batch):
        parser.error("--layers must be a multiple of every P times V, and --batch at least every M")
    for name, virtual in args.schedules:
        for p in args.stages:
            for m in args.micro:
                try:
                    schedule(name, p, m, virtual)
                except ValueError as exc:
                    parser.error(f"{name} with P={p}, M={m}: {exc}")
    return args


# ---------------------------------------------------------------------------- the two parts
def peer_schedule(stages: int, micro: int, schedule: str) -> str:
    return "gpipe" if schedule == "1f1b" and micro < stages else schedule


def runs(name: str, stages: int, micro: int, virtual: int, whole: bool = False) -> list[list[Action]]:
    """Each worker's order as Sluice runs the schedule (GPipe's and 1F1B's backwards with a stage before
    them split, the inputs' gradient first: schedule.inputs_first), or with `whole` backwards as torch's
    GPipe and 1F1B run them."""
    orders = schedule(name, stages, micro, virtual)
    return orders if whole or name in SPLIT_BACKWARD else inputs_first(orders)


def replayed(stages: int, micro: int, name: str, virtual: int, whole: bool = False) -> tuple[float, float]:
    """The schedule's idle fraction on its worst stage, from its order (`runs`) replayed at the sleeping
    stages' times (a chunk's forward 2 clocks, its backward 2, an I or a W 1), and its step in slots
    (forwards and backwards, an I and a W making one): with whole backwards (P-1)/(M+P-1) and 2(M+P-1)
    for GPipe and 1F1B."""
    table = clock_table(runs(name, stages, micro, virtual, whole), forward=2, backward=2, input_grad=1,
                        weight_grad=1)
    return max(idle_fraction(table, s) for s in range(stages)), len(table) / 2


def case_name(part: str, stages: int, micro: int, name: str, virtual: int) -> str:
    return f"{part}-P{stages}-M{micro}-{name}{f'-V{virtual}' if virtual > 1 else ''}"


def idle_of(found: list[dict[str, Any]], bound: float, slots: float) -> tuple[Stats, list[float], float]:
    """The worst stage's idle fraction (median, and its min and max over steps), every stage's median,
    and the ms by which a step outlasts the schedule's ideal (busy / (1 - bound)), per slot (2(M+P-1)
    slots a step in 1F1B): the overhead of each forward or backward beyond the compute, and of passing
    its result on."""
    per_stage = [[1 - busy / wall for busy, wall in zip(r["busy"], r["wall"], strict=True)] for r in found]
    medians = [statistics.median(values) for values in per_stage]
    index = medians.index(max(medians))
    worst = per_stage[index]
    wall, busy = statistics.median(found[index]["wall"]), statistics.median(found[index]["busy"])
    excess = (wall - busy / (1 - bound)) / slots * 1e3
    return Stats(max(medians), min(worst), max(worst)), medians, excess


def idle_case(stages: int, micro: int, spec: tuple[str, int], args: argparse.Namespace) -> dict[str, Any]:
    schedule, virtual = spec
    # sleeping stages cost no CPU: a split backward ends the inputs' half sooner and nothing later (the
    # stages' trials choose it), so they split from the first step, without trials
    first = "on" if args.inputs_first == "auto" else args.inputs_first
    job = ["--warmup", str(args.idle_warmup), "--inputs-first", first, "--model", "sleep", "--compute-ms",
           str(args.compute_ms), "--steps", str(args.idle_steps), "--batch", str(max(16, micro))]
    bound, slots = replayed(stages, micro, schedule, virtual, whole=args.inputs_first == "off")
    whole, whole_slots = replayed(stages, micro, schedule, virtual, whole=True)  # torch's way
    found = launch("sluice", stages, micro, schedule, args, *job, virtual=virtual)
    ours, stage_idle, excess = idle_of(found, bound, slots)
    found = launch("torch", stages, micro, peer_schedule(stages, micro, schedule), args, *job, virtual=virtual)
    theirs, torch_stage_idle, torch_excess = idle_of(found, whole, whole_slots)
    case = case_name("idle", stages, micro, schedule, virtual)
    progress(f"  {case:<22} sluice {ours.median:.3f}  torch {theirs.median:.3f}  bound {bound:.3f} (whole "
             f"backwards {whole:.3f})  (overhead per "
             f"slot: sluice {excess:.2f} ms, torch {torch_excess:.2f} ms)")
    own = {"virtual": virtual} if virtual > 1 or schedule not in ("gpipe", "1f1b") else {}
    return record(case, ours, Stats(bound, bound, bound), BOUNDS[schedule], "fraction", "lower", stages=stages,
                  inputs_first=first,
                  micro=micro, schedule=schedule, **own, compute_ms=args.compute_ms, steps=args.idle_steps,
                  warmup=args.idle_warmup, whole_backward_bound=whole,
                  measure="worst stage's median", stage_idle=stage_idle, mean_idle=statistics.mean(stage_idle),
                  points_over_bound=(ours.median - bound) * 100, met=abs(ours.median - bound) <= TARGET_POINTS,
                  overhead_ms_per_slot=excess, torch_idle=theirs.median, torch_stage_idle=torch_stage_idle,
                  torch_overhead_ms_per_slot=torch_excess, torch_schedule=peer_schedule(stages, micro, schedule))


def compute_bound(stages: int, micro: int, spec: tuple[str, int], args: argparse.Namespace) -> tuple[float, float]:
    """The samples/s of the schedule with nothing but the compute on CORES cores, in the order Sluice runs
    it and (second) with whole backwards, torch's way (`runs`): the times of
    bench/pipeline_compute.py (measured in min(P, cores) processes at once, so that they share the
    caches and memory as the stages do; each the median of theirs), the schedule replayed at them with
    at most one action a core at a time (the first ready goes first), then the slowest optimizer step.
    Nothing passes tensors between stages, nothing pays a library's Python. With P <= cores no
    pipelining library running that order can take a shorter step; with more stages than cores the
    queueing is the replay's, not the OS's time slices, so it is an estimate there."""
    name, virtual = spec
    argv = [sys.executable, str(COMPUTE), "--stages", str(stages), "--micro", str(micro), "--virtual", str(virtual),
            "--width", str(args.width), "--layers", str(args.layers), "--batch", str(args.batch),
            "--warmup", str(args.warmup), "--steps", str(args.steps)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    output = run_processes([(argv, env)] * min(stages, CORES), args.timeout)
    found = [json.loads(m.group(1)) for m in COMPUTED.finditer(output)]
    times = {key: [statistics.median(values) for values in zip(*(f[key] for f in found), strict=True)]
             for key in found[0]}
    kinds = {"F": times["forward"], "B": times["backward"], "I": times["input_grad"], "W": times["weight_grad"]}

    def duration(action: Action, stage: int) -> float:
        return float(kinds[action.kind][stage])

    def rate(whole: bool) -> float:
        makespan = max(end for *_, end in replay(runs(name, stages, micro, virtual, whole), duration, CORES))
        return float(args.batch / (makespan + max(times["optimizer"])))

    return rate(args.inputs_first == "off"), rate(True)


def samples_case(stages: int, micro: int, spec: tuple[str, int], args: argparse.Namespace) -> dict[str, Any]:
    schedule, virtual = spec
    case = case_name("samples", stages, micro, schedule, virtual)
    rates: dict[str, list[float]] = {"sluice": [], "torch": []}
    losses: dict[str, list[list[float]]] = {"sluice": [], "torch": []}
    cpu: dict[str, list[float]] = {"sluice": [], "torch": []}  # ms of CPU a step, all processes together
    bounds: list[tuple[float, float]] = []  # compute_bound of each round: Sluice's order, torch's
    for round_ in range(args.rounds):
        for side in ("sluice", "torch") if round_ % 2 == 0 else ("torch", "sluice"):  # alternating: drift hits both
            job = ["--warmup", str(args.warmup), "--inputs-first", args.inputs_first, "--model", "mlp", "--width",
                   str(args.width), "--layers", str(args.layers), "--batch", str(args.batch), "--steps",
                   str(args.steps), "--repeats", str(args.repeats)]
            if args.profile:
                job += ["--profile", str(Path(args.profile) / f"{side}-{case}")]
            kind = schedule if side == "sluice" else peer_schedule(stages, micro, schedule)
            found = launch(side, stages, micro, kind, args, *job, virtual=virtual)
            rates[side] += [args.steps * args.batch / s for s in found[0]["seconds"]]
            losses[side].append(found[-1]["losses"])
            cpu[side].append(sum(r["cpu"] for r in found) / (args.steps * args.repeats) * 1e3)
            progress(f"  {case:<22} {side:<6} {statistics.median(rates[side][-args.repeats:]):8.0f} samples/s, "
                     f"{cpu[side][-1]:.1f} CPU ms a step, first loss {found[-1]['losses'][0]:.6f}")
        bounds.append(compute_bound(stages, micro, spec, args))  # each round: the machine drifts between them
    first_diff = max(abs(a[0] - b[0]) for a in losses["sluice"] for b in losses["torch"])
    last_diff = max(abs(a[1] - b[1]) for a in losses["sluice"] for b in losses["torch"])
    if first_diff > LOSS_TOLERANCE:
        progress(f"  WARNING {case}: the first step's losses differ by {first_diff:.3g}: the sides compute "
                 "different things, so the comparison is not fair")
    ours, peer = stats(rates["sluice"]), stats(rates["torch"])
    limit, whole = (statistics.median(b) for b in zip(*bounds, strict=True))
    progress(f"  {case:<22} compute alone {limit:8.0f} samples/s in our order: at most {limit / peer.median:.2f}x "
             f"torch's; ours {ours.median / limit:.0%} of it; torch's {peer.median / whole:.0%} of its own order's "
             f"{whole:.0f}")
    same = first_diff <= LOSS_TOLERANCE
    theirs = peer_schedule(stages, micro, schedule)
    own = {"virtual": virtual} if virtual > 1 or schedule not in ("gpipe", "1f1b") else {}
    return record(case, ours, peer, TORCH + (GPIPE_INSTEAD if theirs != schedule else ""), "samples/s", "higher",
                  stages=stages, micro=micro, schedule=schedule, **own, peer_schedule=theirs,
                  inputs_first=args.inputs_first,
                  width=args.width, layers=args.layers, batch=args.batch, steps=args.steps, warmup=args.warmup,
                  repeats=args.repeats, rounds=args.rounds, first_loss=losses["sluice"][0][0],
                  first_loss_diff=first_diff, last_loss_diff=last_diff, same_loss=same,
                  cpu_ms_per_step=statistics.median(cpu["sluice"]),
                  peer_cpu_ms_per_step=statistics.median(cpu["torch"]),
                  compute_bound=limit, whole_backward_compute_bound=whole, cores=CORES,
                  of_bound=ours.median / limit, peer_of_bound=peer.median / limit,
                  bound_speedup=limit / peer.median, met=same and ours.median / peer.median >= TARGET_SPEEDUP)


def row(rec: dict[str, Any]) -> list[str]:
    if rec["unit"] == "fraction":
        overhead = f"{rec['overhead_ms_per_slot']:.2f} / {rec['torch_overhead_ms_per_slot']:.2f}"
        return [rec["case"], f"{rec['ours']:.3f} [{rec['ours_min']:.3f}..{rec['ours_max']:.3f}]", f"{rec['peer']:.3f}",
                f"{rec['torch_idle']:.3f}", overhead, "", "", f"{rec['points_over_bound']:+.1f} pts",
                "met" if rec["met"] else "MISSED"]
    return [rec["case"], f"{rec['ours']:.0f} [{rec['ours_min']:.0f}..{rec['ours_max']:.0f}]",
            f"{rec['peer']:.0f} [{rec['peer_min']:.0f}..{rec['peer_max']:.0f}]", "", "",
            f"{rec['cpu_ms_per_step']:.1f} / {rec['peer_cpu_ms_per_step']:.1f}",
            f"{rec['compute_bound']:.0f} ({rec['bound_speedup']:.2f}x)", f"{rec['speedup']:.2f}x",
            "met" if rec["met"] else "MISSED"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    cases = {part: [(p, m, s) for p in args.stages for m in args.micro for s in specs]
             for part, specs in args.part_schedules.items()}
    names = sorted({f"{name}{f':{v}' if v > 1 else ''}" for specs in args.part_schedules.values() for name, v in specs})
    progress(f"pipeline: P {args.stages}, M {args.micro}, {', '.join(names)}; parts {', '.join(args.parts)}")
    started = time.perf_counter()
    records: list[dict[str, Any]] = []
    if "idle" in args.parts:
        progress(f"idle fraction, stages of {args.compute_ms:g} ms forward + {args.compute_ms:g} ms backward, "
                 f"median of {args.idle_steps} steps after {args.idle_warmup}:")
        records += [idle_case(p, m, s, args) for p, m, s in cases["idle"]]
    if "samples" in args.parts:
        progress(f"samples/s, MLP {args.layers} x {args.width}, batch {args.batch}, {args.repeats} x {args.steps} "
                 f"steps after {args.warmup}, {args.rounds} round(s):")
        records += [samples_case(p, m, s, args) for p, m, s in cases["samples"]]
    progress(f"\nidle: the worst stage's, against its order replayed (GPipe, 1F1B: the inputs' gradients first; "
             f"torch idle against whole backwards; target within {TARGET_POINTS * 100:.0f} points); "
             f"samples/s: median [min..max] of repeats, against {TORCH} (target {TARGET_SPEEDUP}x); "
             "overhead and CPU: sluice / torch; compute alone: samples/s with nothing but the compute, in Sluice's "
             f"order (the most a library could beat torch's by that way); {time.perf_counter() - started:.0f} s in all")
    print_table(["case", "sluice", "peer", "torch idle", "overhead ms/slot", "CPU ms/step", "compute alone",
                 "vs peer", "target"],
                [row(rec) for rec in records])
    write_json(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
