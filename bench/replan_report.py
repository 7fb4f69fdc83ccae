"""bench/replan.py's figures: the tables against the targets, where the time went step by step, the JSON records."""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from bench.aggregation_setup import Layout
from bench.common import print_table, progress, write_json
from testbed.replan_steps import STEPS, median_steps

TARGET_PERIODS, TARGET_RATIO = 2.0, 1.15


def report(args: argparse.Namespace, layout: Layout, replans: list[dict[str, Any]],
           freshes: list[dict[str, Any]], kept: list[list[float]]) -> None:
    """Print the figures of the repeats (replan_run's, fresh_run's and kept_run's results) and write the JSON
    records."""
    delay = statistics.median(r["delay"] for r in replans)
    first_round = statistics.median(r["first_round"] for r in replans)
    ours = statistics.median(d for r in replans for d in r["after"])
    peer = statistics.median(d for f in freshes for d in f["rounds"])
    timed = median_steps([r["steps"] for r in replans])
    alarms = sum(len(r["false_alarms"]) + len(f["false_alarms"]) for r, f in zip(replans, freshes, strict=True))
    needless = sum(r["switches_before_cut"] + f["switches"] for r, f in zip(replans, freshes, strict=True))
    in_flight = statistics.median(r["round_in_flight"] for r in replans)
    early = sum(len(r["false_mends"]) for r in replans)
    progress(f"\n{layout.racks} racks x {layout.per_rack} workers at {args.ratio}:1, r0's uplink cut to a quarter; "
             f"medians of {args.repeats} repeat(s); uplinks count after {args.uplink_periods} period(s)")
    print_table(["measure", "value", "target", ""], [
        ["throttle to the new trees carrying pushes", f"{delay:.1f} periods ({delay * args.period:.1f} s)",
         f"<= {TARGET_PERIODS:g} periods", "PASS" if delay <= TARGET_PERIODS else "FAIL"],
        ["throttle to the first round on the new trees",
         f"{first_round:.1f} periods ({first_round * args.period:.1f} s)", "", ""],
        ["round after re-plan / fresh plan", f"{ours * 1e3:.0f} / {peer * 1e3:.0f} ms = {ours / peer:.2f}",
         f"<= {TARGET_RATIO}", "PASS" if ours / peer <= TARGET_RATIO else "FAIL"],
        ["rounds with a wrong sum", "0 (every worker checked every round)", "0", "PASS"],
        ["uplinks counted too slow that were not", str(alarms), "0", "PASS" if not alarms else "FAIL"],
        ["switches with no change (before the cut, fresh job)", str(needless), "0", "PASS" if not needless else "FAIL"],
        ["uplinks counted mended while still cut", str(early), "0", "PASS" if not early else "FAIL"],
    ])
    progress(f"\nwhere the time went: seconds after the cut (median of each step), the step's share; the round in "
             f"flight at the switch took {in_flight:.2f} s")
    print_table(["step", "s after cut", "this step", ""], step_rows(timed))
    mended = [r["restore"] for r in replans if r["restore"] is not None]
    records = [kept_record(args, ours, in_flight, kept)] + ([mended_record(args, mended)] if mended else [])
    write_json(args.json, [{
        "case": f"{args.ratio}:1 r0 uplink to 1/4, re-plan", "ours": ours, "peer": peer, "peer_name": "fresh plan",
        "unit": "s per round", "better": "lower", "ratio": ours / peer, "speedup": peer / ours,
        "periods_to_new_plan": delay, "seconds_to_new_plan": delay * args.period, "period_s": args.period,
        "periods_by_repeat": [r["delay"] for r in replans], "uplink_periods": args.uplink_periods,
        "periods_to_first_round": first_round, "first_round_by_repeat": [r["first_round"] for r in replans],
        "fresh_replans": sum(f["replans"] for f in freshes),
        "met": {"periods": delay <= TARGET_PERIODS, "round_time": ours / peer <= TARGET_RATIO},
        "steps_s": timed, "steps_s_by_repeat": [r["steps"] for r in replans],
        "round_in_flight_s": [r["round_in_flight"] for r in replans],
        "measured_mbit": [r["measured"] for r in replans], "cut_mbit": layout.uplink_mbit / 4,
        "false_alarms": [r["false_alarms"] for r in replans], "false_mends": [r["false_mends"] for r in replans],
        "fresh_false_alarms": [f["false_alarms"] for f in freshes],
        "switches_before_cut": [r["switches_before_cut"] for r in replans],
        "fresh_switches": [f["switches"] for f in freshes],
    }, *records])


