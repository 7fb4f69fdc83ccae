"""The coordinator's tick budget: at most `burst` ticks within any cycle, the rest held to the window's end."""

from __future__ import annotations

import math

import pytest

from sluice.worker.collective.tick_budget import TickBudget


@pytest.mark.parametrize(("burst", "ticks", "free"), [
    # one tick a cycle (the old rule): the next fits a cycle after the last
    (1, [], -math.inf),
    (1, [0.0], 1.0),
    (1, [0.0, 1.5], 2.5),
    # four a cycle (a root with three children): three news at once, the fourth too, the fifth waits
    (4, [0.0, 0.1, 0.2], -math.inf),
    (4, [0.0, 0.1, 0.2, 0.3], 1.0),
    (4, [0.0, 0.1, 0.2, 0.3, 1.0], 1.1),
    # the window slides: old ticks leave it
    (2, [0.0, 0.9, 1.0, 5.0], 2.0),  # 1.0 and 5.0 are the last two: a tick fits at once at 5.0
    (2, [0.0, 0.9, 4.5, 5.0], 5.5),
])
def test_the_next_tick_fits_a_cycle_after_the_earliest_of_the_last_burst(burst: int, ticks: list[float],
                                                                          free: float) -> None:
    budget = TickBudget(burst, 1.0)
    for now in ticks:
        budget.took(now)
    assert budget.free_at() == free


@pytest.mark.parametrize(("burst", "cycle"), [(0, 1.0), (2, 0.0), (1, -1.0)])
def test_a_budget_without_room_is_refused(burst: int, cycle: float) -> None:
    with pytest.raises(ValueError, match="burst >= 1 and cycle > 0"):
        TickBudget(burst, cycle)
