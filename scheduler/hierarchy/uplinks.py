"""Rack uplinks' rates from the agents' per-peer reports: what crossed an uplink while it held the job back.

No node can read an uplink's counters, and rounds are synchronous, so every link's average rate
follows the round time: a slow uplink and a slow anything-else look alike in averages. What tells
them apart is where data waits. Each node reports, per peer, what it sent and the fraction of the
period during which data for that peer waited in its queues (transport/metrics.py). Behind a slow
uplink the rack's senders keep a backlog for peers outside the rack the whole period, while their
own links idle, and the other racks' senders do not (they wait for the round, with empty queues).
So an uplink is measured when its rack stands out: its cross-rack backlog is at least `busy` of the
period and no sender's link ran above `free` of its rate, and either its backlog is at least
`stands_out` times the median of comparable racks' (not the racks at the other end of its traffic),
or what crossed it per second of backlog is at most 1/`stands_out` of the median of the comparable
racks that waited too (at least half of `busy`) and below AT_ONCE of its planned rate: right after a
cut the other racks are still busy with the round, and only the rate tells. Its rate is then what
crossed it, per second of backlog. Both directions are measured (traffic leaving the rack, from its senders;
traffic entering it, from senders elsewhere) and the lower counts. A rack without that evidence in a
period gets no measurement.

One held pair of racks (A's traffic to B waited) is evidence against A's uplink out and B's uplink in
alike. When both directions stand out with nothing but such pairs (the servers' rack receiving from the
last rack still pushing, say), the period cannot tell them apart: the uplink that carried more in its
busiest recent period (`peaks`, PEAK_PERIODS) is not the slow one, and on a tie neither is measured.
In a star of worker racks around the servers' rack this never blames the servers' rack; its uplink,
were it slow, would hold every rack back alike, which no period tells from any other uniform slowness.
`UplinkWatch` feeds this period by period and counts an uplink once it held the job back `confirm`
periods running.

An uplink that was counted slow and then mended no longer holds the job back, and the trees planned
around it leave it lightly loaded, so the rack never stands out again and nothing above would notice.
What does tell is how long its senders wait: at the slow rate the plan is made for, the uplink is a
bottleneck of that plan, and some sender waits most of a period in every round; once mended, none
waits long for the same bytes (`eased`). A rate per second of backlog does not tell: where several
senders take turns, it read 5-24 Mbit/s of a cut 2.5 Mbit/s uplink. Nor do waits alone tell it soon: a
cut uplink's quiet periods look the same, and its flows' chunks in flight hold the queue in the network
rather than in the senders' queues. How long the chunks take to be acknowledged does: through a mended
uplink they cross several times sooner, against the other racks' flows, than in its periods before
(delays.py, SOONER), and such a period at ease counts at once.
Nor is a period at ease whose acknowledgements came no sooner than before (delays.UNCHANGED) a sign of a mend:
a plan made for a rate below the uplink's leaves it lightly loaded, and no sender waits.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from sluice.scheduler.hierarchy.agent import Report
from sluice.scheduler.hierarchy.delays import SOONER, UNCHANGED, DelayBaselines

#: the directions of a rack's uplink: its traffic out (measured at its senders) and in (at senders elsewhere)
OUT, IN = 0, 1
#: how many evaluated periods the busiest traffic of each direction is remembered for (`peaks`)
PEAK_PERIODS = 10
#: a counted uplink's rate is the mean of its last this many periods of evidence running: what one period's
#: senders handed over beyond the link's rate (a queue filling) the next period's miss (it draining), so
#: a mean over periods cancels what a median keeps (measured: a 2.5 Mbit/s uplink read 2.9 then 1.7)
SMOOTHING = 5
#: an uplink measured below this fraction of the rate its plan assumed counts in its first period: in runs
#: without a change no period came near it (the lowest, 79% of a bottleneck uplink's rate; bench/replan.py)
AT_ONCE = 0.5
#: an uplink the plan in force assumes slower than configured (by more than SLOWED of its rate) is watched for
#: having been mended: it is, once its traffic crossed `confirm` + 1 periods running with no sender waiting EASY
#: of a period or more for a peer across it. A slow uplink the plan was made for is a bottleneck of that plan, and
#: keeps a sender waiting most of some period of every round: measured (bench/replan.py, 4:1, a cut to a quarter)
#: its longest wait reached 0.6-1.0 of a period in all but single periods between (0.13-0.34 in those); once
#: mended, 0.04-0.27 in every one. With `confirm` periods (2) two cuts of three were taken for mended once, for a
#: period (the deep-fall rule counted them again in the next): hence one more
SLOWED, EASY = 0.1, 0.4


@dataclass
class _Pair:
    """What one rack's nodes sent to another's in the period."""
    mbit: float = 0.0
    #: the largest backlog fraction of the flows to each receiving node, and from each sending node
    to_node: dict[str, float] = field(default_factory=dict)
    from_node: dict[str, float] = field(default_factory=dict)

    @property
    def senders(self) -> set[str]:
        return set(self.from_node)

    @property
    def held(self) -> float:
        """How long the pair's traffic waited as an uplink between the racks would make it wait: behind a slow
        uplink the flows of several senders, to several receivers, wait; one slow node (its link, its CPU)
        holds back only its own flows. So the second longest wait among the senders, and among the
        receivers (the only one's where there is one), the shorter of the two."""
        def second(waits: dict[str, float]) -> float:
            ordered = sorted(waits.values(), reverse=True)
            return ordered[1] if len(ordered) > 1 else ordered[0]

        return min(second(self.to_node), second(self.from_node))


def _pairs(reports: Mapping[str, Report], rack_of: Mapping[str, str]) -> dict[tuple[str, str], _Pair]:
    pairs: dict[tuple[str, str], _Pair] = {}
    for sender, report in reports.items():
        home = rack_of.get(sender)
        for peer, mbit, backlog in report.peers:
            away = rack_of.get(peer)
            if home is None or away is None or away == home:
                continue
            pair = pairs.setdefault((home, away), _Pair())
            pair.mbit += mbit
            pair.to_node[peer] = max(backlog, pair.to_node.get(peer, 0.0))
            pair.from_node[sender] = max(backlog, pair.from_node.get(sender, 0.0))
    return pairs


def direction_mbit(reports: Mapping[str, Report], rack_of: Mapping[str, str]) -> dict[tuple[str, int], float]:
    """What each rack's uplink carried each way in the period, by (rack, OUT or IN): Mbit/s its senders sent
    out of the rack, and senders elsewhere sent into it."""
    carried: dict[tuple[str, int], float] = {}
    for (home, away), pair in _pairs(reports, rack_of).items():
        carried[(home, OUT)] = carried.get((home, OUT), 0.0) + pair.mbit
        carried[(away, IN)] = carried.get((away, IN), 0.0) + pair.mbit
    return carried


def uplink_rates(reports: Mapping[str, Report], rack_of: Mapping[str, str], link_mbit: Mapping[str, float],
                 peaks: Mapping[tuple[str, int], float] | None = None, planned: Mapping[str, float] | None = None,
                 busy: float = 0.8, stands_out: float = 2.0, free: float = 0.8) -> dict[str, float]:
    """Measured uplink rate (Mbit/s) by rack, for the racks whose uplink held the job back this period.

    `reports`: one period's report of each node (by node name); `rack_of`: node -> rack; `link_mbit`:
    node -> the configured rate of its host's link; `peaks`: the busiest recent traffic of each (rack,
    direction), Mbit/s (direction_mbit's), which settles a held pair that either end explains alone;
    `planned`: each rack's uplink rate in the plan in force.
    """
    pairs = _pairs(reports, rack_of)
    # a slow uplink holds back what its rack sends to every other rack (or receives from every one): the
    # direction's backlog is the least over those racks. A rack is compared with the racks that
    # are neither it nor at the other end of its traffic (those absent this period waited for nothing):
    # the servers' rack is not compared with the workers' racks it answers, nor a rack with itself
    racks = set(rack_of.values())
    directions: list[dict[str, list[_Pair]]] = [{}, {}]
    ends: list[dict[str, set[str]]] = [{}, {}]
    for (home, away), pair in pairs.items():
        directions[OUT].setdefault(home, []).append(pair)
        directions[IN].setdefault(away, []).append(pair)
        ends[OUT].setdefault(home, set()).add(away)
        ends[IN].setdefault(away, set()).add(home)
    held_back: dict[tuple[str, int], float] = {}
    for way, (direction, other_ends) in enumerate(zip(directions, ends, strict=True)):
        held = {rack: min(p.held for p in group) for rack, group in direction.items()}
        rates = {rack: sum(p.mbit for p in group) / held[rack] for rack, group in direction.items() if held[rack] > 0}
        for rack, group in direction.items():
            comparable = racks - {rack} - other_ends[rack]
            senders: set[str] = set().union(*(p.senders for p in group))
            # nothing got through all period (a queue of older data draining): no rate to tell
            if (not comparable or held[rack] < busy or not rates.get(rack)
                    or any(reports[s].link_tx > free * link_mbit.get(s, float("inf")) for s in senders)):
                continue
            # it stands out by waiting where the others did not, or, where they waited too, by getting through at
            # a fraction of their rate and below AT_ONCE of its planned one (right after a cut the other racks are
            # still busy with the round; rates read while queues fill or drain are noisier than waiting alone)
            typical = statistics.median(held.get(r, 0.0) for r in comparable)
            waiting = [rates[r] for r in comparable if held.get(r, 0.0) >= busy / 2 and rates.get(r)]
            slower = (bool(waiting) and rates[rack] * stands_out <= statistics.median(waiting)
                      and rates[rack] < AT_ONCE * (planned or {}).get(rack, 0.0))
            if held[rack] >= stands_out * typical or slower:
                held_back[(rack, way)] = rates[rack]
    measured: dict[str, float] = {}
    for (rack, way), rate in held_back.items():
        if not _explained_elsewhere(rack, way, ends, held_back, peaks or {}):
            measured[rack] = min(rate, measured.get(rack, rate))
    return measured


def eased(reports: Mapping[str, Report], rack_of: Mapping[str, str], slowed: Collection[str]) -> dict[str, float]:
    """Of the racks whose uplink the plan in force assumes slowed (`slowed`), those whose traffic crossed it
    this period with no sender waiting EASY of the period or more for a peer across it: by rack, what crossed
    it (the busier direction), Mbit/s."""
    longest: dict[str, float] = {}
    carried: dict[tuple[str, int], float] = {}
    for (home, away), pair in _pairs(reports, rack_of).items():
        wait = max(pair.from_node.values())
        for rack, way in ((home, OUT), (away, IN)):
            if rack in slowed:
                longest[rack] = max(wait, longest.get(rack, 0.0))
                carried[(rack, way)] = carried.get((rack, way), 0.0) + pair.mbit
    return {rack: max(carried.get((rack, OUT), 0.0), carried.get((rack, IN), 0.0))
            for rack, wait in longest.items() if wait < EASY}


def _explained_elsewhere(rack: str, way: int, ends: list[dict[str, set[str]]],
                         held_back: Mapping[tuple[str, int], float], peaks: Mapping[tuple[str, int], float]) -> bool:
    """Whether every held pair of this direction is explained as well by the far end's direction the other way,
    held back too, which carried less in its busiest recent period (the link that carried more is not the slow
    one; on a tie, neither is measured)."""
    mine = peaks.get((rack, way), 0.0)
    for other in ends[way][rack]:
        mirror = (other, 1 - way)
        if mirror not in held_back or rack not in ends[1 - way][other] or peaks.get(mirror, 0.0) > mine:
            return False
    return True


class Finding(NamedTuple):
    """An uplink's evidence in one period: a rate, Mbit/s (counted: the one the manager plans with); whether it
    says the uplink was mended (else: that it held the job back)."""

    period: int
    rack: str
    mbit: float
    counted: bool
    mended: bool = False
    #: a mend counted at once: how many times sooner its flows were acknowledged than in its periods before
    sooner: float | None = None
    #: what was acknowledged across it in the period, Mbit/s, the busier direction (delays.Crossing), if known
    through: float | None = None


class UplinkWatch:
    """The agents' reports, period by period, into counted uplink rates: a period is evaluated once every
    node reporting lately has reported it or a later one (each node's reports arrive in order), so one
    straggler delays a period instead of losing it; an uplink counts once it held the job back `confirm`
    periods running, at the mean of its last SMOOTHING periods' rates, or in its first period when that
    fell below AT_ONCE of the rate planned for it. One the plan assumes slowed counts at its configured rate
    again once its traffic crossed it `confirm` + 1 periods running without keeping a sender waiting (eased), or
    at once in such a period in which its flows were acknowledged SOONER times sooner than before (a period
    whose flows were acknowledged no sooner than before is not at ease: UNCHANGED); if it is still slow, the
    plan for that rate makes it the bottleneck, and the rules above count it again."""

    def __init__(self, confirm: int = 2) -> None:
        self.confirm = confirm
        self._pending: dict[int, dict[str, Report]] = {}
        self._done = -1  # the newest period evaluated
        self._peaks: deque[dict[tuple[str, int], float]] = deque(maxlen=PEAK_PERIODS)
        self._runs: dict[str, list[tuple[int, float]]] = {}  # rack -> its periods of evidence running
        self._eased: dict[str, list[tuple[int, float]]] = {}  # rack -> its periods running of crossing at ease
        self._delays = DelayBaselines()

    def observe(self, reports: Mapping[str, Sequence[Report]], rack_of: Mapping[str, str],
                link_mbit: Mapping[str, float], planned: Mapping[str, float] | None = None,
                configured: Mapping[str, float] | None = None, settled: int = 0, moving: int = 0) -> list[Finding]:
        """Take the nodes' latest reports; for each period now evaluated, each uplink that held the job back or
        was mended, oldest first. `planned`: each rack's uplink rate in the plan in force;
        `configured`: as configured (an uplink planned below it is watched for being mended, from period `settled`:
        until the plan's trees carry the traffic, an uplink it assumes slowed may sit idle); up to period `moving`
        no uplink holds the job back (new trees went out: pushes still queued across one wait while what moved
        off it is summed in its rack)."""
        newest: dict[str, int] = {}
        for name, recent in reports.items():
            for report in recent:
                if report.period > self._done:
                    self._pending.setdefault(report.period, {})[name] = report
            if recent:
                newest[name] = max(r.period for r in recent)
        if not newest:
            return []
        lately = max(newest.values()) - 3  # a node silent since then (gone, or without an agent) is not awaited
        complete = min(p for p in newest.values() if p > lately)
        found = []
        for period in sorted(p for p in self._pending if p <= complete):
            found += self._evaluate(period, self._pending.pop(period), rack_of, link_mbit, planned or {},
                                    (configured or {}) if period >= settled else {}, period > moving)
            self._done = period
        return found

    def _evaluate(self, period: int, reports: Mapping[str, Report], rack_of: Mapping[str, str],
                  link_mbit: Mapping[str, float], planned: Mapping[str, float],
                  configured: Mapping[str, float], held: bool = True) -> list[Finding]:
        known = {name: r for name, r in reports.items() if name in rack_of}
        self._peaks.append(direction_mbit(known, rack_of))
        peaks: dict[tuple[str, int], float] = {}
        for carried in self._peaks:
            for key, mbit in carried.items():
                peaks[key] = max(mbit, peaks.get(key, 0.0))
        measured = uplink_rates(known, rack_of, link_mbit, peaks, planned) if held else {}
        changes = self._delays.changes(known, rack_of, planned, moving=not held, held=measured)
        later = {rack: times for rack, (times, _) in changes.items() if times is not None}
        through = {rack: crossing.mbit for rack, (_, crossing) in changes.items()}
        # never below what was acknowledged across it (the busier direction: it carried at least that). Per second
        # of backlog one period read a cut 2.5 Mbit/s uplink at 1.7-2.0 while 2.1-2.5 were acknowledged across it
        # (bench/replan.py, 2026-12-04); the plan for the lower rate left it lightly loaded, no sender waited, and it
        # was taken for mended while still cut. The count at once is still decided on the backlog's rate
        floored = {rack: max(mbit, through.get(rack, 0.0)) for rack, mbit in measured.items()}
        found = []
        runs = _running(self._runs, floored, period, max(self.confirm, SMOOTHING))
        for rack, mbit in sorted(measured.items()):
            run = runs[rack]
            counted = len(run) >= self.confirm or mbit < AT_ONCE * planned.get(rack, 0.0)
            rate = statistics.fmean(m for _, m in run[-SMOOTHING:]) if counted else floored[rack]
            found.append(Finding(period, rack, rate, counted))
        slowed = {rack: rate for rack, rate in planned.items() if rate < (1 - SLOWED) * configured.get(rack, 0.0)}
        # at ease, unless its flows' acknowledgements say nothing changed (UNCHANGED)
        quiet = {rack: mbit for rack, mbit in eased(known, rack_of, slowed).items()
                 if later.get(rack, 0.0) * UNCHANGED <= 1}
        sooner = {rack: 1 / times for rack, times in later.items() if rack in slowed and times * SOONER <= 1}
        runs = _running(self._eased, quiet, period, self.confirm + 1)
        for rack, mbit in sorted(quiet.items()):
            counted = len(runs[rack]) > self.confirm or rack in sooner
            found.append(Finding(period, rack, configured[rack] if counted else mbit, counted, mended=True,
                                 sooner=sooner.get(rack)))
        return [f._replace(through=through.get(f.rack)) for f in found]


def _running(runs: dict[str, list[tuple[int, float]]], evidence: Mapping[str, float], period: int,
             keep: int) -> dict[str, list[tuple[int, float]]]:
    """Each rack's periods of `evidence` running, this period's included (the last `keep`): a rack without
    evidence this period is dropped, and one whose evidence skipped a period starts over."""
    for rack in list(runs):
        if rack not in evidence:
            del runs[rack]
    for rack, mbit in evidence.items():
        run = runs.setdefault(rack, [])
        if run and run[-1][0] != period - 1:
            run.clear()
        run.append((period, mbit))
        del run[:-keep]
    return runs
