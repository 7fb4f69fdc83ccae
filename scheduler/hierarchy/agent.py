"""The network agent in every node: its host link's traffic (all jobs) and this node's own, reported each period.

A node reads its interface's byte counters from /proc/net/dev (inside a network namespace that is
the namespace's own view) and its transport's payload counters. Each report carries four rates in
Mbit/s: the interface's transmit and receive, and this node's own. The manager adds up the own
rates of the job's nodes on a host, so what the interface carries beyond them is other traffic:
another job's, or anyone's. A host's spare bandwidth for the job is its link rate less that.

The nodes on one host must measure the same window, or the bursts of synchronous rounds (a second of
pushes, then a second of replies) show up as other traffic: windows a fraction of a period apart
made the manager re-plan nine times in one benchmark run. So each agent samples at the boundaries of
wall-clock periods (k x period; every process on a host reads the same clock) on a thread of its own,
and every report names its period k: the manager adds up only reports of the same period.
"""

from __future__ import annotations

import contextlib
import fcntl
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
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
    #: the wall-clock period the rates were measured over (period k ends at k x period seconds)
    period: int = 0
    #: per peer this node sent to, or had data waiting for: (peer, Mbit/s sent, the fraction of the period
    #: during which data for it waited in our queues); the manager measures rack uplinks from them (uplinks.py)
    peers: tuple[tuple[str, float, float], ...] = ()
    #: per peer whose messages were acknowledged in the period: (peer, the mean ms from a message's socket to
    #: the acknowledgement that freed its credit, Mbit/s acknowledged): the path's queues, and what got through
    #: it (uplinks.py)
    acks: tuple[tuple[str, float, float], ...] = ()

    def encode(self) -> list[Any]:
        rates = [round(self.link_tx, 3), round(self.link_rx, 3), round(self.own_tx, 3), round(self.own_rx, 3)]
        return [*rates, self.period, [[p, round(m, 3), round(b, 3)] for p, m, b in self.peers],
                [[p, round(ms, 2), round(m, 3)] for p, ms, m in self.acks]]


#: at most this many peers in one report (a job's nodes; more is refused as malformed)
MAX_PEERS = 1024


def _peer(raw: object) -> tuple[str, float, float] | None:
    if (type(raw) is not list or len(raw) != 3 or type(raw[0]) is not str or not 0 < len(raw[0]) <= 64
            or type(raw[1]) not in (int, float) or not 0 <= raw[1] < 1e7
            or type(raw[2]) not in (int, float) or not 0 <= raw[2] <= 1.5):
        return None
    return raw[0], float(raw[1]), float(raw[2])


def _ack(raw: object) -> tuple[str, float, float] | None:
    if (type(raw) is not list or len(raw) != 3 or type(raw[0]) is not str or not 0 < len(raw[0]) <= 64
            or type(raw[1]) not in (int, float) or not 0 < raw[1] < 1e7
            or type(raw[2]) not in (int, float) or not 0 <= raw[2] < 1e7):
        return None
    return raw[0], float(raw[1]), float(raw[2])


def parse_report(raw: object) -> Report | None:
    """A HEARTBEAT's `net` field: four finite rates >= 0 below 10 Tbit/s, the period's number, the
    per-peer list and (from agents that time acknowledgements) the per-peer delays; None if malformed."""
    if (type(raw) is not list or len(raw) not in (6, 7)
            or not all(type(v) in (int, float) and 0 <= v < 1e7 for v in raw[:4])
            or type(raw[4]) is not int or not 0 <= raw[4] < 1 << 53
            or type(raw[5]) is not list or len(raw[5]) > MAX_PEERS
            or (len(raw) == 7 and (type(raw[6]) is not list or len(raw[6]) > MAX_PEERS))):
        return None
    peers = [_peer(p) for p in raw[5]]
    acks = [_ack(a) for a in raw[6]] if len(raw) == 7 else []
    if any(p is None for p in peers) or any(a is None for a in acks):
        return None
    link_tx, link_rx, own_tx, own_rx = (float(v) for v in raw[:4])
    return Report(link_tx, link_rx, own_tx, own_rx, raw[4], tuple(p for p in peers if p is not None),
                  tuple(a for a in acks if a is not None))


