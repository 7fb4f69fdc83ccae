"""Rack uplinks' acknowledgement delays against the other racks': what a mend changes before the waits can tell.

Each network agent reports, per peer, how long its messages took from the socket to the acknowledgement that
freed their credit, and how much was acknowledged (agent.py). A rack uplink's flows (one end in the rack) share
its queue: mended, they are acknowledged several times sooner than before against the other racks' cross-rack
flows; still slow, no sooner. The other racks' flows share the job's ebb and flow (a round's busy start, its
quiet tail), so each uplink is compared with them rather than with a fixed figure, and with its own periods
under the same plan (another plan loads it differently). UplinkWatch (uplinks.py) turns this into counts.
"""

from __future__ import annotations

import statistics
from collections.abc import Collection, Mapping, Sequence
from typing import NamedTuple

from sluice.scheduler.hierarchy.agent import Report

#: a slowed uplink counts mended at once in a period at ease (uplinks.eased) in which its flows' acknowledgements
#: came back SOONER times sooner, against the other racks' cross-rack flows, than the median of its last
#: periods under the same plan (at least SOONER_AFTER of them). A mended uplink serializes and drains its queue
#: four times faster after a cut to a quarter: measured (bench/replan.py, 2026-12-04) 5-8 times sooner in the
#: first whole period after the set-back, while the periods under the plan for the cut stayed above 0.8 of
#: their median (the other racks' flows share the job's own ebb and flow: a round's quiet tail is quiet there too)
SOONER, SOONER_AFTER = 2.5, 3
#: how many periods under one plan each uplink's baseline holds
KEPT = 5
#: a period at ease (uplinks.eased) is no sign of a mend when the uplink's flows were acknowledged no sooner than
#: 1/UNCHANGED of its baseline: a plan made for a rate below the uplink's leaves it lightly loaded, and no sender
#: waits. Measured (bench/replan.py, 2026-12-04): after a cut to 2.5 Mbit/s counted at 1.4-1.6, all three repeats
#: took the cut uplink for mended after three such periods, and re-planned twice more; under a plan for a cut its
#: flows stayed above 0.8 of their baseline, and after a set-back fell to 1/5-1/8 of it
UNCHANGED = 1.5


class Crossing(NamedTuple):
    """A rack uplink's flows in one period, from their acknowledgements: the median delay, ms, of the flows across
    it (one end in the rack) and of the other cross-rack flows; what was acknowledged across it, Mbit/s, the busier
    direction (what got through it, where the senders' counts hold what went into their sockets; logged)."""

    across_ms: float
    elsewhere_ms: float
    mbit: float


#: one acknowledged cross-rack flow in a period: (the sender's rack, the peer's rack, mean ms, Mbit/s acknowledged)
Flow = tuple[str, str, float, float]


def cross_flows(reports: Mapping[str, Report], rack_of: Mapping[str, str]) -> list[Flow]:
    """The period's acknowledged flows between racks, read once for every uplink's Crossing."""
    flows = []
    for sender, report in reports.items():
        home = rack_of.get(sender)
        for peer, ms, mbit in report.acks:
            away = rack_of.get(peer)
            if home is not None and away is not None and home != away:
                flows.append((home, away, ms, mbit))
    return flows


def crossing_delays(flows: Sequence[Flow], rack: str) -> Crossing | None:
    """`rack`'s uplink's Crossing among the period's `flows`; None unless flows across it and elsewhere were
    acknowledged."""
    across: list[float] = []
    elsewhere: list[float] = []
    carried = [0.0, 0.0]  # out of the rack, into it
    for home, away, ms, mbit in flows:
        if rack in (home, away):
            across.append(ms)
            carried[0 if home == rack else 1] += mbit
        else:
            elsewhere.append(ms)
    if not across or not elsewhere:
        return None
    return Crossing(statistics.median(across), statistics.median(elsewhere), max(carried))


class DelayBaselines:
    """Each planned uplink's last KEPT periods under the plan in force, its flows' delays against the other racks'.
    Under new rates all start over (new trees load every uplink differently), and periods while the new trees take
    over the traffic are left out (the old trees' queues drain then: measured, bench/replan.py, 2026-12-04, a cut
    uplink read 2.5 times sooner against such periods and was taken for mended), as are an uplink's periods in which
    it held the job back (its queue full: a plan for a rate above the uplink's makes it the bottleneck in some
    periods and not in others, and a period at ease read 2.5 times sooner against a baseline of both and was taken
    for mended while still cut; bench/results/replan_s46_2026-12-04.txt, repeat 2)."""

    def __init__(self) -> None:
        self._planned: dict[str, float] = {}  # the rates the baselines were taken under
        self._recent: dict[str, list[float]] = {}  # rack -> its last periods' delays against the other racks'

    def changes(self, reports: Mapping[str, Report], rack_of: Mapping[str, str], planned: Mapping[str, float],
                moving: bool = False, held: Collection[str] = ()) -> dict[str, tuple[float | None, Crossing]]:
        """Take one period's reports (`moving`: new trees are taking over the traffic, no baseline; `held`: the racks
        whose uplink held the job back in it, no baseline for them): for each
        planned uplink with a Crossing this period, how many times later its flows were acknowledged, against the
        other racks' flows, than the median of its baseline's periods (below 1: sooner; None before SOONER_AFTER
        of them), and the Crossing."""
        if planned != self._planned:
            self._planned, self._recent = dict(planned), {}
        changes: dict[str, tuple[float | None, Crossing]] = {}
        flows = cross_flows(reports, rack_of)
        for rack in planned:
            crossing = crossing_delays(flows, rack)
            if crossing is None:
                continue
            relative = crossing.across_ms / crossing.elsewhere_ms
            recent = self._recent.setdefault(rack, [])
            later = relative / statistics.median(recent) if len(recent) >= SOONER_AFTER else None
            changes[rack] = (later, crossing)
            if not moving and rack not in held:
                recent.append(relative)
                del recent[:-KEPT]
        return changes
