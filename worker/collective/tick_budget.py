"""How often a coordinator may tick: at most `burst` ticks within any `cycle` seconds."""

from __future__ import annotations

from collections import deque


class TickBudget:
    """A sliding window of the last `burst` ticks' start times (pure: the caller gives the clock)."""

    def __init__(self, burst: int, cycle: float) -> None:
        if burst < 1 or cycle <= 0:
            raise ValueError(f"a tick budget needs burst >= 1 and cycle > 0, got {burst} and {cycle}")
        self.burst, self.cycle = burst, cycle
        self._recent: deque[float] = deque(maxlen=burst)

    def free_at(self) -> float:
        """The earliest time the next tick fits: at once (-inf) while the window holds fewer than `burst`
        ticks, else a cycle after the earliest of them."""
        if len(self._recent) < self.burst:
            return float("-inf")
        return self._recent[0] + self.cycle

    def took(self, now: float) -> None:
        """A tick began at `now`."""
        self._recent.append(now)
