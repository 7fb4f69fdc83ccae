"""Control traffic at the root and negotiation latency: the coordinator tree against a flat rank-0 coordinator."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/coordinator.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import Stats, add_common_options, print_table, progress, record, stats, write_json
from sluice.worker.collective.tree import build_tree
from testbed.light_ranks import Plan, latencies, run

PEER = "flat rank-0 coordinator"
UNIT = "bytes/step at root"

DESCRIPTION = """\
N light processes (testbed/light_ranks.py: a bare transport and a Coordinator each, no
torch, 8 ranks per host label) negotiate OPS allreduce requests per step for STEPS steps: each rank
submits a step's requests in its own random order (or, with --spread-ms, all in one order spread
over that many milliseconds, like a backward pass), and waits for the step's decisions before the
next. Step 1 builds the operation table (names and shapes travel); the steps after it are the
steady state measured here (bit-vectors only).

  tree  the coordinator tree, fan-out --arity (worker/collective/tree.py, worker/collective/negotiation.py)
  flat  the same protocol with arity 0: every rank a child of rank 0 (Horovod's coordinator)

Per steady step, at the root: bytes received (headers + payloads, as encoded) and messages received;
and the most messages the root took in one tick (the target: at most --arity). Latency: from the
moment the last rank submitted an op to the op's decision at each rank, over every op, rank and
steady step (p50, p99). Tree and flat alternate within each repetition. The JSON record's ours is
the tree's root bytes per step, peer the flat one's; speedup = flat / tree.
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32, 64], metavar="N",
                        help="rank counts (default: %(default)s)")
    parser.add_argument("--arity", type=int, default=4, help="fan-out of the tree (default: %(default)s)")
    parser.add_argument("--ops", type=int, default=200, help="operations per step (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=6,
                        help="steps per run; the first builds the table and is not measured (default: %(default)s)")
    parser.add_argument("--cycle-ms", type=float, default=1.0, help="collective.cycle_ms (default: %(default)s)")
    parser.add_argument("--spread-ms", type=float, default=0.0,
                        help="submit a step's ops in one order over this long; 0: at once, each rank in its own "
                             "random order (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=120.0, metavar="SECONDS",
                        help="give up on any one wait of a rank after this long (default: %(default)s)")
    add_common_options(parser, quick="8 ranks, 3 steps, 1 repeat (overrides those options)", repeats=3)
    args = parser.parse_args(argv)
    if args.quick:
        args.ranks, args.steps, args.repeats = [8], 3, 1
    if min(args.ranks) < 2 or args.arity < 2 or args.ops < 1 or args.steps < 2 or args.repeats < 1:
        parser.error("ranks >= 2, arity >= 2, ops >= 1, steps >= 2 and repeats >= 1")
    return args


