"""Rack uplinks' acknowledgement delays against the other racks': what a cut or a mend changes before anyone waits.

Each network agent reports, per peer, how long its messages took from the socket to the acknowledgement that
freed their credit, and how much was acknowledged (agent.py). A rack uplink's flows (one end in the rack) share
its queue: cut, they are acknowledged several times later than the other racks' cross-rack flows, against the
uplink's own recent periods, while little gets through; mended, several times sooner. The other racks' flows
share the job's ebb and flow (a round's busy start, its quiet tail), so each uplink is compared with them rather
than with a fixed figure, and with its own periods under the same plan (another plan loads it differently).
UplinkWatch (uplinks.py) turns these changes into counted rates.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import NamedTuple

from sluice.scheduler.hierarchy.agent import Report

#: a slowed uplink counts mended at once in a period at ease (uplinks.eased) in which its flows' acknowledgements
#: came back SOONER times sooner, against the other racks' cross-rack flows, than the median of its last
#: periods under the same plan (at least SOONER_AFTER of them). A mended uplink serializes and drains its queue
#: four times faster after a cut to a quarter: measured (bench/replan.py, 2026-12-04) 5-8 times sooner in the
#: first whole period after the set-back, while the periods under the plan for the cut stayed above 0.8 of
#: their median (the other racks' flows share the job's own ebb and flow: a round's quiet tail is quiet there too)
SOONER, SOONER_AFTER = 2.5, 3
#: an uplink counts at once at what got through it (Crossing.mbit) in a period in which its flows were acknowledged
#: LATER times later than the median of its last periods under the same plan (at least SOONER_AFTER of them), both
#: against the other racks' cross-rack flows and in ms, and what got through fell below uplinks.AT_ONCE of the
#: rate planned for it. Right after a cut the round's chunks already in flight queue in the network, not in the
#: senders' queues, so no sender waits and uplinks.uplink_rates sees nothing (measured, bench/replan.py,
#: 2026-12-04: the first evidence 3.4 s after the cut in 3 of 14 cuts) while their acknowledgements took 312-634
#: ms, against 20-122 elsewhere and 100-110 before the cut
LATER = 2.5
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
    direction (what got through it, where the senders' counts hold what went into their sockets)."""

    across_ms: float
    elsewhere_ms: float
    mbit: float


def crossing_delays(reports: Mapping[str, Report], rack_of: Mapping[str, str], rack: str) -> Crossing | None:
    """`rack`'s uplink's Crossing in the period; None unless flows across it and elsewhere were acknowledged."""
    across: list[float] = []
    elsewhere: list[float] = []
    carried = [0.0, 0.0]  # out of the rack, into it
    for sender, report in reports.items():
        home = rack_of.get(sender)
        for peer, ms, mbit in report.acks:
            away = rack_of.get(peer)
            if home is not None and away is not None and home != away:
                (across if rack in (home, away) else elsewhere).append(ms)
                if rack in (home, away):
                    carried[0 if home == rack else 1] += mbit
    if not across or not elsewhere:
        return None
    return Crossing(statistics.median(across), statistics.median(elsewhere), max(carried))


class DelayBaselines:
    """Each planned uplink's last KEPT periods under the plan in force: its flows' delays against the other racks'
    and in ms. Under new rates, all start over: new trees load every uplink differently (measured: a rack whose
    own rate stayed read over 2.5 times later once another rack's cut was planned for, bench/replan.py)."""

    def __init__(self) -> None:
        self._planned: dict[str, float] = {}  # the rates the baselines were taken under
        #: rack -> its last periods' (delay against the other racks', delay in ms)
        self._recent: dict[str, list[tuple[float, float]]] = {}

    def changes(self, reports: Mapping[str, Report], rack_of: Mapping[str, str],
                planned: Mapping[str, float]) -> dict[str, tuple[float | None, Crossing]]:
        """Take one period's reports: for each planned uplink with a Crossing this period, how many times later
        its flows were acknowledged than the median of its baseline's periods (below 1: sooner; None before
        SOONER_AFTER of them), against the other racks' flows (and, when later, in ms as well: not the others
        gone quiet), and the Crossing."""
        if planned != self._planned:
            self._planned, self._recent = dict(planned), {}
        changes: dict[str, tuple[float | None, Crossing]] = {}
        for rack in planned:
            crossing = crossing_delays(reports, rack_of, rack)
            if crossing is None:
                continue
            relative = crossing.across_ms / crossing.elsewhere_ms
            recent = self._recent.setdefault(rack, [])
            later = None
            if len(recent) >= SOONER_AFTER:
                later = relative / statistics.median(r for r, _ in recent)
                if later > 1:
                    later = min(later, crossing.across_ms / statistics.median(ms for _, ms in recent))
            changes[rack] = (later, crossing)
            recent.append((relative, crossing.across_ms))
            del recent[:-KEPT]
        return changes
