"""Where a job's aggregation trees come from: the configured static sets now, the planning manager next to it."""

from __future__ import annotations

from scheduler.hierarchy.config import AggregationConfig
from scheduler.hierarchy.routes import Route, parse_static_trees


class StaticTrees:
    """The trees of `aggregation.trees`; with several sets and `replan_s`, the next set every replan_s
    seconds (an operator's fixed rotation, and the way tests switch trees mid-run on purpose)."""

    def __init__(self, config: AggregationConfig, now: float) -> None:
        self.sets = parse_static_trees(config.trees)
        self.period = config.replan_s
        self._current = 0
        self._next_at = now + self.period
        self._started = False

    def due(self, now: float) -> list[Route] | None:
        """Trees to switch to now, or None."""
        if not self._started:
            self._started = True
            return self.sets[0]
        if self.period <= 0 or len(self.sets) < 2 or now < self._next_at:
            return None
        self._next_at = now + self.period
        self._current = (self._current + 1) % len(self.sets)
        return self.sets[self._current]


def tree_source(config: AggregationConfig, now: float) -> StaticTrees | None:
    """The job's source of trees; None when aggregation is off."""
    if config.mode == "static":
        return StaticTrees(config, now)
    return None
