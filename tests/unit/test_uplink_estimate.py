"""Rack uplinks measured from per-peer reports: only a rack that stands out, with idle links, is measured."""

from __future__ import annotations

import pytest

from sluice.scheduler.hierarchy.agent import Report
from sluice.scheduler.hierarchy.uplinks import IN, OUT, direction_mbit, uplink_rates

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


# three racks of one worker each around the servers' rack: a star, as the benchmark's
STAR = {"w0": "r0", "w1": "r1", "w2": "r2", "s0": "srv"}
STAR_LINK = {name: 10.0 for name in STAR}
PEAKS = {("r0", OUT): 10.0, ("r1", OUT): 10.0, ("r2", OUT): 10.0, ("srv", IN): 30.0}


@pytest.mark.parametrize(
    ("reports", "peaks", "want"),
    [
        # the last rack still pushing: r0's traffic out and the servers' in are each nothing but the pair
        # r0 -> srv, held all period; the servers' uplink carried 30 Mbit/s lately, r0's 10: r0 is the slow one
        ({"w0": report(2.0, ("s0", 2.0, 1.0)), "s0": report(1.0, ("w1", 0.5, 0.1), ("w2", 0.5, 0.1))},
         PEAKS, {"r0": 2.0}),
        # the same period, but the servers' uplink carried less lately than r0's: the servers' rack
        ({"w0": report(2.0, ("s0", 2.0, 1.0)), "s0": report(1.0, ("w1", 0.5, 0.1), ("w2", 0.5, 0.1))},
         {**PEAKS, ("srv", IN): 5.0}, {"srv": 2.0}),
        # no history to tell them apart: neither is measured
        ({"w0": report(2.0, ("s0", 2.0, 1.0)), "s0": report(1.0, ("w1", 0.5, 0.1), ("w2", 0.5, 0.1))}, {}, {}),
        # two racks still pushing, both held: the servers' uplink in (held from both) is not blamed for them
        ({"w0": report(2.0, ("s0", 2.0, 1.0)), "w1": report(3.0, ("s0", 3.0, 1.0)),
          "s0": report(1.0, ("w2", 0.5, 0.1))}, PEAKS, {"r0": 2.0, "r1": 3.0}),
        # another rack pushed to the servers without waiting: their uplink in is not held; r0's is
        ({"w0": report(2.0, ("s0", 2.0, 1.0)), "w1": report(5.0, ("s0", 5.0, 0.1))}, {}, {"r0": 2.0}),
        # r0's sender got nothing through all period (an old queue draining): held, but no rate to tell
        ({"w0": report(0.1, ("s0", 0.0, 1.0)), "w1": report(5.0, ("s0", 5.0, 0.1))}, PEAKS, {}),
    ],
)
def test_a_pair_either_end_explains_is_blamed_on_the_end_that_carried_less_lately(
        reports: dict[str, Report], peaks: dict[tuple[str, int], float], want: dict[str, float]) -> None:
    assert uplink_rates(reports, STAR, STAR_LINK, peaks) == {rack: pytest.approx(r) for rack, r in want.items()}


def test_what_each_uplink_carried_each_way() -> None:
    reports = {"w0": report(2.0, ("s0", 2.0, 1.0), ("w1", 1.0, 0.0)), "s0": report(1.0, ("w0", 0.5, 0.1),
                                                                                     ("w1", 0.25, 0.0))}
    assert direction_mbit(reports, STAR) == {("r0", OUT): 3.0, ("r1", IN): 1.25, ("srv", OUT): 0.75,
                                             ("srv", IN): 2.0, ("r0", IN): 0.5}


def pushes(w0: tuple[float, float], others: tuple[float, float]) -> dict[str, Report]:
    """Every rack pushing to the server: r0's sender (Mbit/s, backlog) and the other racks' senders."""
    return {"w0": report(w0[0], ("s0", *w0)), "w1": report(others[0], ("s0", *others)),
            "w2": report(others[0], ("s0", *others))}


@pytest.mark.parametrize(
    ("reports", "planned", "want"),
    [
        # right after a cut: the others still push (and wait 85% of the period) at 9 Mbit/s, r0 gets 2
        # through while it waits all period: half the others' rate and below half its planned 10: measured
        (pushes((2.0, 1.0), (7.65, 0.85)), {"r0": 10.0}, {"r0": 2.0}),
        # the same, but the plan already counts on 3 Mbit/s: not a fall below half of it; waiting alone
        # does not stand out (1.0 against 0.85)
        (pushes((2.0, 1.0), (7.65, 0.85)), {"r0": 3.0}, {}),
        (pushes((2.0, 1.0), (7.65, 0.85)), {}, {}),
        # every rack slow alike (the CPU, say): nobody stands out
        (pushes((2.0, 1.0), (1.8, 0.9)), {"r0": 10.0, "r1": 10.0, "r2": 10.0}, {}),
        # the others waited 40%: r0 stands out by waiting twice as long, whatever the plan
        (pushes((2.0, 0.8), (4.0, 0.4)), {}, {"r0": 2.5}),
    ],
)
def test_right_after_a_cut_a_rack_stands_out_by_its_rate_while_the_others_still_wait(
        reports: dict[str, Report], planned: dict[str, float], want: dict[str, float]) -> None:
    assert uplink_rates(reports, STAR, STAR_LINK, PEAKS, planned) == {r: pytest.approx(m) for r, m in want.items()}


# r0 of the star above, but two servers (s0, s1) and r0's two workers; the other racks idle
TWO_SERVERS = {"w0": "r0", "w3": "r0", "w1": "r1", "w2": "r2", "s0": "srv", "s1": "srv"}


@pytest.mark.parametrize(
    ("reports", "want"),
    [
        # every flow out of r0 waited: its uplink
        ({"w0": report(2.0, ("s0", 1.0, 1.0), ("s1", 1.0, 1.0)), "w3": report(2.0, ("s0", 1.0, 1.0))},
         {"r0": 3.0}),
        # only the flows to s0 waited (a slow server, or its link): not r0's uplink, which s1's flows crossed freely
        ({"w0": report(2.0, ("s0", 1.0, 1.0), ("s1", 1.0, 0.1)), "w3": report(2.0, ("s0", 1.0, 1.0),
                                                                              ("s1", 1.0, 0.2))}, {}),
        # one flow to each server waited all period, the others less: the uplink held flows to both
        ({"w0": report(2.0, ("s0", 1.0, 1.0), ("s1", 1.0, 0.3)), "w3": report(2.0, ("s0", 1.0, 0.2),
                                                                              ("s1", 1.0, 0.9))}, {"r0": 4.0 / 0.9}),
    ],
)
def test_an_uplink_holds_back_flows_to_several_nodes_a_slow_node_only_its_own(
        reports: dict[str, Report], want: dict[str, float]) -> None:
    link = dict.fromkeys(TWO_SERVERS, 10.0)
    assert uplink_rates(reports, TWO_SERVERS, link, PEAKS) == {r: pytest.approx(m) for r, m in want.items()}