def kept_record(args: argparse.Namespace, ours: float, in_flight: float, kept: list[list[float]]) -> dict[str, Any]:
    """Print what the re-plan buys: its rounds (`ours`) and the round in flight at the switch against the rounds of
    the trees planned for the configured uplinks, kept under the cut (kept_run's); its JSON record."""
    peer = statistics.median(d for rounds in kept for d in rounds)
    progress(f"\nthe re-plan against keeping the first trees under the cut; medians of {len(kept)} repeat(s)")
    print_table(["measure", "value", ""], [
        ["round after re-plan / first trees kept", f"{ours * 1e3:.0f} / {peer * 1e3:.0f} ms = {ours / peer:.2f}",
         "what the re-plan buys"],
        ["round in flight at the switch / first trees kept", f"{in_flight * 1e3:.0f} / {peer * 1e3:.0f} ms = "
         f"{in_flight / peer:.2f}", "that round ran on the first trees"],
    ])
    return {"case": f"{args.ratio}:1 r0 uplink to 1/4, re-plan against the first trees kept", "ours": ours,
            "peer": peer, "peer_name": "the first trees kept (no re-plan)", "unit": "s per round", "better": "lower",
            "ratio": ours / peer, "speedup": peer / ours, "round_in_flight_s": in_flight,
            "in_flight_vs_kept": in_flight / peer, "kept_rounds_s": kept}


def mended_record(args: argparse.Namespace, mended: list[dict[str, Any]]) -> dict[str, Any]:
    """Print the figures of the uplink set back (restore_run's results); its JSON record, against the rounds
    before the cut (the trees planned for the configured uplinks). Where no new trees came, "ours" is the
    rounds the job ran after it on the trees planned for the cut."""
    delays = [r["delay"] for r in mended]
    seen = [d for d in delays if d is not None]
    firsts = [r["first_round"] for r in mended if r["delay"] is not None]
    after = [d for r in mended for d in r["after"]]
    ours = statistics.median(after)
    peer = statistics.median(d for r in mended for d in r["planned"])
    delay = statistics.median(seen) if len(seen) == len(delays) else None
    progress(f"\nr0's uplink set back {args.restore_after:g} s after the cut; medians of {len(mended)} repeat(s)")
    print_table(["measure", "value", "target", ""], [
        ["mended to the new trees carrying pushes", "never" if delay is None else
         f"{delay:.1f} periods ({delay * args.period:.1f} s)", f"<= {TARGET_PERIODS:g} periods",
         "PASS" if delay is not None and delay <= TARGET_PERIODS else "FAIL"],
        ["mended to the first round on the new trees", "never" if delay is None else
         f"{statistics.median(firsts) * args.period:.1f} s", "", ""],
        ["round after / before the cut", f"{ours * 1e3:.0f} / {peer * 1e3:.0f} ms = {ours / peer:.2f}",
         f"<= {TARGET_RATIO}", "PASS" if ours / peer <= TARGET_RATIO else "FAIL"],
    ])
    timed = median_steps([r["steps"] for r in mended if r["steps"]])
    progress("\nwhere the time went: seconds after the uplink was set back (median of each step)")
    print_table(["step", "s after", "this step", ""], step_rows(timed))
    return {
        "case": f"{args.ratio}:1 r0 uplink back to its rate, re-plan", "ours": ours, "peer": peer,
        "peer_name": "rounds before the cut", "unit": "s per round", "better": "lower", "ratio": ours / peer,
        "speedup": peer / ours, "periods_to_new_plan": delay, "periods_by_repeat": delays,
        "periods_to_first_round": statistics.median(firsts) if delay is not None else None,
        "restore_after_s": args.restore_after, "period_s": args.period,
        "met": {"periods": delay is not None and delay <= TARGET_PERIODS, "round_time": ours / peer <= TARGET_RATIO},
        "steps_s": timed, "steps_s_by_repeat": [r["steps"] for r in mended],
        "measured_mbit": [r["measured"] for r in mended],
    }


def step_rows(timed: dict[str, float | None]) -> list[list[str]]:
    """One row per step: its time after the cut, and how long it took after the step before it."""
    rows, last = [], 0.0
    for step, what in STEPS.items():
        at = timed[step]
        rows.append([step, "-" if at is None else f"{at:.2f}", "-" if at is None else f"{at - last:+.2f}", what])
        last = at if at is not None else last
    return rows