class LinkAgent:
    """Turns counter samples into rates; the first sample, one after a missed period, and a counter that
    went back, give none."""

    def __init__(self) -> None:
        self._last: tuple[int, float, int, int, int, int] | None = None
        self._last_peers: Mapping[str, tuple[int, float]] = {}
        self._last_acks: Mapping[str, tuple[float, int, int]] = {}

    def sample(self, period: int, now: float, link: tuple[int, int], own: tuple[int, int],
               peers: Mapping[str, tuple[int, float]] | None = None,
               acks: Mapping[str, tuple[float, int, int]] | None = None) -> Report | None:
        """Counters read at the end of `period`: `link` = the interface's (received, transmitted) bytes,
        `own` = this node's (sent, received), `peers` = per peer (bytes sent, seconds backlogged), `acks` =
        per peer (seconds to acknowledgement summed, messages acknowledged, bytes acknowledged)."""
        (rx, tx), (own_tx, own_rx) = link, own
        last, self._last = self._last, (period, now, tx, rx, own_tx, own_rx)
        last_peers, self._last_peers = self._last_peers, dict(peers or {})
        last_acks, self._last_acks = self._last_acks, dict(acks or {})
        if (last is None or last[0] != period - 1 or now <= last[1]
                or min(tx - last[2], rx - last[3], own_tx - last[4], own_rx - last[5]) < 0):
            return None
        seconds = now - last[1]
        scale = 8 / 1e6 / seconds
        flows = []
        for peer, (sent, backlog) in sorted((peers or {}).items())[:MAX_PEERS]:
            before = last_peers.get(peer, (0, 0.0))
            # a peer whose data only waited (nothing got through all period) is the strongest evidence of a
            # stalled path: it is reported too
            if sent > before[0] or backlog > before[1]:
                flows.append((peer, max(sent - before[0], 0) * scale,
                              min(max(backlog - before[1], 0.0) / seconds, 1.0)))
        delays = []
        for peer, (waited, count, nbytes) in sorted((acks or {}).items())[:MAX_PEERS]:
            before_s, before_count, before_bytes = last_acks.get(peer, (0.0, 0, 0))
            if count > before_count and waited > before_s:
                delays.append((peer, (waited - before_s) / (count - before_count) * 1e3,
                               max(nbytes - before_bytes, 0) * scale))
        return Report((tx - last[2]) * scale, (rx - last[3]) * scale, (own_tx - last[4]) * scale,
                      (own_rx - last[5]) * scale, period, tuple(flows), tuple(delays))


def spare_mbit(capacity: float, reports: list[Report]) -> float | None:
    """A host's spare bandwidth for the job from its nodes' reports: the link rate less the busier
    direction of what the interface carries beyond the job's own traffic (at least 1% of the rate:
    the planner needs a positive rate, and a link that full is one it will not load). None until
    every node on the host has reported the same period: windows that differ tell nothing."""
    if not reports:
        return capacity
    if len({r.period for r in reports}) > 1:
        return None
    link_tx = max(r.link_tx for r in reports)
    link_rx = max(r.link_rx for r in reports)
    others = max(link_tx - sum(r.own_tx for r in reports), link_rx - sum(r.own_rx for r in reports), 0.0)
    return max(capacity - others, capacity / 100)


class NodeAgent:
    """A node's agent: samples its interface and its transport's counters at the end of every wall-clock
    period, on a thread of its own; each heartbeat carries the newest report not yet sent."""

    def __init__(self, interface: str, transport: Any, period: float = 1.0,
                 deliver: Callable[[Report], None] | None = None) -> None:
        self.interface, self.transport, self.period = interface, transport, period
        #: sends a report as soon as it is taken (the manager hears of a change a heartbeat sooner);
        #: None: it waits for the next heartbeat (report())
        self.deliver = deliver
        self.rates = LinkAgent()
        self._latest: Report | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sluice-agent", daemon=True)
        self._thread.start()

    @classmethod
    def for_address(cls, address: str, transport: Any, period: float = 1.0,
                    deliver: Callable[[Report], None] | None = None) -> NodeAgent | None:
        """An agent for the interface holding `address`, reporting every `period` seconds; None where
        there is no link to measure."""
        interface = interface_for(address)
        return cls(interface, transport, period, deliver) if interface is not None else None

    def report(self) -> Report | None:
        """The newest report not yet taken (asked at every heartbeat)."""
        with self._lock:
            latest, self._latest = self._latest, None
        return latest

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        period = int(time.time() / self.period) + 1
        while not self._stop.wait(max(period * self.period - time.time(), 0.0)):
            report = self._sample(period)
            if report is not None and self.deliver is not None:
                self.deliver(report)
            elif report is not None:
                with self._lock:
                    self._latest = report
            period = max(period + 1, int(time.time() / self.period) + 1)  # a late wake-up skips periods

    def _sample(self, period: int) -> Report | None:
        now = time.monotonic()
        try:
            with open("/proc/net/dev") as file:
                counters = parse_net_dev(file.read()).get(self.interface)
            # the counters themselves, not a snapshot through the I/O thread: a busy I/O thread would
            # answer late, and the window would no longer be the other nodes' (ints read whole)
            metrics = self.transport.metrics
            own = (sum(metrics.sent_bytes), sum(metrics.received_bytes))
            sent, backlog = dict(metrics.peer_sent), dict(metrics.peer_backlog_s)
            peers = {peer: (nbytes, backlog.get(peer, 0.0)) for peer, nbytes in sent.items()}
            # the count first: a sum read after it holds at least that many acknowledgements' seconds
            counts, waited, acked = dict(metrics.peer_acks), dict(metrics.peer_ack_s), dict(metrics.peer_acked_bytes)
            acks = {peer: (waited.get(peer, 0.0), count, acked.get(peer, 0)) for peer, count in counts.items()}
        except (OSError, RuntimeError, TimeoutError):
            return None  # a period missed: the one after it has none either, then they resume
        if counters is None:
            return None
        return self.rates.sample(period, now, counters, own, peers, acks)
