"""The network agent in every node: its host link's traffic (all jobs) and this node's own, reported each period.

A node reads its interface's byte counters from /proc/net/dev (inside a network namespace that is
the namespace's own view) and its transport's payload counters. Each report carries four rates in
Mbit/s: the interface's transmit and receive, and this node's own. The manager adds up the own
rates of the job's nodes on a host, so what the interface carries beyond them is other traffic:
another job's, or anyone's. A host's spare bandwidth for the job is its link rate less that.
"""

from __future__ import annotations

import contextlib
import fcntl
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any

_SIOCGIFADDR = 0x8915


def parse_net_dev(text: str) -> dict[str, tuple[int, int]]:
    """/proc/net/dev -> {interface: (received bytes, transmitted bytes)}."""
    found = {}
    for line in text.splitlines()[2:]:
        name, colon, rest = line.partition(":")
        fields = rest.split()
        if colon and len(fields) >= 9 and fields[0].isdigit() and fields[8].isdigit():
            found[name.strip()] = (int(fields[0]), int(fields[8]))
    return found


def interface_for(address: str) -> str | None:
    """The interface that holds IPv4 `address` in this network namespace (None: none, or not IPv4)."""
    if address in ("localhost", "") or address.startswith("127."):
        return None  # loopback carries every local process's traffic: no link to measure
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            with contextlib.suppress(OSError):
                reply = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
                if socket.inet_ntoa(reply[20:24]) == address:
                    return name
    return None


@dataclass(frozen=True)
class Report:
    """Rates over one period, Mbit/s: the interface's (every process on the host) and this node's own."""

    link_tx: float
    link_rx: float
    own_tx: float
    own_rx: float

    def encode(self) -> list[float]:
        return [round(self.link_tx, 3), round(self.link_rx, 3), round(self.own_tx, 3), round(self.own_rx, 3)]


def parse_report(raw: object) -> Report | None:
    """A HEARTBEAT's `net` field: four finite rates >= 0 below 10 Tbit/s; None if malformed."""
    if (type(raw) is not list or len(raw) != 4
            or not all(type(v) in (int, float) and 0 <= v < 1e7 for v in raw)):
        return None
    return Report(*(float(v) for v in raw))


class LinkAgent:
    """Turns counter samples into rates; the first sample, and a counter that went back, give none."""

    def __init__(self) -> None:
        self._last: tuple[float, int, int, int, int] | None = None

    def sample(self, now: float, link: tuple[int, int], own: tuple[int, int]) -> Report | None:
        """`link` = the interface's (received, transmitted) bytes, `own` = this node's (sent, received)."""
        (rx, tx), (own_tx, own_rx) = link, own
        last, self._last = self._last, (now, tx, rx, own_tx, own_rx)
        if last is None or now <= last[0] or min(tx - last[1], rx - last[2], own_tx - last[3], own_rx - last[4]) < 0:
            return None
        scale = 8 / 1e6 / (now - last[0])
        return Report((tx - last[1]) * scale, (rx - last[2]) * scale, (own_tx - last[3]) * scale,
                      (own_rx - last[4]) * scale)


def spare_mbit(capacity: float, reports: list[Report]) -> float:
    """A host's spare bandwidth for the job from its nodes' reports: the link rate less the busier
    direction of what the interface carries beyond the job's own traffic (at least 1% of the rate:
    the planner needs a positive rate, and a link that full is one it will not load)."""
    if not reports:
        return capacity
    link_tx = max(r.link_tx for r in reports)
    link_rx = max(r.link_rx for r in reports)
    others = max(link_tx - sum(r.own_tx for r in reports), link_rx - sum(r.own_rx for r in reports), 0.0)
    return max(capacity - others, capacity / 100)


class NodeAgent:
    """A node's agent: samples its interface and its transport's counters when asked (each heartbeat)."""

    def __init__(self, interface: str, transport: Any, period: float = 1.0) -> None:
        self.interface, self.transport, self.period = interface, transport, period
        self.rates = LinkAgent()
        self._next = 0.0

    @classmethod
    def for_address(cls, address: str, transport: Any, period: float = 1.0) -> NodeAgent | None:
        """An agent for the interface holding `address`, reporting every `period` seconds; None where
        there is no link to measure."""
        interface = interface_for(address)
        return cls(interface, transport, period) if interface is not None else None

    def report(self) -> Report | None:
        """The rates since the last report, once `period` has passed (asked at every heartbeat)."""
        now = time.monotonic()
        if now < self._next:
            return None
        self._next = now + self.period * 0.9  # heartbeats jitter: a beat a little early still reports
        try:
            with open("/proc/net/dev") as file:
                counters = parse_net_dev(file.read()).get(self.interface)
            stats = self.transport.stats()
        except (OSError, RuntimeError, TimeoutError):
            return None  # a report missed: the next period has one
        if counters is None:
            return None
        own = (sum(stats.get("sent_bytes", ())), sum(stats.get("received_bytes", ())))
        return self.rates.sample(now, counters, own)
