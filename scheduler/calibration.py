"""Choosing the chunk size and the in-flight bound from a short measurement at start (pure).

Two costs pull the chunk size apart. An urgent chunk waits behind at most one chunk already on the
wire, so smaller chunks preempt sooner; but every message costs a fixed time in Python and ZeroMQ
(`per_message`), so at link rate B a chunk of c bytes spends `per_message * B / c` of the link's
time on overhead. The chunk is the smallest power of two that keeps that share under 2.5%, between
64 KiB and 1 MiB: 1 MiB on loopback (B = 1-2 GB/s), 256-512 KiB on a 1 Gbit/s link. The share is
set low because the probes measure an idle path: in training the same message also costs the
server's summing and the kernel's work on a busy machine (4 workers x 4 servers at 1 Gbit/s on
2 cores: 256 KiB chunks ran at 74% of the link, 512 KiB at 85-88%).

Between a worker and servers that all share its memory the cap is 4 MiB: a chunk crosses as a
descriptor, so an urgent one waits only for the server's sum of the chunk before it (about 0.4 ms
for 4 MiB), while every message costs the same Python on four hops (2 workers x 2 servers, 16 MiB
push_pull on 2 cores: 1 MiB chunks 16.2 ms a round, calibrated to 4 MiB 10.4). A job takes such a
size only if every worker proposed one: a worker across a network keeps the network's cap.

The in-flight bound must cover the bandwidth-delay product, or the link idles while credit returns;
anything beyond it only adds to the queue an urgent chunk waits behind in the network, and on a
rate-limited link it lets the TCP connections to different servers share the link unevenly, so
one server's share arrives last and the round waits for it (4 workers x 4 servers at 1 Gbit/s:
2 MiB per server ran at 74% of the link, 512 KiB at 88%). So the bound is the smallest of 1, 2,
4, ... chunks whose measured rate reaches 90% of the best rate seen. Between peers on one host
(shared memory, no network queue to fill) it is doubled: there the probes' servers only answer,
while in training they also sum and apply, which slows the credit's return (4 workers x 4 servers
on loopback: 2 MiB ran 20% slower than 4 MiB). ByteScheduler searches the same trade-off with
Bayesian optimisation over 15 trials of 100 steps; a few bursts of a few MiB find it in well
under a second.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from sluice.transport.config import LOCAL_MAX_CHUNK_BYTES, MAX_CHUNK_BYTES

MIN_CHUNK = 64 << 10
MAX_CHUNK = MAX_CHUNK_BYTES
LOCAL_MAX_CHUNK = LOCAL_MAX_CHUNK_BYTES
MAX_INFLIGHT = 16 << 20
OVERHEAD_SHARE = 0.025
GOOD_ENOUGH = 0.9
LOCAL_MARGIN = 2


@dataclass(frozen=True)
class Limits:
    chunk_bytes: int
    inflight_bytes: int

    def as_list(self) -> list[int]:
        return [self.chunk_bytes, self.inflight_bytes]

    def describe(self) -> str:
        return f"chunk {self.chunk_bytes >> 10} KiB, in-flight {self.inflight_bytes >> 10} KiB"


def _power_of_two_at_least(value: float) -> int:
    power = 1
    while power < value:
        power <<= 1
    return power


def choose_chunk(bandwidth: float, per_message: float, local: bool = False) -> int:
    """Chunk bytes for a link of `bandwidth` bytes/s when each message costs `per_message` seconds;
    `local`: every server shares the worker's memory (a larger cap)."""
    if bandwidth <= 0 or per_message < 0:
        raise ValueError(f"bandwidth must be positive and per-message cost non-negative: {bandwidth}, {per_message}")
    wanted = per_message * bandwidth / OVERHEAD_SHARE
    return min(max(_power_of_two_at_least(wanted), MIN_CHUNK), LOCAL_MAX_CHUNK if local else MAX_CHUNK)


def inflight_candidates(chunk: int) -> list[int]:
    """The bounds to try, smallest first: 1, 2, 4, ... chunks up to MAX_INFLIGHT."""
    candidates, bound = [], chunk
    while bound <= MAX_INFLIGHT:
        candidates.append(bound)
        bound *= 2
    return candidates or [MAX_INFLIGHT]


def choose_inflight(trials: Sequence[tuple[int, float]], reference: float, local: bool = False) -> int | None:
    """The smallest tried bound whose rate reached 90% of the best rate seen (`reference` included),
    doubled between `local` peers, at most MAX_INFLIGHT; None while no trial has (try the next)."""
    best = max([reference, *(rate for _, rate in trials)])
    good = [bound for bound, rate in trials if rate >= GOOD_ENOUGH * best]
    if not good:
        return None
    return min((LOCAL_MARGIN if local else 1) * min(good), MAX_INFLIGHT)


def agree(proposals: Sequence[Limits]) -> Limits:
    """One setting for the job from every worker's calibration: the medians (chunks must be equal on
    all workers; a median is robust to one worker measuring on a busy moment)."""
    if not proposals:
        raise ValueError("no calibration results to agree on")
    chunk = int(statistics.median_low([p.chunk_bytes for p in proposals]))
    if min(p.chunk_bytes for p in proposals) <= MAX_CHUNK:  # a worker across a network: no local size for it
        chunk = min(chunk, MAX_CHUNK)
    inflight = int(statistics.median_high([p.inflight_bytes for p in proposals]))
    return Limits(chunk, max(inflight, 2 * chunk))
