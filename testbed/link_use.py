"""How busy a testbed host's link was, bin by bin, through given windows: its switch port's counters sampled.

`LinkUse(bed, host)` starts a sampler in the switch namespace (this module run as a program there) that
reads the host's port counters from /proc/self/net/dev every SAMPLE_S until `stop()`; `profile()` turns
the samples into a `LinkProfile` over the windows that matter (a benchmark's timed steps). The counters
count every byte on the wire but the preamble, as tbf does, so 1.0 is the shaped rate: what shows
whether a step waits on its link (busy near 1.0 while the link carries data) or on something else
(links idle, or used at a fraction of their rate while data waits).

The port's received bytes are what the host sent (its uplink); its transmitted bytes what it received.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from testbed.netbed import Netbed

ROOT = Path(__file__).resolve().parent.parent
SAMPLE_S = 0.002
BIN_S = 0.010
#: a bin whose use is under this counts as idle; the others are the link at work
IDLE_BELOW = 0.1

Sample = tuple[float, int, int]  # (CLOCK_MONOTONIC seconds, port bytes received, port bytes sent)


@dataclass(frozen=True)
class LinkProfile:
    """One host link's use through the windows, each direction as a share of the shaped rate."""

    bins: int
    #: mean use over every bin: up (host -> switch) and down (switch -> host)
    up: float
    down: float
    #: share of bins in which the uplink was idle (under IDLE_BELOW)
    up_idle: float
    #: mean use of the uplink over its other bins: how fast it runs while it carries data
    up_working: float

    def describe(self) -> str:
        return (f"uplink {self.up:.0%} busy ({self.up_idle:.0%} of 10 ms bins idle, {self.up_working:.0%} of the "
                f"rate in the others), downlink {self.down:.0%}")

    def fields(self) -> dict[str, float]:
        return {"uplink_use": self.up, "downlink_use": self.down, "uplink_idle_bins": self.up_idle,
                "uplink_working_use": self.up_working}


def profile(samples: Sequence[Sample], windows: Sequence[tuple[float, float]], rate_mbit: float,
            bin_s: float = BIN_S) -> LinkProfile:
    """The link's use in bins of `bin_s` inside `windows` (start, end in the samples' clock); each bin edge's
    counters interpolated between the samples around it. ValueError without a whole bin inside the samples."""
    if len(samples) < 2:
        raise ValueError("at least two samples are needed")
    table = np.asarray(samples, dtype=np.float64)
    clock = table[:, 0]
    ups, downs = [], []
    for start, end in windows:
        start, end = max(start, clock[0]), min(end, clock[-1])
        count = int((end - start) / bin_s + 1e-9)  # whole bins (0.06 / 0.01 is 5.999... in floats)
        if count < 1:
            continue
        edges = start + bin_s * np.arange(count + 1)
        ups.append(np.diff(np.interp(edges, clock, table[:, 1])))
        downs.append(np.diff(np.interp(edges, clock, table[:, 2])))
    if not ups:
        raise ValueError("no whole bin of the windows lies inside the samples")
    full = rate_mbit * 1e6 / 8 * bin_s
    up, down = np.concatenate(ups) / full, np.concatenate(downs) / full
    working = up[up >= IDLE_BELOW]
    return LinkProfile(bins=len(up), up=float(up.mean()), down=float(down.mean()),
                       up_idle=float((up < IDLE_BELOW).mean()),
                       up_working=float(working.mean()) if len(working) else 0.0)


def port_counters(text: str, port: str) -> tuple[int, int] | None:
    """(bytes received, bytes sent) of `port` in /proc/net/dev's `text`, or None when it is not there."""
    for line in text.splitlines():
        name, colon, rest = line.partition(":")
        if colon and name.strip() == port:
            fields = rest.split()
            return int(fields[0]), int(fields[8])
    return None


class LinkUse:
    """A sampler of `host`'s port on the testbed's switch, from construction to `stop()`."""

    def __init__(self, bed: Netbed, host: str) -> None:
        rate = bed.hosts[host].rate_mbit
        if not rate:  # use is a share of the shaped rate: an unshaped link has none
            raise ValueError(f"host {host!r} has an unshaped link: its use has no rate to be a share of")
        self.rate_mbit = float(rate)
        argv = ["ip", "netns", "exec", f"{bed.tag}-sw", sys.executable, "-m", "testbed.link_use",
                bed.hosts[host].port]
        self._proc = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.samples: list[Sample] = []

    def stop(self) -> list[Sample]:
        """End the sampling; the samples taken (a sampler that failed leaves none)."""
        out, _ = self._proc.communicate(input="", timeout=30)
        self.samples = [tuple(row) for row in json.loads(out)] if self._proc.returncode == 0 and out else []
        return self.samples

    def profile(self, windows: Sequence[tuple[float, float]]) -> LinkProfile:
        return profile(self.samples, windows, self.rate_mbit)


def _sample(port: str) -> int:
    """In the switch namespace: sample until stdin closes, then print the samples as JSON."""
    import selectors

    samples: list[Sample] = []
    watch = selectors.DefaultSelector()
    watch.register(sys.stdin, selectors.EVENT_READ)
    with open("/proc/self/net/dev") as dev:
        while not watch.select(SAMPLE_S):  # stdin readable: closed (nothing is ever written to it)
            dev.seek(0)
            counters = port_counters(dev.read(), port)
            if counters is None:
                print(f"no port {port!r} in this namespace", file=sys.stderr)
                return 1
            samples.append((time.monotonic(), *counters))
    json.dump(samples, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(_sample(sys.argv[1]))
