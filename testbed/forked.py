"""Forked children inside testbed hosts: start one in a host's namespace, wait for what it announces."""

from __future__ import annotations

import math
import queue
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from testbed.children import Children
from testbed.netbed import Netbed


def _in_host(bed: Netbed, host: str, target: Callable[..., Any], *args: Any) -> Any:
    bed.enter(host)
    return target(*args)


def start_in(children: Children, bed: Netbed, host: str, key: str, target: Callable[..., Any], *args: Any) -> None:
    """Fork a child that moves into `host`'s namespace, then reports `target(*args)` to `children` by key."""
    children.start(key, _in_host, bed, host, target, *args)


def announced(children: Children, key: str, channel: Any, what: str, timeout: float = 30.0) -> Any:
    """The first item child `key` puts on `channel`; raises the child's own error if it failed first,
    or TimeoutError naming `what` was missing. Call it only while `key` is the one child that may
    finish: a result another child reports meanwhile would be consumed here and lost."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return channel.get(timeout=0.2)
        except queue.Empty:
            pass
        try:
            children.collect([key], 0.01)  # raises at once when the child failed or died
        except TimeoutError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{key} did not announce {what} within {timeout:.0f} s") from None
            continue
        raise RuntimeError(f"{key} finished without announcing {what}")


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of `values`, interpolated linearly between the nearest ranks."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class Delays:
    """One run's delays in seconds, with their percentiles in milliseconds."""

    delays: list[float]

    @property
    def p50_ms(self) -> float:
        return percentile(self.delays, 50) * 1e3

    @property
    def p99_ms(self) -> float:
        return percentile(self.delays, 99) * 1e3
