"""Where the time from a rack uplink's cut to the new trees in force goes, step by step, from timed log lines."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from datetime import datetime

#: the steps in order, and what each one's time is (seconds after the cut)
STEPS = {
    "evidence": "end of the first period whose reports show the change (the uplink holding the job back, or at ease)",
    "seen": "the scheduler took that period's reports",
    "confirmed": "the manager counted the uplink (measured rate logged)",
    "planned": "the re-plan's trees were ready",
    "routes": "ROUTES sent to the aggregators",
    "routes_workers": "every aggregator acknowledged: ROUTES sent to the workers",
    "commit": "every worker answered: COMMIT sent",
    "committed": "the last worker received COMMIT",
    "moved": "the first pushes of the round in flight left on the new trees (a switch inside the round)",
    "in_force": "the first round started under the new trees",
}

_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) [A-Z]+ [\w.]+: (.*)$")
_HELD = re.compile(r"^uplink of rack (\S+) held the job back in period (\d+) \(([\d.]+) Mbit/s[;)]")
_THROUGH = re.compile(r"; ([\d.]+) Mbit/s acknowledged across it\)$")
_MEASURED = re.compile(r"^uplink of rack (\S+) measured at ([\d.]+) Mbit/s in period (\d+)")
_EASED = re.compile(r"^uplink of rack (\S+) got through at ([\d.]+) Mbit/s in period (\d+)")
_SOONER = re.compile(r"acknowledged ([\d.]+) times sooner")
_SWITCH = re.compile(r"^routing epoch (\d+): (ROUTES|COMMIT) sent to (.*)$")


def parse_line(text: str) -> tuple[float, str] | None:
    """A log line written with SLUICE_LOG_TIME=1 -> (wall-clock time, message); None for any other line."""
    match = _LINE.match(text)
    if match is None:
        return None
    return datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp(), match.group(2)


#: which of the manager's rules counted an uplink, from the reason its line gives (uplinks.py)
RULES = (("times sooner", "sooner"), ("(mended:", "eased"), ("held the job back", "held"))


Finding = tuple[str, int, float, str, float | None]


def _finding(text: str) -> Finding | None:
    """A manager's line about an uplink in a period: (rack, period, Mbit/s, the rule that counted it: "" for
    evidence not counted, "sooner" with the times after it, as "sooner 3.1x"; Mbit/s acknowledged across it or
    None); None for any other line."""
    through = float(m.group(1)) if (m := _THROUGH.search(text)) else None
    if held := _HELD.match(text):
        return held.group(1), int(held.group(2)), float(held.group(3)), "", through
    if eased := _EASED.match(text):
        return eased.group(1), int(eased.group(3)), float(eased.group(2)), "", through
    if measured := _MEASURED.match(text):
        rule = next((name for phrase, name in RULES if phrase in text), "counted")
        if times := _SOONER.search(text):  # how many times sooner: what a threshold would be set from
            rule += f" {times.group(1)}x"
        return measured.group(1), int(measured.group(3)), float(measured.group(2)), rule, through
    return None


def evidence(lines: Sequence[tuple[float, str]], cut: float, period: float) -> list[Finding]:
    """Every uplink the manager saw holding the job back, or crossed at ease (mended), after the cut (or any
    change at `cut`), in log order (`_finding`'s); a period ends at period x `period` s."""
    found = [f for at, text in lines if at >= cut and (f := _finding(text)) is not None]
    return [f for f in found if f[1] * period > cut]


def steps(lines: Sequence[tuple[float, str]], cut: float, period: float, rack: str, epoch: int,
          committed: Sequence[float], in_force: float, moved: float | None = None) -> dict[str, float | None]:
    """Seconds from the cut to each of STEPS (None: not seen) for the uplink of `rack` cut at `cut` and
    the switch to routing `epoch`; `committed`: when each worker received that epoch's COMMIT; `moved`: when
    the first pushes of the round in flight left on its trees (None: none moved)."""
    def first(pattern: str, after: float = cut) -> float | None:
        return next((at - cut for at, text in lines if at >= after and re.match(pattern, text)), None)

    out: dict[str, float | None] = dict.fromkeys(STEPS)
    mine = [(at, f) for at, text in lines if at >= cut and (f := _finding(text)) is not None and f[0] == rack
            and f[1] * period > cut]
    if mine:  # the first period after the cut that showed it, and when its line was written
        out["evidence"] = mine[0][1][1] * period - cut
        out["seen"] = mine[0][0] - cut
    out["confirmed"] = first(rf"^uplink of rack {re.escape(rack)} measured")
    routes = first(rf"^routing epoch {epoch}: ROUTES sent to .*aggregator")
    planned = [at - cut for at, text in lines if cut <= at and text.startswith("aggregation plan ")
               and (routes is None or at - cut <= routes)]
    out["planned"] = planned[-1] if planned else None
    out["routes"] = routes
    out["routes_workers"] = first(rf"^routing epoch {epoch}: ROUTES sent to .*worker")
    out["commit"] = first(rf"^routing epoch {epoch}: COMMIT sent")
    out["committed"] = max(committed) - cut if committed else None
    out["moved"] = None if moved is None else moved - cut
    out["in_force"] = in_force - cut
    return out


def false_alarms(lines: Sequence[tuple[float, str]], configured: Mapping[str, float], change: float, rack: str,
                 cut: float | None) -> list[str]:
    """Uplinks the manager counted at a rate that would re-plan (more than `change` below the `configured` one)
    while they were not slow: any but `rack`'s, and `rack`'s before its `cut` (None: it was slow from the
    start); as 'RACK at M Mbit/s'. (An uplink measured near its rate, because it is a bottleneck, re-plans
    nothing and is no alarm.)"""
    found = []
    for at, text in lines:
        measured = _MEASURED.match(text)
        if measured is None or (measured.group(1) == rack and (cut is None or at >= cut)):
            continue
        name, mbit = measured.group(1), float(measured.group(2))
        if mbit < (1 - change) * configured.get(name, float("inf")):
            found.append(f"{name} at {mbit:g} Mbit/s")
    return found


def false_mends(lines: Sequence[tuple[float, str]], rack: str, cut: float, restored: float | None,
                period: float) -> list[int]:
    """The periods in which the manager counted `rack`'s uplink mended (measured at its rate again, "mended:")
    while it was still cut: periods ending after `cut` and before `restored` (None: never set back)."""
    found = []
    for _, text in lines:
        measured = _MEASURED.match(text)
        if measured is None or measured.group(1) != rack or "(mended:" not in text:
            continue
        ends = int(measured.group(3)) * period
        if cut < ends <= (restored if restored is not None else float("inf")):
            found.append(int(measured.group(3)))
    return found


def first_switch(lines: Sequence[tuple[float, str]], after: float) -> int | None:
    """The routing epoch of the first switch begun after `after` (its ROUTES), or None."""
    return next((int(m.group(1)) for at, text in lines if at >= after and (m := _SWITCH.match(text))
                 and m.group(2) == "ROUTES"), None)


def switches(lines: Sequence[tuple[float, str]], before: float = float("inf")) -> int:
    """How many switches of trees were committed (the first, to the job's first plan, included) before `before`."""
    return sum(1 for at, text in lines if at < before and (m := _SWITCH.match(text)) and m.group(2) == "COMMIT")


def median_steps(runs: Sequence[Mapping[str, float | None]]) -> dict[str, float | None]:
    """Each step's median over the runs that saw it (None: none did)."""
    from statistics import median

    out: dict[str, float | None] = {}
    for step in STEPS:
        seen = [t for r in runs if (t := r.get(step)) is not None]
        out[step] = median(seen) if seen else None
    return out
