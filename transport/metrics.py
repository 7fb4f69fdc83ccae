"""Transport metrics: queueing delay per priority (log-binned, p50/p99) and bytes per channel.

A message's queueing delay is the time from `send()` to the moment it is handed to its socket: the
time it waited in our priority queue behind other messages and the in-flight bound. Delays go into
a histogram per priority with 8 bins per octave of microseconds (percentiles within 9%), so
recording costs one logarithm and memory stays bounded however long the job runs.

`reset()` starts a new window for the printed summaries; `totals()` still counts from the start (the
window folded in at each reset), which is what monotonic Prometheus counters need (transport/prometheus.py).
`StepTimes` bins the time between a worker's optimizer steps the same way.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

_BINS_PER_OCTAVE = 8
_BINS = 256  # up to 2**32 us, about 71 minutes


def _bin(delay_s: float) -> int:
    return min(int(_BINS_PER_OCTAVE * math.log2(delay_s * 1e6 + 1.0)), _BINS - 1)


def _upper_ms(bin_: int) -> float:
    return float(2.0 ** ((bin_ + 1) / _BINS_PER_OCTAVE) - 1.0) / 1e3


def bin_upper_s(bin_: int) -> float:
    """The upper edge of a delay bin in seconds (a histogram bucket's `le`)."""
    return _upper_ms(bin_) / 1e3


def bin_middle_s(bin_: int) -> float:
    """A delay bin's middle in seconds (what a message of that bin counts toward an estimated sum)."""
    low = 0.0 if bin_ == 0 else bin_upper_s(bin_ - 1)
    return (low + bin_upper_s(bin_)) / 2


def percentile_ms(bins: Mapping[int, int], fraction: float) -> float:
    """The delay in ms below which `fraction` of the recorded messages fall (upper bin edge)."""
    total = sum(bins.values())
    if not total:
        return 0.0
    rank, seen = fraction * total, 0
    for bin_ in sorted(bins):
        seen += bins[bin_]
        if seen >= rank:
            return _upper_ms(bin_)
    return _upper_ms(max(bins))


class TransportMetrics:
    """Counters of one transport; written by its I/O thread only."""

    def __init__(self, channels: int) -> None:
        self.channels = channels
        #: per peer, never reset (the network agent takes differences): payload bytes sent to it, and
        #: seconds during which something for it waited in our queues (a backlog: the path to it, not
        #: our demand, set the pace then)
        self.peer_sent: dict[str, int] = {}
        self.peer_backlog_s: dict[str, float] = {}
        #: per peer, never reset: seconds from each message's socket to the acknowledgement that freed its
        #: credit, summed, and how many were acknowledged (a path's delay: its links' queues and rates); the
        #: bytes acknowledged (what got through the path, where peer_sent counts what went into the socket)
        self.peer_ack_s: dict[str, float] = {}
        self.peer_acks: dict[str, int] = {}
        self.peer_acked_bytes: dict[str, int] = {}
        #: what earlier windows counted (folded in by reset()), and a sequence number that is odd while
        #: a reset runs, so a reader on another thread (totals()) can tell it saw a torn state
        self._before: dict[str, Any] = {"sent_bytes": [0] * channels, "received_bytes": [0] * channels,
                                        "sent_messages": [0] * channels, "acks_sent": [0] * channels,
                                        "queue_delay": {}}
        self._resets = 0
        self._fresh()

    def reset(self) -> None:
        """Start a new window (the summaries' and stats(reset=True)'s); totals() keeps counting."""
        self._resets += 1
        before = self._before
        for name in ("sent_bytes", "received_bytes", "sent_messages", "acks_sent"):
            before[name] = [a + b for a, b in zip(before[name], getattr(self, name), strict=True)]
        folded: dict[int, list[int]] = before["queue_delay"]
        for priority, counts in self._delays.items():
            into = folded.setdefault(priority, [0] * _BINS)
            for bin_, count in enumerate(counts):
                into[bin_] += count
        self._fresh()
        self._resets += 1

    def _fresh(self) -> None:
        self.sent_bytes = [0] * self.channels
        self.received_bytes = [0] * self.channels
        self.sent_messages = [0] * self.channels
        #: credit acknowledgements this transport sent, per channel (transport.stats() reports them)
        self.acks_sent = [0] * self.channels
        self._delays: dict[int, list[int]] = {}

    def sent(self, channel: int, priority: int, nbytes: int, delay_s: float, peer: str | None = None) -> None:
        if peer is not None:
            self.peer_sent[peer] = self.peer_sent.get(peer, 0) + nbytes
        self.sent_bytes[channel] += nbytes
        self.sent_messages[channel] += 1
        counts = self._delays.get(priority)
        if counts is None:
            counts = self._delays[priority] = [0] * _BINS
        counts[_bin(max(delay_s, 0.0))] += 1

    def backlogged(self, peers: Iterable[str], seconds: float) -> None:
        """`peers` had data waiting in our queues for the last `seconds`."""
        backlog = self.peer_backlog_s
        for peer in peers:
            backlog[peer] = backlog.get(peer, 0.0) + seconds

    def acked(self, peer: str, seconds: float, count: int, nbytes: int) -> None:
        """`peer` acknowledged `nbytes`, which completed `count` messages, `seconds` after they went to their
        socket in all."""
        self.peer_acked_bytes[peer] = self.peer_acked_bytes.get(peer, 0) + nbytes
        if count:
            self.peer_ack_s[peer] = self.peer_ack_s.get(peer, 0.0) + seconds
            self.peer_acks[peer] = self.peer_acks.get(peer, 0) + count

    def totals(self) -> dict[str, Any]:
        """Counts since the start, resets folded in, safe to call from any thread (written by the I/O
        thread only, read here without a lock: a read torn by a concurrent reset is taken again).
        queue_delay: [(priority, dense list of _BINS counts), ...], a priority once per window it was
        counted in (adding them up is left to the reader, who may need only a few sums of each)."""
        while True:
            seen = self._resets
            if seen % 2:
                time.sleep(1e-4)  # a reset is folding right now (a few microseconds)
                continue
            before = self._before
            taken: dict[str, Any] = {
                name: [a + b for a, b in zip(before[name], list(getattr(self, name)), strict=True)]
                for name in ("sent_bytes", "received_bytes", "sent_messages", "acks_sent")
            }
            taken["queue_delay"] = [(priority, list(counts)) for windows in (before["queue_delay"], self._delays)
                                    for priority, counts in dict(windows).items()]
            if self._resets == seen:
                return taken

    def snapshot(self) -> dict[str, Any]:
        """Plain data: bytes per channel and, per priority, the sparse delay histogram {bin: count}."""
        return {
            "sent_bytes": list(self.sent_bytes),
            "received_bytes": list(self.received_bytes),
            "sent_messages": list(self.sent_messages),
            "queue_delay": {
                priority: {b: n for b, n in enumerate(counts) if n} for priority, counts in self._delays.items()
            },
        }


class StepTimes:
    """The time between a worker's successive optimizer steps, binned as queueing delays are; `tick`
    once per step (the framework shim's step()), read from any thread."""

    def __init__(self) -> None:
        self.count = 0
        self.total_s = 0.0
        self.bins = [0] * _BINS
        self._last: float | None = None

    def tick(self, now: float) -> None:
        """A step began at `now` (monotonic seconds): the interval since the previous one is a step's time."""
        last, self._last = self._last, now
        if last is not None:
            seconds = max(now - last, 0.0)
            self.bins[_bin(seconds)] += 1
            self.total_s += seconds
            self.count += 1


def delay_table(snapshot: Mapping[str, Any], rows: int = 8) -> list[dict[str, Any]]:
    """Queueing delay per priority range: at most `rows` ranges of adjacent priorities, most urgent first.

    Each row: {"priorities": (lowest, highest), "messages", "p50_ms", "p99_ms"}.
    """
    delays: Mapping[int, Mapping[int, int]] = snapshot.get("queue_delay", {})
    priorities = sorted(delays)
    if not priorities:
        return []
    per_row = math.ceil(len(priorities) / rows)
    table = []
    for start in range(0, len(priorities), per_row):
        group = priorities[start:start + per_row]
        merged: dict[int, int] = {}
        for priority in group:
            for bin_, count in delays[priority].items():
                merged[bin_] = merged.get(bin_, 0) + count
        table.append({
            "priorities": (group[0], group[-1]),
            "messages": sum(merged.values()),
            "p50_ms": percentile_ms(merged, 0.5),
            "p99_ms": percentile_ms(merged, 0.99),
        })
    return table


def summary_lines(snapshot: Mapping[str, Any], title: str) -> list[str]:
    """A printable summary: bytes and messages per channel, then queueing delay per priority range."""
    lines = [f"{title}: bytes sent / received per channel"]
    sent: Sequence[int] = snapshot.get("sent_bytes", [])
    received: Sequence[int] = snapshot.get("received_bytes", [])
    messages: Sequence[int] = snapshot.get("sent_messages", [])
    for channel, (out, into, count) in enumerate(zip(sent, received, messages, strict=False)):
        lines.append(f"  channel {channel}: {out / 2**20:10.1f} MiB sent in {count} messages, "
                     f"{into / 2**20:10.1f} MiB received")
    table = delay_table(snapshot)
    if table:
        lines.append(f"{title}: queueing delay before the socket, per priority (0 most urgent)")
        for row in table:
            low, high = row["priorities"]
            label = f"{low}" if low == high else f"{low}-{high}"
            lines.append(f"  priority {label:>9}: p50 {row['p50_ms']:9.3f} ms  p99 {row['p99_ms']:9.3f} ms  "
                         f"({row['messages']} messages)")
    return lines
