"""testbed/link_use.py: a link's use from sampled port counters (pure parts, literal tables)."""

from __future__ import annotations

import pytest

from testbed.link_use import IDLE_BELOW, port_counters, profile

DEV = """Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier
    lo:       0       0    0    0    0     0          0         0        0       0    0    0    0     0       0
 p-w0: 931168705  627877    0    0    0     0          0         0 895630415  605580    0    0    0     0       0
"""


def test_port_counters_read_received_and_sent_bytes_of_the_named_port() -> None:
    assert port_counters(DEV, "p-w0") == (931168705, 895630415)
    assert port_counters(DEV, "lo") == (0, 0)
    assert port_counters(DEV, "p-w1") is None


# 8 Mbit/s: 10_000 bytes a 10 ms bin. Samples every 5 ms; the host sends at the full rate for 20 ms, is idle
# for 20 ms, then sends at half the rate for 20 ms; it receives at a quarter of the rate throughout.
SAMPLES = [(t * 0.005, up, t * 1250) for t, up in enumerate(
    [0, 5000, 10000, 15000, 20000, 20000, 20000, 20000, 20000, 22500, 25000, 27500, 30000])]


@pytest.mark.parametrize(("windows", "bins", "up", "down", "idle", "working"), [
    ([(0.0, 0.06)], 6, 0.5, 0.25, 2 / 6, 0.75),  # 1, 1, 0, 0, 0.5, 0.5
    ([(0.0, 0.02)], 2, 1.0, 0.25, 0.0, 1.0),  # the full-rate window alone
    ([(0.0, 0.02), (0.04, 0.06)], 4, 0.75, 0.25, 0.0, 0.75),  # two windows, their bins together
    ([(0.02, 0.04)], 2, 0.0, 0.25, 1.0, 0.0),  # idle throughout: no working bin
    ([(0.0025, 0.0125)], 1, 1.0, 0.25, 0.0, 1.0),  # bin edges between samples: interpolated
    ([(-1.0, 0.02)], 2, 1.0, 0.25, 0.0, 1.0),  # a window reaching before the samples starts at the first
])
def test_profile_bins_each_window_against_the_rate(windows: list[tuple[float, float]], bins: int, up: float,
                                                   down: float, idle: float, working: float) -> None:
    link = profile(SAMPLES, windows, rate_mbit=8.0)
    assert link.bins == bins
    assert link.up == pytest.approx(up) and link.down == pytest.approx(down)
    assert link.up_idle == pytest.approx(idle) and link.up_working == pytest.approx(working)


def test_profile_refuses_windows_without_a_whole_bin_or_too_few_samples() -> None:
    with pytest.raises(ValueError, match="no whole bin"):
        profile(SAMPLES, [(0.055, 0.06), (1.0, 2.0)], rate_mbit=8.0)
    with pytest.raises(ValueError, match="two samples"):
        profile(SAMPLES[:1], [(0.0, 1.0)], rate_mbit=8.0)


def test_a_bin_just_under_the_idle_threshold_is_idle() -> None:
    quiet = [(0.0, 0, 0), (0.01, int(10000 * IDLE_BELOW) - 1, 0), (0.02, 20000, 0)]
    link = profile(quiet, [(0.0, 0.02)], rate_mbit=8.0)
    assert link.up_idle == pytest.approx(0.5) and link.up_working == pytest.approx((20000 - 999) / 10000)