def measure(ranks: int, arity: int, args: argparse.Namespace) -> dict[str, float]:
    """One run: the root's steady-state traffic per step, its largest fan-in per tick, latency in ms."""
    plan = Plan(ranks=ranks, arity=arity, steps=args.steps, ops=args.ops, ranks_per_host=8, cycle_ms=args.cycle_ms,
                shuffle=not args.spread_ms, spread_ms=args.spread_ms, timeout=args.timeout)
    reports = run(plan)
    errors = {r.error for r in reports} - {None}
    if errors or any(r.decisions != reports[0].decisions for r in reports):
        raise RuntimeError(f"ranks disagree or failed: {sorted(map(str, errors))[:2]}")
    steady, steps = reports[0].steady, args.steps - 1
    waited = sorted(latencies(reports))
    return {
        "bytes": steady["bytes_received"] / steps,
        "messages": steady["messages_received"] / steps,
        "max_per_tick": max(steady["max_received_per_tick"], reports[0].first["max_received_per_tick"]),
        "p50": 1e3 * waited[len(waited) // 2],
        "p99": 1e3 * waited[min(len(waited) - 1, int(len(waited) * 0.99))],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    progress(f"coordinator: ranks {args.ranks}, arity {args.arity} against flat, {args.ops} ops per step, "
             f"{args.steps} steps (1 to build the table), {args.repeats} repeats, cycle {args.cycle_ms} ms, "
             + (f"ops spread over {args.spread_ms} ms" if args.spread_ms else "ops at once in random orders"))
    rows, records = [], []
    started = time.perf_counter()
    for ranks in args.ranks:
        runs: dict[str, list[dict[str, float]]] = {"tree": [], "flat": []}
        for rep in range(args.repeats):
            pair = [("tree", args.arity), ("flat", 0)]
            for name, arity in pair if rep % 2 == 0 else pair[::-1]:
                t0 = time.perf_counter()
                runs[name].append(measure(ranks, arity, args))
                got = runs[name][-1]
                progress(f"  ranks{ranks:<3} {name} rep {rep + 1}: {got['bytes']:.0f} B/step, {got['messages']:.1f} "
                         f"msgs/step, fan-in <= {got['max_per_tick']:.0f}/tick, p50 {got['p50']:.1f} ms, "
                         f"p99 {got['p99']:.1f} ms ({time.perf_counter() - t0:.1f} s)")
        tree, flat = ({key: stats([r[key] for r in runs[name]]) for key in runs[name][0]} for name in ("tree", "flat"))
        case = f"ranks{ranks}"
        height = build_tree([f"host-{r // 8}" for r in range(ranks)], args.arity).height()
        records.append(_record(case, tree, flat, args, ranks, height))
        rows.append([case, f"{tree['bytes'].median:.0f}", f"{flat['bytes'].median:.0f}",
                     f"{flat['bytes'].median / tree['bytes'].median:.1f}x",
                     f"{tree['messages'].median:.1f}", f"{flat['messages'].median:.1f}",
                     f"{tree['max_per_tick'].high:.0f}", f"{flat['max_per_tick'].high:.0f}",
                     f"{tree['p50'].median:.1f} / {tree['p99'].median:.1f}",
                     f"{flat['p50'].median:.1f} / {flat['p99'].median:.1f}"])
    progress(f"\nsteady state per step at the root, medians of {args.repeats} repeats "
             f"({time.perf_counter() - started:.0f} s in all); tree arity {args.arity}")
    print_table(["case", "tree B", "flat B", "flat/tree", "tree msgs", "flat msgs", "tree fan-in", "flat fan-in",
                 "tree p50/p99 ms", "flat p50/p99 ms"], rows)
    write_json(args.json, records)
    return 0


def _record(case: str, tree: dict[str, Stats], flat: dict[str, Stats], args: argparse.Namespace, ranks: int,
            height: int) -> dict[str, Any]:
    fan_in = tree["max_per_tick"].high
    return record(
        case, tree["bytes"], flat["bytes"], PEER, UNIT, better="lower",
        speedup=flat["bytes"].median / tree["bytes"].median, ranks=ranks, arity=args.arity, height=height,
        ops=args.ops, steps=args.steps, repeats=args.repeats, cycle_ms=args.cycle_ms, spread_ms=args.spread_ms,
        ours_messages_per_step=tree["messages"].median, peer_messages_per_step=flat["messages"].median,
        ours_bytes_per_message=tree["bytes"].median / tree["messages"].median,
        peer_bytes_per_message=flat["bytes"].median / flat["messages"].median,
        ours_max_messages_per_tick=fan_in, peer_max_messages_per_tick=flat["max_per_tick"].high,
        fan_in_met=fan_in <= args.arity,
        ours_latency_p50_ms=tree["p50"].median, ours_latency_p99_ms=tree["p99"].median,
        peer_latency_p50_ms=flat["p50"].median, peer_latency_p99_ms=flat["p99"].median,
        latency="from the last rank's submit of an op to its decision at each rank",
    )


if __name__ == "__main__":
    sys.exit(main())
