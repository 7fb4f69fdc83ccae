"""Rack uplinks measured from per-peer reports: only a rack that stands out, with idle links, is measured."""

from __future__ import annotations

import pytest

from sluice.scheduler.hierarchy.agent import Report
from sluice.scheduler.hierarchy.uplinks import uplink_rates

# two racks of two workers, a server rack; every host link 10 Mbit/s
RACK = {"w0": "r0", "w1": "r0", "w2": "r1", "w3": "r1", "s0": "srv", "s1": "srv"}
LINK = {name: 10.0 for name in RACK}


def report(link_tx: float, *peers: tuple[str, float, float]) -> Report:
    return Report(link_tx, link_tx, link_tx, link_tx, 7, tuple(peers))


def servers(mbit: float, backlog: float) -> tuple[tuple[str, float, float], ...]:
    return (("s0", mbit, backlog), ("s1", mbit, backlog))


def replies(mbit: float, backlog: float, *to: str) -> tuple[tuple[str, float, float], ...]:
    return tuple((w, mbit, backlog) for w in to)


@pytest.mark.parametrize(
    ("reports", "want"),
    [
        # r0's workers backlogged all period for the servers at 1.25 Mbit/s each per server, links idle
        # (2.5 of 10): r0's uplink ran 4 x 1.25 / 1.0 = 5 Mbit/s. r1's senders had short queues.
        ({"w0": report(2.5, *servers(1.25, 1.0)), "w1": report(2.5, *servers(1.25, 1.0)),
          "w2": report(2.5, *servers(1.25, 0.1)), "w3": report(2.5, *servers(1.25, 0.1)),
          "s0": report(5.0, *replies(1.25, 0.1, "w0", "w1", "w2", "w3")),
          "s1": report(5.0, *replies(1.25, 0.1, "w0", "w1", "w2", "w3"))}, {"r0": 5.0}),
        # every rack equally backlogged (a slow round, the CPU, a pipeline): nobody stands out
        ({"w0": report(2.5, *servers(1.25, 0.9)), "w1": report(2.5, *servers(1.25, 0.9)),
          "w2": report(2.5, *servers(1.25, 0.9)), "w3": report(2.5, *servers(1.25, 0.9)),
          "s0": report(5.0, *replies(1.25, 0.9, "w0", "w1", "w2", "w3")),
          "s1": report(5.0, *replies(1.25, 0.9, "w0", "w1", "w2", "w3"))}, {}),
        # r0 stands out, but its senders' links ran full (9 of 10): the host links set the pace
        ({"w0": report(9.0, *servers(1.25, 1.0)), "w1": report(9.0, *servers(1.25, 1.0)),
          "w2": report(2.5, *servers(1.25, 0.1)), "w3": report(2.5, *servers(1.25, 0.1))}, {}),
        # backlogged only half the period: what crossed, per second of backlog: 4 x 1.0 / 0.9
        ({"w0": report(2.0, *servers(1.0, 0.9)), "w1": report(2.0, *servers(1.0, 0.9)),
          "w2": report(2.0, *servers(1.0, 0.0)), "w3": report(2.0, *servers(1.0, 0.0))}, {"r0": 4.0 / 0.9}),
        # r1's downlink slow: the servers' replies to r1 wait, those to r0 do not; the servers' own
        # uplink is not blamed, since what they send to r0 does not wait
        ({"s0": report(3.0, *replies(1.0, 0.0, "w0", "w1"), *replies(0.5, 1.0, "w2", "w3")),
          "s1": report(3.0, *replies(1.0, 0.0, "w0", "w1"), *replies(0.5, 1.0, "w2", "w3")),
          "w0": report(2.0, *servers(1.0, 0.0)), "w2": report(2.0, *servers(1.0, 0.0))}, {"r1": 2.0}),
        # traffic inside a rack never counts; unknown peers and senders are skipped
        ({"w0": report(2.5, ("w1", 2.5, 1.0), ("stranger", 5.0, 1.0)), "ghost": report(1.0, ("s0", 1.0, 1.0))}, {}),
    ],
)
def test_an_uplink_is_measured_only_when_its_rack_stands_out_with_idle_links(
        reports: dict[str, Report], want: dict[str, float]) -> None:
    got = uplink_rates(reports, RACK, LINK)
    assert got == {rack: pytest.approx(rate) for rack, rate in want.items()}
