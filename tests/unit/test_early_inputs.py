"""A stage's choice to send its inputs' gradient before computing its weights' (pure: literal timings)."""

from __future__ import annotations

import pytest

from sluice.worker.torch.pipelining.early import SAMPLES, EarlyInputs


def test_whole_first_then_split_then_split_where_the_inputs_gradient_leaves_sooner_by_more_than_it_costs() -> None:
    # an MLP's stage: whole 2.9 ms (a cold 4.0 first), split 1.5 ms to the inputs' gradient, 3.2 in all
    early = EarlyInputs()
    assert [early.split_next(), early.record(False, 4.0, 4.0)] == [False, None]
    assert [early.split_next(), early.record(False, 2.9, 2.9)] == [False, None]
    assert [early.split_next(), early.record(True, 1.6, 3.4)] == [True, None]
    assert early.split_next() is True
    assert early.record(True, 1.5, 3.2) == (True, pytest.approx(1.4), pytest.approx(0.3))
    assert early.split_next() is True and early.record(True, 9.0, 9.0) is None  # chosen: no more samples
    assert early.chosen == (True, pytest.approx(1.4), pytest.approx(0.3))


def test_a_deep_stage_of_small_layers_keeps_its_backwards_whole() -> None:
    # a hundred small Linear + LayerNorm + GELU: the inputs' path is nearly all of it, each weight's pass
    # costs an engine call (whole 3.5 ms; split 3.9 to the inputs' gradient, 21.9 in all)
    early = EarlyInputs()
    for split, sent, ended in [(False, 3.6, 3.6), (False, 3.5, 3.5), (True, 3.9, 22.0), (True, 3.9, 21.9)]:
        assert early.split_next() is split
        early.record(split, sent, ended)
    assert early.chosen == (False, pytest.approx(-0.4), pytest.approx(18.4))
    assert early.split_next() is False


def test_sooner_by_less_than_it_costs_stays_whole() -> None:
    early = EarlyInputs()
    for split, sent, ended in [(False, 10.0, 10.0), (False, 10.0, 10.0), (True, 7.0, 14.0), (True, 7.0, 14.0)]:
        early.record(split, sent, ended)
    assert early.chosen == (False, 3.0, 4.0) and early.split_next() is False


@pytest.mark.parametrize("forced", [True, False])
def test_forced_takes_no_samples(forced: bool) -> None:
    early = EarlyInputs(forced)
    for _ in range(SAMPLES * 3):
        assert early.split_next() is forced
        assert early.record(forced, 1.0, 2.0) is None
    assert early.chosen is None and not early.whole and not early.split
