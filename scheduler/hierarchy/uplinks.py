"""Rack uplinks' rates from the agents' per-peer reports: what crossed an uplink while it held the job back.

No node can read an uplink's counters, and rounds are synchronous, so every link's average rate
follows the round time: a slow uplink and a slow anything-else look alike in averages. What tells
them apart is where data waits. Each node reports, per peer, what it sent and the fraction of the
period during which data for that peer waited in its queues (transport/metrics.py). Behind a slow
uplink the rack's senders keep a backlog for peers outside the rack the whole period, while their
own links idle, and the other racks' senders do not (they wait for the round, with empty queues).
So an uplink is measured when its rack stands out: its cross-rack backlog is at least `busy` of the
period, at least `stands_out` times the median of comparable racks' (not the racks at the other end
of its traffic), and no sender's link ran above `free` of its rate. Its rate is then what crossed it,
per second of backlog. Both directions are measured (traffic leaving the rack, from its senders;
traffic entering it, from senders elsewhere) and the lower counts. A rack without that evidence in a
period gets no measurement.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field

from sluice.scheduler.hierarchy.agent import Report


@dataclass
class _Pair:
    """What one rack's nodes sent to another's in the period."""
    mbit: float = 0.0
    backlog: float = 0.0  # the largest backlog fraction among its flows
    senders: set[str] = field(default_factory=set)


def uplink_rates(reports: Mapping[str, Report], rack_of: Mapping[str, str], link_mbit: Mapping[str, float],
                 busy: float = 0.8, stands_out: float = 2.0, free: float = 0.8) -> dict[str, float]:
    """Measured uplink rate (Mbit/s) by rack, for the racks whose uplink held the job back this period.

    `reports`: one period's report of each node (by node name); `rack_of`: node -> rack; `link_mbit`:
    node -> the configured rate of its host's link.
    """
    pairs: dict[tuple[str, str], _Pair] = {}
    for sender, report in reports.items():
        home = rack_of.get(sender)
        for peer, mbit, backlog in report.peers:
            away = rack_of.get(peer)
            if home is None or away is None or away == home:
                continue
            pair = pairs.setdefault((home, away), _Pair())
            pair.mbit += mbit
            pair.backlog = max(pair.backlog, backlog)
            pair.senders.add(sender)
    # a slow uplink holds back what its rack sends to every other rack (or receives from every one):
    # the direction's backlog is the least over those racks. A rack is compared with the racks that
    # are neither it nor at the other end of its traffic (those absent this period waited for nothing):
    # the servers' rack is not compared with the workers' racks it answers, nor a rack with itself
    racks = set(rack_of.values())
    directions: list[dict[str, list[_Pair]]] = [{}, {}]
    ends: list[dict[str, set[str]]] = [{}, {}]
    for (home, away), pair in pairs.items():
        directions[0].setdefault(home, []).append(pair)
        directions[1].setdefault(away, []).append(pair)
        ends[0].setdefault(home, set()).add(away)
        ends[1].setdefault(away, set()).add(home)
    measured: dict[str, float] = {}
    for direction, other_ends in zip(directions, ends, strict=True):
        held = {rack: min(p.backlog for p in group) for rack, group in direction.items()}
        for rack, group in direction.items():
            comparable = racks - {rack} - other_ends[rack]
            if not comparable:
                continue
            typical = statistics.median(held.get(r, 0.0) for r in comparable)
            senders: set[str] = set().union(*(p.senders for p in group))
            if (held[rack] < busy or held[rack] < stands_out * typical
                    or any(reports[s].link_tx > free * link_mbit.get(s, float("inf")) for s in senders)):
                continue
            rate = sum(p.mbit for p in group) / held[rack]
            measured[rack] = min(rate, measured.get(rack, rate))
    return measured
