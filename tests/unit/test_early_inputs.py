"""A stage's choice to send its inputs' gradients before computing its weights' (pure: literal step times)."""

from __future__ import annotations

import pytest

from sluice.worker.torch.pipelining.early import COLD, TRIALS, EarlyInputs

#: the ways the steps run: COLD whole, the trials (three whole, six split, three whole), then the choice
WHOLE, SPLIT = [False] * 3, [True] * 6


def _steps(early: EarlyInputs, whole: float, split: float, after: int = 2) -> list[bool]:
    """The ways the first COLD + TRIALS + `after` steps ran, each taking `whole` or `split` seconds (cold: 9.0)."""
    ways = []
    for index in range(COLD + len(TRIALS) + after):
        way = early.split_next()
        ways.append(way)
        early.record(way, 9.0 if index < COLD else split if way else whole)
    return ways


def test_cold_steps_whole_then_runs_of_each_way_then_the_faster() -> None:
    # an MLP's two stages: split steps 11.3 ms against 12.2 whole
    early = EarlyInputs()
    assert _steps(early, 0.0122, 0.0113) == [False] * COLD + WHOLE + SPLIT + WHOLE + [True, True]
    # the first step of each run is not timed: it begins where a step of the other way ended
    assert early.chosen is True and early.whole == [0.0122] * 4 and early.split == [0.0113] * 5


def test_steps_that_split_slower_keep_their_backwards_whole() -> None:
    # four stages on two cores: the split's extra CPU time delays the other stages
    early = EarlyInputs()
    assert _steps(early, 0.0150, 0.0160)[-2:] == [False, False]
    assert early.chosen is False


def test_the_first_step_of_a_run_is_left_out_and_the_medians_decide_once() -> None:
    early = EarlyInputs()
    for _ in range(COLD):
        assert early.record(early.split_next(), 5.0) is None
    # whole 99 (first of its run), 10, 12 | split 99 (first), 8, 30, 9, 9, 40 | whole 99 (first), 11, 13
    times = iter([99.0, 10.0, 12.0, 99.0, 8.0, 30.0, 9.0, 9.0, 40.0, 99.0, 11.0, 13.0])
    results = [early.record(early.split_next(), next(times)) for _ in TRIALS]
    assert results == [None] * (len(TRIALS) - 1) + [True]
    assert early.whole == [10.0, 12.0, 11.0, 13.0] and early.split == [8.0, 30.0, 9.0, 9.0, 40.0]
    assert early.record(True, 100.0) is None and early.split_next() is True


@pytest.mark.parametrize("forced", [True, False])
def test_forced_tries_nothing(forced: bool) -> None:
    early = EarlyInputs(forced)
    for _ in range(COLD + len(TRIALS) + 2):
        assert early.split_next() is forced
        assert early.record(forced, 1.0) is None
    assert early.chosen is None and not early.whole and not early.split
