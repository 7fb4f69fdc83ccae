"""Transport metrics: log-binned queueing delay per priority, grouped tables, printable summary."""

from __future__ import annotations

import pytest

from sluice.transport.metrics import TransportMetrics, delay_table, percentile_ms, summary_lines

pytestmark = pytest.mark.timeout(10)


def test_percentiles_are_within_one_bin() -> None:
    metrics = TransportMetrics(channels=2)
    for delay_ms in range(1, 101):  # 1..100 ms, uniformly
        metrics.sent(0, priority=0, nbytes=10, delay_s=delay_ms / 1e3)
    bins = metrics.snapshot()["queue_delay"][0]
    assert 50 <= percentile_ms(bins, 0.5) <= 50 * 1.1
    assert 99 <= percentile_ms(bins, 0.99) <= 99 * 1.1
    assert percentile_ms({}, 0.5) == 0.0


def test_bytes_and_messages_per_channel_and_reset() -> None:
    metrics = TransportMetrics(channels=3)
    metrics.sent(2, priority=5, nbytes=100, delay_s=0.0)
    metrics.sent(2, priority=5, nbytes=50, delay_s=-1.0)  # clock noise must not break the histogram
    metrics.received_bytes[0] += 7
    snap = metrics.snapshot()
    assert snap["sent_bytes"] == [0, 0, 150] and snap["sent_messages"] == [0, 0, 2]
    assert snap["received_bytes"] == [7, 0, 0]
    metrics.reset()
    assert metrics.snapshot() == {"sent_bytes": [0, 0, 0], "received_bytes": [0, 0, 0],
                                  "sent_messages": [0, 0, 0], "queue_delay": {}}


@pytest.mark.parametrize(
    ("priorities", "rows", "ranges"),
    [
        ([0, 1, 2], 8, [(0, 0), (1, 1), (2, 2)]),
        (list(range(10)), 5, [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9)]),
        (list(range(10)), 4, [(0, 2), (3, 5), (6, 8), (9, 9)]),
        ([3, 40, 7], 2, [(3, 7), (40, 40)]),
        ([], 8, []),
    ],
)
def test_delay_table_groups_adjacent_priorities(
    priorities: list[int], rows: int, ranges: list[tuple[int, int]]
) -> None:
    metrics = TransportMetrics(channels=1)
    for priority in priorities:
        metrics.sent(0, priority, 1, 0.001 * (priority + 1))
    table = delay_table(metrics.snapshot(), rows)
    assert [row["priorities"] for row in table] == ranges
    assert sum(row["messages"] for row in table) == len(priorities)


def test_urgent_and_bulk_delays_are_told_apart() -> None:
    metrics = TransportMetrics(channels=2)
    for _ in range(99):
        metrics.sent(0, 0, 1, 0.0002)
        metrics.sent(1, 9, 1, 0.050)
    table = delay_table(metrics.snapshot())
    assert table[0]["priorities"] == (0, 0) and table[0]["p99_ms"] < 0.25
    assert table[1]["priorities"] == (9, 9) and 50 <= table[1]["p50_ms"] < 55


def test_summary_names_channels_and_priorities() -> None:
    metrics = TransportMetrics(channels=2)
    metrics.sent(1, 4, 3 << 20, 0.002)
    lines = summary_lines(metrics.snapshot(), "worker 0")
    assert lines[0] == "worker 0: bytes sent / received per channel"
    assert "channel 1:        3.0 MiB sent in 1 messages" in lines[2]
    assert "priority         4: p50" in lines[4]
