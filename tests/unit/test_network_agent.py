"""The network agent's counters and rates, and the spare bandwidth the manager derives from them (literal tables)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sluice.scheduler.hierarchy.agent import LinkAgent, Report, parse_net_dev, parse_report, spare_mbit
from sluice.scheduler.hierarchy.config import AggregationConfig
from sluice.scheduler.hierarchy.manager import NetworkManager
from sluice.scheduler.hierarchy.placement import NodeAt

NET_DEV = """Inter-|   Receive                                  |  Transmit
 face |bytes packets errs drop fifo frame compressed multicast|bytes packets errs drop fifo colls carrier compressed
    lo: 123456 100 0 0 0 0 0 0 123456 100 0 0 0 0 0 0
  eth0: 5000000 4000 0 0 0 0 0 0 7000000 5000 0 0 0 0 0 0
"""


def test_proc_net_dev_gives_received_and_transmitted_bytes_per_interface() -> None:
    assert parse_net_dev(NET_DEV) == {"lo": (123456, 123456), "eth0": (5_000_000, 7_000_000)}
    assert parse_net_dev("garbage\n\nno: counters here") == {}


@pytest.mark.parametrize(
    ("samples", "want"),
    [
        # (period, now, (link rx, link tx), (own sent, own received)) ... -> the last sample's report
        ([(4, 0.0, (0, 0), (0, 0)), (5, 1.0, (1_250_000, 2_500_000), (1_000_000, 500_000))],
         Report(20.0, 10.0, 8.0, 4.0, period=5)),
        ([(0, 0.0, (0, 0), (0, 0)), (1, 2.0, (2_500_000, 2_500_000), (0, 0))], Report(10.0, 10.0, 0.0, 0.0, 1)),
        ([(0, 0.0, (0, 0), (0, 0))], None),  # the first sample has nothing to compare with
        ([(0, 0.0, (0, 0), (0, 0)), (2, 2.0, (10, 10), (10, 10))], None),  # a period was missed: not aligned
        ([(0, 0.0, (10, 10), (10, 10)), (1, 1.0, (20, 20), (5, 20))], None),  # own counters were reset: skip
        ([(0, 1.0, (0, 0), (0, 0)), (1, 1.0, (10, 10), (10, 10))], None),  # no time passed
    ],
)
def test_the_agent_turns_counter_samples_into_rates(
        samples: list[tuple[int, float, tuple[int, int], tuple[int, int]]], want: Report | None) -> None:
    agent = LinkAgent()
    got = None
    for period, now, link, own in samples:
        got = agent.sample(period, now, link, own)
    assert got == want


@pytest.mark.parametrize(
    ("capacity", "reports", "want"),
    [
        (40.0, [], 40.0),
        (40.0, [Report(10.0, 10.0, 10.0, 10.0)], 40.0),  # all of it is the job's own
        (40.0, [Report(30.0, 5.0, 10.0, 5.0)], 20.0),  # 20 Mbit/s of someone else's going out
        (40.0, [Report(30.0, 30.0, 5.0, 5.0), Report(30.0, 30.0, 5.0, 5.0)], 20.0),  # two nodes, one link
        (40.0, [Report(50.0, 0.0, 0.0, 0.0)], 0.4),  # never below 1% of the rate
        # two nodes' windows a period apart: a burst of one looks like someone else's traffic, so no answer
        (40.0, [Report(30.0, 30.0, 20.0, 5.0, period=7), Report(30.0, 30.0, 0.0, 5.0, period=8)], None),
    ],
)
def test_spare_bandwidth_is_the_rate_less_others_traffic(capacity: float, reports: list[Report],
                                                        want: float | None) -> None:
    got = spare_mbit(capacity, reports)
    assert got == (pytest.approx(want) if want is not None else None)


@pytest.mark.parametrize("raw", [
    None, [1, 2, 3, 4, 0], [1, 2, 3, -1, 0, []], [1, 2, 3, "4", 0, []], [1, 2, 3, 1e9, 0, []],
    [1, 2, 3, 4, 1.5, []], [1, 2, 3, 4, -1, []], [1, 2, 3, 4, True, []], {"a": 1}, [1, 2, 3, 4, 0, {}],
    [1, 2, 3, 4, 0, [["w", 1, 0.5, 9]]], [1, 2, 3, 4, 0, [["", 1, 0.5]]], [1, 2, 3, 4, 0, [["w" * 65, 1, 0.5]]],
    [1, 2, 3, 4, 0, [["w", -1, 0.5]]], [1, 2, 3, 4, 0, [["w", 1, 2.0]]], [1, 2, 3, 4, 0, [[7, 1, 0.5]]],
    [1, 2, 3, 4, 0, [["w", 1, 0.5]] * 1025],
    [1, 2, 3, 4, 0, [], {}], [1, 2, 3, 4, 0, [], [["w", 0, 1]]], [1, 2, 3, 4, 0, [], [["w", -3.0, 1]]],
    [1, 2, 3, 4, 0, [], [["w", "5", 1]]], [1, 2, 3, 4, 0, [], [["w", 5]]], [1, 2, 3, 4, 0, [], [["w", 5, 1, 1]]],
    [1, 2, 3, 4, 0, [], [[9, 5.0, 1]]], [1, 2, 3, 4, 0, [], [["w", 1e9, 1]]], [1, 2, 3, 4, 0, [], [["w", 5, -1]]],
    [1, 2, 3, 4, 0, [], [["w", 5, 1e9]]], [1, 2, 3, 4, 0, [], [["w", 5, "1"]]],
    [1, 2, 3, 4, 0, [], [["w", 5.0, 1]] * 1025], [1, 2, 3, 4, 0, [], [], []],
])
def test_malformed_reports_are_refused(raw: object) -> None:
    assert parse_report(raw) is None
    assert parse_report([1, 2.5, 0, 0, 9, []]) == Report(1.0, 2.5, 0.0, 0.0, period=9)
    report = Report(1.0, 2.5, 0.0, 0.0, 9, (("worker-1", 3.25, 0.5),), (("worker-1", 41.5, 3.0),))
    assert parse_report(report.encode()) == report
    # an agent that does not time acknowledgements sends six fields: still a report
    assert parse_report(report.encode()[:6]) == replace(report, acks=())


def test_the_agent_reports_each_peers_rate_and_backlog() -> None:
    agent = LinkAgent()
    agent.sample(3, 10.0, (0, 0), (0, 0), {"server-0": (1000, 0.1), "worker-1": (500, 0.0), "server-1": (10, 0.0)})
    got = agent.sample(4, 12.0, (0, 0), (0, 0), {"server-0": (251_000, 1.1), "worker-1": (500, 0.0),
                                                   "aggregator-0": (125_000, 0.5), "server-1": (10, 2.0)})
    assert got is not None
    # worker-1 sent nothing and had nothing waiting this period: left out; server-1 got nothing through while
    # its data waited all period (a stalled path): reported
    assert got.peers == (("aggregator-0", pytest.approx(0.5), pytest.approx(0.25)),
                         ("server-0", pytest.approx(1.0), pytest.approx(0.5)), ("server-1", 0.0, 1.0))


def test_the_manager_gives_each_host_its_spare_bandwidth_and_replans_when_it_moves() -> None:
    config = AggregationConfig(mode="plan", racks=("r0: 10.0.0.1 10.0.0.2", "srv: 10.0.9.1"), link_mbit=40.0,
                               uplink_mbit=40.0)
    nodes = [NodeAt("worker-0", "worker", "10.0.0.1"), NodeAt("aggregator-0", "aggregator", "10.0.0.1"),
             NodeAt("worker-1", "worker", "10.0.0.2"), NodeAt("server-0", "server", "10.0.9.1")]
    manager = NetworkManager(config, now=0.0)
    try:
        manager._configured = {"10.0.0.1": 40.0, "10.0.0.2": 40.0, "10.0.9.1": 40.0}
        def period(k: int, burst: float = 0.0) -> None:
            manager.observe_reports({"worker-0": [Report(30.0 + burst, 5.0, 4.0, 1.0, k)],
                                     "aggregator-0": [Report(30.0 + burst, 5.0, 6.0, 1.0, k)],
                                     "worker-1": [Report(4.0, 4.0, 4.0, 4.0, k)]}, nodes)

        period(1)
        period(2, burst=10.0)  # one period's burst (a queue emptying) does not count on its own
        assert manager.spare == {}  # nothing until three periods are in
        manager.observe_reports({"worker-0": [Report(30.0, 5.0, 4.0, 1.0, 3)],
                                 "aggregator-0": [Report(40.0, 5.0, 6.0, 1.0, 2)]}, nodes)
        assert manager.spare == {}  # the aggregator on that host has not reported period 3 yet
        period(3)
        assert manager.spare == {"10.0.0.1": pytest.approx(20.0), "10.0.0.2": pytest.approx(40.0)}
        assert manager._changed()  # 10.0.0.1 moved from 40 to 20, beyond aggregation.change = 0.25
        manager._planned_spare = dict(manager.spare)
        manager.observe({"10.0.0.1": 22.0})
        assert not manager._changed()  # within 25%
    finally:
        manager.close()


def test_the_agent_reports_each_peers_mean_acknowledgement_delay_and_what_got_through_in_the_period() -> None:
    agent = LinkAgent()
    agent.sample(3, 10.0, (0, 0), (0, 0), {}, {"server-0": (1.0, 10, 500_000), "server-1": (0.5, 5, 8000)})
    got = agent.sample(4, 12.0, (0, 0), (0, 0), {}, {"server-0": (1.6, 13, 750_000), "server-1": (0.5, 5, 8000),
                                                     "worker-2": (0.09, 3, 25_000)})
    assert got is not None
    # server-0: 0.6 s over 3 acknowledgements, 250 kB in 2 s; server-1: none this period (left out); worker-2: new,
    # 3 in 0.09 s, 25 kB
    assert got.acks == (("server-0", pytest.approx(200.0), pytest.approx(1.0)),
                        ("worker-2", pytest.approx(30.0), pytest.approx(0.1)))
