"""Pipeline schedules and stage splits (pure), as literal tables: which micro-batch each stage runs at each clock."""

from __future__ import annotations

import pytest

from sluice.worker.pipeline.schedule import (
    Action,
    balanced_split,
    bubble,
    clock_table,
    gpipe,
    idle_fraction,
    one_f_one_b,
    peak_activations,
    schedule,
)


def _rows(text: str) -> list[list[str]]:
    """A table written one clock a line, stages separated by spaces, `.` for idle."""
    return [["" if cell == "." else cell for cell in line.split()] for line in text.strip().splitlines()]


def test_gpipe_fills_then_drains() -> None:
    assert clock_table(gpipe(3, 4)) == _rows("""
        F0 .  .
        F1 F0 .
        F2 F1 F0
        F3 F2 F1
        .  F3 F2
        .  .  F3
        .  .  B0
        .  B0 B1
        B0 B1 B2
        B1 B2 B3
        B2 B3 .
        B3 .  .
    """)


def test_1f1b_alternates_after_warming_up() -> None:
    assert [[str(a) for a in order] for order in one_f_one_b(2, 4)] == [
        ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"],
        ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"],
    ]
    assert clock_table(one_f_one_b(2, 4)) == _rows("""
        F0 .
        F1 F0
        .  B0
        B0 F1
        F2 B1
        B1 F2
        F3 B2
        B2 F3
        .  B3
        B3 .
    """)


def test_1f1b_with_fewer_micro_batches_than_stages() -> None:
    assert clock_table(one_f_one_b(3, 2)) == _rows("""
        F0 .  .
        F1 F0 .
        .  F1 F0
        .  .  B0
        .  B0 F1
        B0 .  B1
        .  B1 .
        B1 .  .
    """)


@pytest.mark.parametrize(("stages", "micro", "gpipe_peak", "one_f_one_b_peak"), [
    (2, 4, [4, 4], [2, 1]),
    (4, 8, [8, 8, 8, 8], [4, 3, 2, 1]),
    (4, 2, [2, 2, 2, 2], [2, 2, 2, 1]),
    (1, 3, [3], [1]),
])
def test_activations_held_gpipe_all_1f1b_at_most_p_minus_s(stages: int, micro: int, gpipe_peak: list[int],
                                                           one_f_one_b_peak: list[int]) -> None:
    assert [peak_activations(order) for order in gpipe(stages, micro)] == gpipe_peak
    assert [peak_activations(order) for order in one_f_one_b(stages, micro)] == one_f_one_b_peak
    assert all(peak <= stages - s for s, peak in enumerate(one_f_one_b_peak))


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("stages", "micro"), [(2, 2), (2, 4), (2, 8), (4, 2), (4, 4), (4, 8)])
def test_idle_fraction_is_the_bubble_bound_with_equal_times(name: str, stages: int, micro: int) -> None:
    table = clock_table(schedule(name, stages, micro))
    assert len(table) == 2 * (micro + stages - 1)
    assert [idle_fraction(table, s) for s in range(stages)] == [bubble(stages, micro)] * stages


def test_a_backward_twice_as_long_stretches_the_table() -> None:
    table = clock_table(one_f_one_b(2, 2), forward=1, backward=2)
    assert table == _rows("""
        F0 .
        F1 F0
        .  B0
        .  B0
        B0 F1
        B0 B1
        .  B1
        B1 .
        B1 .
    """)


def test_orders_that_wait_on_each_other_are_refused() -> None:
    with pytest.raises(ValueError, match="deadlock"):
        clock_table([[Action("B", 0), Action("F", 0)], [Action("F", 0), Action("B", 0)]])
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zigzag'"):
        schedule("zigzag", 2, 2)
    with pytest.raises(ValueError, match="at least one stage and one micro-batch"):
        gpipe(0, 4)


@pytest.mark.parametrize(("costs", "parts", "starts"), [
    ([1, 1, 1, 1], 2, [0, 2]),
    ([4, 1, 1, 1, 1], 2, [0, 1]),            # the heavy first layer alone
    ([1, 2, 3, 4, 5, 6], 3, [0, 3, 5]),       # stages of 6, 9, 6: no split does better than 9
    ([5, 1, 1], 3, [0, 1, 2]),
    ([1, 1, 1, 10], 2, [0, 3]),
    ([3, 3, 3, 3, 3, 3, 3, 3], 4, [0, 2, 4, 6]),
])
def test_balanced_split_minimises_the_largest_stage(costs: list[float], parts: int, starts: list[int]) -> None:
    assert balanced_split(costs, parts) == starts


def test_balanced_split_refuses_what_cannot_be_cut() -> None:
    with pytest.raises(ValueError, match="cannot cut 2 layers into 3 stages"):
        balanced_split([1, 1], 3)
    with pytest.raises(ValueError, match="negative"):
        balanced_split([1, -1], 2)
