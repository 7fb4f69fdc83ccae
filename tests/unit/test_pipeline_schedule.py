"""Pipeline schedules and stage splits (pure), as literal tables: which micro-batch each stage runs at each clock."""

from __future__ import annotations

import pytest

from sluice.worker.pipeline.interleave import interleaved_1f1b, interleaved_zero_bubble
from sluice.worker.pipeline.schedule import (
    Action,
    balanced_split,
    bubble,
    canonical,
    clock_table,
    gpipe,
    idle_fraction,
    inputs_first,
    one_f_one_b,
    peak_activations,
    replay,
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


def test_inputs_first_sends_each_inputs_gradient_before_the_weights_and_saves_a_w_a_hop() -> None:
    """The backward twice a forward (I = W = 1): the first stage's B stays whole (nothing waits for its
    inputs' gradient); stage 1 sends each I at once, so stage 0 starts a clock earlier (8 clocks, not 9)."""
    assert inputs_first(gpipe(2, 2))[1] == [Action("F", 0), Action("F", 1), Action("I", 0), Action("W", 0),
                                            Action("I", 1), Action("W", 1)]
    assert inputs_first(gpipe(2, 2))[0] == gpipe(2, 2)[0]
    assert clock_table(gpipe(2, 2), forward=1, backward=2) == _rows("""
        F0 .
        F1 F0
        .  F1
        .  B0
        .  B0
        B0 B1
        B0 B1
        B1 .
        B1 .
    """)
    assert clock_table(inputs_first(gpipe(2, 2)), forward=1, backward=2) == _rows("""
        F0 .
        F1 F0
        .  F1
        .  I0
        B0 W0
        B0 I1
        B1 W1
        B1 .
    """)
    assert clock_table(inputs_first(one_f_one_b(2, 2)), forward=1, backward=2) == _rows("""
        F0 .
        F1 F0
        .  I0
        B0 W0
        B0 F1
        .  I1
        B1 W1
        B1 .
    """)
    # the activations held are 1F1B's (a W right after its I frees what the B would have); a virtual stage
    # 0 (the first worker's first chunk) keeps its B, every other chunk's is split
    assert [peak_activations(o) for o in inputs_first(one_f_one_b(3, 4))] == [3, 2, 1]
    split = inputs_first(interleaved_1f1b(2, 4, 2))
    assert {(str(a)[0], a.kind) for o in split for a in o if a.kind in "BIW"} == {("0", "B"), ("1", "I"), ("1", "W"),
                                                                                ("2", "I"), ("2", "W"), ("3", "I"),
                                                                                ("3", "W")}


#: stage 0's forward 1 and backward 2, stage 1's 0.5 and 1.5 (the times bench/pipeline.py measures)
_TIMES = {(0, "F"): 1.0, (0, "B"): 2.0, (1, "F"): 0.5, (1, "B"): 1.5}


def _runs(cores: int | None) -> list[tuple[int, str, float, float]]:
    runs = replay(one_f_one_b(2, 2), lambda action, stage: _TIMES[(stage, action.kind)], cores)
    return [(rank, str(action), start, end) for rank, action, start, end in runs]


def test_replay_at_measured_times_starts_each_action_once_its_inputs_are_there() -> None:
    assert _runs(None) == [
        (0, "F0", 0.0, 1.0), (0, "F1", 1.0, 2.0), (1, "F0", 1.0, 1.5), (1, "B0", 1.5, 3.0),
        (0, "B0", 3.0, 5.0), (1, "F1", 3.0, 3.5), (1, "B1", 3.5, 5.0), (0, "B1", 5.0, 7.0)]


def test_replay_on_fewer_cores_than_workers_queues_what_is_ready() -> None:
    """On one core the step is all the compute (10), each action after the one before it, the one ready
    first (the lower worker on a tie) going next."""
    assert _runs(1) == [
        (0, "F0", 0.0, 1.0), (0, "F1", 1.0, 2.0), (1, "F0", 2.0, 2.5), (1, "B0", 2.5, 4.0),
        (0, "B0", 4.0, 6.0), (1, "F1", 6.0, 6.5), (1, "B1", 6.5, 8.0), (0, "B1", 8.0, 10.0)]


def test_orders_that_wait_on_each_other_are_refused() -> None:
    with pytest.raises(ValueError, match="deadlock"):
        clock_table([[Action("B", 0), Action("F", 0)], [Action("F", 0), Action("B", 0)]])
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zigzag'"):
        schedule("zigzag", 2, 2)
    with pytest.raises(ValueError, match="at least one stage and one micro-batch"):
        gpipe(0, 4)


def test_interleaved_1f1b_goes_round_the_stages_twice() -> None:
    """P = 2, V = 2: worker 0 holds virtual stages 0 and 2, worker 1 stages 1 and 3; rounds of 2 (M // P = 2)."""
    assert [[str(a) for a in order] for order in interleaved_1f1b(2, 4, 2)] == [
        ["0F0", "0F1", "2F0", "2F1", "0F2", "2B0", "0F3", "2B1", "2F2", "0B0", "2F3", "0B1", "2B2", "2B3", "0B2",
         "0B3"],
        ["1F0", "1F1", "3F0", "3B0", "3F1", "3B1", "1F2", "1B0", "1F3", "1B1", "3F2", "3B2", "3F3", "3B3", "1B2",
         "1B3"],
    ]
    assert clock_table(interleaved_1f1b(2, 4, 2)) == _rows("""
        0F0 .
        0F1 1F0
        2F0 1F1
        2F1 3F0
        0F2 3B0
        2B0 3F1
        0F3 3B1
        2B1 1F2
        2F2 1B0
        0B0 1F3
        2F3 1B1
        0B1 3F2
        .   3B2
        2B2 3F3
        .   3B3
        2B3 1B2
        0B2 1B3
        0B3 .
    """)


def test_zb_h1_defers_each_stages_weight_gradients_by_its_rank() -> None:
    """ZB-H1 (one chunk per stage): stage s runs each W s backwards after its I, the Ws filling the drain."""
    assert [[str(a) for a in order] for order in schedule("interleavedzerobubble", 3, 4)] == [
        ["F0", "F1", "F2", "I0", "W0", "F3", "I1", "W1", "I2", "W2", "I3", "W3"],
        ["F0", "F1", "I0", "F2", "I1", "W0", "F3", "I2", "W1", "I3", "W2", "W3"],
        ["F0", "I0", "F1", "I1", "F2", "I2", "W0", "F3", "I3", "W1", "W2", "W3"],
    ]
    assert clock_table(schedule("interleavedzerobubble", 3, 4)) == _rows("""
        F0 .  .
        F1 F0 .
        F2 F1 F0
        .  .  I0
        .  I0 F1
        I0 F2 I1
        W0 I1 F2
        F3 W0 I2
        I1 F3 W0
        W1 I2 F3
        I2 W1 I3
        W2 I3 W1
        I3 W2 W2
        W3 W3 W3
    """)


def test_interleaved_zero_bubble_with_two_chunks() -> None:
    assert clock_table(interleaved_zero_bubble(2, 2, 2)) == _rows("""
        0F0 .
        0F1 1F0
        2F0 1F1
        2F1 3F0
        .   3I0
        2I0 3F1
        2W0 3I1
        2I1 3W0
        2W1 1I0
        0I0 3W1
        0W0 1I1
        0I1 1W0
        0W1 1W1
    """)


GRID = [(p, m) for p in (2, 3, 4) for m in range(p, 3 * p + 1) if m % max(1, m // p) == 0]


@pytest.mark.parametrize(("stages", "micro"), GRID)
@pytest.mark.parametrize("virtual", [1, 2, 3])
def test_interleaving_cuts_the_bubble_by_the_chunks(stages: int, micro: int, virtual: int) -> None:
    """Forward = backward on every chunk (a V-th of the stage's): idle (P-1)/(VM+P-1), the bubble (P-1)/(VM) of
    the work, 1F1B's over V; 1F1B's with V = 1 (its order differs: 2 (P-1-s) forwards first)."""
    table = clock_table(interleaved_1f1b(stages, micro, virtual))
    want = (stages - 1) / (virtual * micro + stages - 1)
    assert [idle_fraction(table, s) for s in range(stages)] == pytest.approx([want] * stages)
    idle_clocks = len(table) - 2 * virtual * micro
    assert idle_clocks / (2 * virtual * micro) == pytest.approx((stages - 1) / micro / virtual)
    if virtual == 1:
        assert want == bubble(stages, micro)


@pytest.mark.parametrize(("stages", "micro"), GRID)
@pytest.mark.parametrize("virtual", [1, 2])
def test_zero_bubble_leaves_a_third_of_1f1bs_bubble(stages: int, micro: int, virtual: int) -> None:
    """F = I = W (a whole backward B = I + W): ZB-H1 idles (P-1) clocks a step where 1F1B idles 3 (P-1), and
    holds at most P micro-batches (forward done, W not) on every stage, 1F1B's peak on its first."""
    zero = clock_table(interleaved_zero_bubble(stages, micro, virtual))
    ours = [round(idle_fraction(zero, s) * len(zero)) for s in range(stages)]
    assert ours == [stages - 1] * stages
    assert [idle_fraction(zero, s) for s in range(stages)] == pytest.approx(
        [(stages - 1) / (3 * virtual * micro + stages - 1)] * stages)
    if virtual == 1:
        theirs = clock_table(one_f_one_b(stages, micro), backward=2)
        assert [round(idle_fraction(theirs, s) * len(theirs)) for s in range(stages)] == [3 * (stages - 1)] * stages
        assert [peak_activations(o) for o in interleaved_zero_bubble(stages, micro, 1)] == [stages] * stages
        assert max(peak_activations(o) for o in one_f_one_b(stages, micro)) == stages


def test_orders_are_torchs() -> None:
    """The same actions in the same order as torch.distributed.pipelining's ScheduleInterleaved1F1B and
    ScheduleInterleavedZeroBubble (its orders less the empty slots it pads them with)."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    for name, kind in (("interleaved1f1b", schedules.ScheduleInterleaved1F1B),
                       ("interleavedzerobubble", schedules.ScheduleInterleavedZeroBubble)):
        for stages, micro, virtual in [(2, 4, 2), (4, 8, 2), (3, 6, 3), (4, 2, 2), (2, 6, 1), (4, 12, 2), (3, 4, 1)]:
            theirs = object.__new__(kind)  # its order without a process group
            theirs.n_local_stages, theirs.pp_group_size, theirs._n_microbatches = virtual, stages, micro
            theirs.number_of_rounds = max(1, micro // stages)
            theirs.microbatches_per_round = micro // theirs.number_of_rounds
            for rank, order in enumerate(schedule(name, stages, micro, virtual)):
                want = [str(a) for a in theirs._calculate_single_rank_operations(rank) if a is not None]
                assert [str(a) if virtual > 1 else f"{rank}{a}" for a in order] == want, (name, stages, micro, rank)


def test_schedule_names_and_what_they_refuse() -> None:
    assert [canonical(n) for n in ("1F1B", "ScheduleGPipe", "Interleaved1F1B", "ScheduleInterleavedZeroBubble",
                                   "interleaved-1f1b")] == ["1f1b", "gpipe", "interleaved1f1b", "interleavedzerobubble",
                                                            "interleaved1f1b"]
    with pytest.raises(ValueError, match="unknown pipeline schedule 'ZBVZeroBubble'"):
        canonical("ZBVZeroBubble")
    with pytest.raises(ValueError, match="gpipe runs one chunk of the model per stage, not 2"):
        schedule("gpipe", 2, 4, 2)
    with pytest.raises(ValueError, match="16 is not a multiple of 5"):
        schedule("interleaved1f1b", 3, 16, 2)
    with pytest.raises(ValueError, match="at least one stage, micro-batch and chunk"):
        schedule("interleavedzerobubble", 2, 4, 0)


def test_a_w_waits_for_its_i_and_a_split_backward_can_take_its_own_times() -> None:
    """A forward as long as a whole backward (F = 2, I = W = 1); stage 1 defers its W0 past I1."""
    table = clock_table(interleaved_zero_bubble(2, 2, 1), forward=2, input_grad=1, weight_grad=1)
    assert table == _rows("""
        F0 .
        F0 .
        F1 F0
        F1 F0
        .  I0
        I0 F1
        W0 F1
        .  I1
        I1 W0
        W1 W1
    """)
    with pytest.raises(ValueError, match="deadlock"):
        clock_table([[Action("W", 0), Action("F", 0), Action("I", 0)]])


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
