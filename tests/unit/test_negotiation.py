"""The coordinator tree's protocol, driven in memory: Controllers of a tree exchanging messages by hand, fake time."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.transport.wire import DATA_HEADER_BYTES, Kind, Message, WireError, decode, encode
from sluice.worker.collective.negotiation import Controller, Down, Request, Up
from sluice.worker.collective.negotiation_census import Census
from sluice.worker.collective.negotiation_codec import (
    META_BUDGET,
    Answer,
    decode_down,
    decode_up,
    encode_up,
    hello,
    is_hello,
)
from sluice.worker.collective.negotiation_request import ranks_text
from sluice.worker.collective.tree import build_tree
from tests.unit.negotiation_helpers import Net, brief, grad, wire


def test_slow_path_then_fast_path_message_by_message() -> None:
    # 7 ranks, 3 levels: 0 -> 1, 4; 1 -> 2, 3; 4 -> 5, 6
    net = Net(7, 2)
    assert net.tree.children == ((1, 4), (2, 3), (), (), (5, 6), (), ())
    ops = [grad(i) for i in range(3)]
    for rank in range(7):
        for op in ops:
            net.submit(rank, op)
    # iteration 1: the ops' descriptions go up once every subtree has them; the root decides and numbers them
    assert brief(net.round()) == [(2, 1, "U", 1, 0, 3), (3, 1, "U", 1, 0, 3), (5, 4, "U", 1, 0, 3),
                                  (6, 4, "U", 1, 0, 3)]
    assert brief(net.round()) == [(1, 0, "U", 1, 0, 3), (1, 2, "D", 1, 0, 0), (1, 3, "D", 1, 0, 0),
                                  (4, 0, "U", 1, 0, 3), (4, 5, "D", 1, 0, 0), (4, 6, "D", 1, 0, 0)]
    assert brief(net.round()) == [(0, 1, "D", 1, 0b111, 3), (0, 4, "D", 1, 0b111, 3)]
    assert brief(net.round()) == [(1, 2, "D", 0, 0b111, 3), (1, 3, "D", 0, 0b111, 3), (4, 5, "D", 0, 0b111, 3),
                                  (4, 6, "D", 0, 0b111, 3)]
    assert net.round() == []
    slow = list(net.bytes)
    # iteration 2: only bit-vectors move, the same shape of exchange
    for rank in range(7):
        for op in reversed(ops):
            net.submit(rank, op)
    net.bytes.clear()
    assert brief(net.round()) == [(2, 1, "U", 2, 0b111, 0), (3, 1, "U", 2, 0b111, 0), (5, 4, "U", 2, 0b111, 0),
                                  (6, 4, "U", 2, 0b111, 0)]
    assert brief(net.round()) == [(1, 0, "U", 2, 0b111, 0), (1, 2, "D", 2, 0, 0), (1, 3, "D", 2, 0, 0),
                                  (4, 0, "U", 2, 0b111, 0), (4, 5, "D", 2, 0, 0), (4, 6, "D", 2, 0, 0)]
    assert brief(net.round()) == [(0, 1, "D", 2, 0b111, 0), (0, 4, "D", 2, 0b111, 0)]
    net.settle(3)
    assert max(net.bytes) <= 20 < min(size for size in slow if size > 13)  # acks are 13 bytes
    for rank in range(7):
        assert net.names(rank) == ["grad.0", "grad.1", "grad.2"] * 2
        assert [d.index for d in net.decided[rank]] == [0, 1, 2] * 2
        assert net.ctl[rank].table == ops


def test_every_rank_sees_the_same_order_whatever_order_ranks_submit_in() -> None:
    rng = random.Random(3)
    net = Net(13, 3)
    ops = [grad(i, priority=i % 4) for i in range(60)]
    for iteration in range(4):
        for rank in range(13):
            for op in rng.sample(ops, len(ops)):
                net.submit(rank, op)
                if rng.random() < 0.1:
                    net.round()
        net.settle()
        assert all(len(net.decided[r]) == 60 * (iteration + 1) for r in range(13))
    assert all(net.decided[r] == net.decided[0] for r in range(13))
    assert all(c.table == net.ctl[0].table for c in net.ctl) and len(net.ctl[0].table) == 60
    assert net.failures() == {None}


@pytest.mark.parametrize("arity", [0, 2, 4])
def test_root_takes_at_most_arity_messages_per_tick_even_when_slow(arity: int) -> None:
    n = 21
    net = Net(n, arity)
    rng = random.Random(arity)
    ops = [grad(i) for i in range(30)]
    orders = [rng.sample(ops, len(ops)) for _ in range(n)]
    for _ in range(3):
        for k in range(len(ops)):
            for rank in range(n):
                net.submit(rank, orders[rank][k])
            net.round(skip=frozenset({0}) if k % 4 else frozenset())  # the root ticks every fourth round only
        net.settle()
    assert all(len(d) == 90 for d in net.decided)
    fan_in = len(net.tree.children[0])
    assert fan_in == (n - 1 if arity == 0 else arity)
    assert max(net.taken_per_tick[0]) <= fan_in
    assert all(max(net.taken_per_tick[r]) <= max(1, len(net.tree.children[r])) + (r != 0) for r in range(n))


def test_a_new_op_in_a_later_iteration_extends_the_table() -> None:
    net = Net(6, 2)
    for rank in range(6):
        net.submit(rank, grad(0))
    net.settle()
    for rank in range(6):
        net.submit(rank, grad(0))
        net.submit(rank, grad(1))
    net.settle()
    assert [c.table for c in net.ctl] == [[grad(0), grad(1)]] * 6
    assert all([(d.index, d.request.name) for d in decided] == [(0, "grad.0"), (0, "grad.0"), (1, "grad.1")]
               for decided in net.decided)


def test_a_changed_op_takes_the_slow_path_and_keeps_its_entry() -> None:
    net = Net(6, 2)
    for columns in (3, 5, 5):
        for rank in range(6):
            net.submit(rank, grad(0, columns))
        net.settle()
    assert all(c.table == [grad(0, 5)] for c in net.ctl) and net.failures() == {None}
    assert all([d.request.shapes for d in decided] == [((4, 3),), ((4, 5),), ((4, 5),)] for decided in net.decided)


def test_priority_orders_what_is_decided_together() -> None:
    net = Net(5, 2)
    ops = [grad(0, priority=3), grad(1, priority=0), grad(2, priority=1)]
    for _ in range(2):
        for rank in range(5):
            for op in ops:
                net.submit(rank, op)
        net.settle()
    assert net.names(4) == ["grad.1", "grad.2", "grad.0"] * 2


def test_mismatch_fails_the_op_on_every_rank_naming_both_and_the_job_goes_on() -> None:
    net = Net(8, 2)
    for rank in range(8):
        net.submit(rank, grad(1, 2 if rank == 5 else 3))
    net.settle()
    text = ("collective 'grad.1' mismatch: rank 5 submitted allreduce float32 [[4, 2]] sum, "
            "rank 6 submitted allreduce float32 [[4, 3]] sum")
    assert net.failures() == {None}  # not the job: the op
    assert net.errors() == {("grad.1", text, 0)}  # every rank, in the same place of its decisions
    assert all(len(d) == 1 for d in net.decided)
    assert net.decided[5][0].request.shapes == ((4, 2),)  # each rank's own request fails
    for rank in range(8):  # the same name again, consistently, and another op: decided as usual
        net.submit(rank, grad(1))
        net.submit(rank, grad(2))
    net.settle()
    assert all(net.names(r) == ["grad.1", "grad.1", "grad.2"] for r in range(8))
    assert all(d.error is None for decided in net.decided for d in decided[1:])


@pytest.mark.parametrize(("arity", "odd"), [(2, 3), (2, 0), (3, 7), (7, 1)])
def test_a_mismatch_found_at_any_node_fails_once_every_rank_submitted(arity: int, odd: int) -> None:
    net = Net(8, arity)  # odd rank 0: the mismatch meets at the root; a leaf's: deeper down too
    for rank in range(8):
        if rank != 4:
            net.submit(rank, grad(0, 9 if rank == odd else 3))
    net.settle()
    assert net.errors() == set() and all(d == [] for d in net.decided)  # rank 4 has not submitted yet
    net.submit(4, grad(0))
    net.settle()
    (error,) = net.errors()
    assert error[0] == "grad.0" and f"rank {odd} submitted allreduce float32 [[4, 9]] sum" in str(error[1])
    assert all(len(d) == 1 for d in net.decided) and net.failures() == {None}


def test_a_changed_op_on_one_rank_is_a_mismatch_with_the_table() -> None:
    net = Net(8, 2)
    for columns in (3, 3):
        for rank in range(8):
            net.submit(rank, grad(1, 9 if rank == 2 and len(net.decided[0]) else columns))
        net.settle()
    assert net.failures() == {None}
    ((name, text, at),) = net.errors()
    assert name == "grad.1" and at == 1 and all(len(d) == 2 for d in net.decided)
    assert text is not None and "rank 2 submitted allreduce float32 [[4, 9]] sum" in text
    assert "submitted allreduce float32 [[4, 3]] sum" in text
    for rank in range(8):  # the table entry still serves the op, on the fast path
        net.submit(rank, grad(1))
    net.settle()
    assert all(net.names(r) == ["grad.1"] * 3 for r in range(8)) and net.errors() == {("grad.1", text, 1)}


def test_allgather_first_dimension_may_differ_but_not_the_rest() -> None:
    net = Net(4, 2)
    for rank in range(4):
        net.submit(rank, Request("rows", "allgather", "float32", ((rank + 1, 8),)))
    net.settle()
    assert net.failures() == {None} and all(len(d) == 1 for d in net.decided)
    for rank in range(4):  # and again, on the fast path
        net.submit(rank, Request("rows", "allgather", "float32", ((7 - rank, 8),)))
    net.settle()
    assert all(len(d) == 2 for d in net.decided)
    for rank in range(4):
        net.submit(rank, Request("rows", "allgather", "float32", ((2, 8 + (rank == 3)),)))
    net.settle()
    assert net.errors() == {("rows", "collective 'rows' mismatch: rank 0 submitted allgather float32 [[2, 8]], "
                                     "rank 3 submitted allgather float32 [[2, 9]]", 2)}


def test_broadcast_root_is_part_of_the_check() -> None:
    net = Net(3, 2)
    for rank in range(3):
        net.submit(rank, Request("w", "broadcast", "int64", ((10,),), root=2 if rank == 1 else 0))
    net.settle()
    assert net.errors() == {("w", "collective 'w' mismatch: rank 0 submitted broadcast int64 [[10]] root 0, "
                                  "rank 1 submitted broadcast int64 [[10]] root 2", 0)}


def test_a_joined_rank_takes_no_part_in_a_failed_op() -> None:
    net = Net(4, 2)
    net.submit(3, Request("join", "join"))
    for rank in range(3):
        net.submit(rank, Request("x", "allreduce", "float32", ((4,),), op="max" if rank == 1 else "sum"))
    net.settle()
    assert {name for name, _, _ in net.errors()} == {"x"}
    assert [len(d) for d in net.decided] == [1, 1, 1, 0]  # the joined rank gets nothing to run


W = Request("w", "allreduce", "float32", ((4,),))
ODD = {"shape": Request("w", "allreduce", "float32", ((5,),)), "dtype": Request("w", "allreduce", "float64", ((4,),)),
       "op": Request("w", "allreduce", "float32", ((4,),), op="average"),
       "kind": Request("w", "broadcast", "float32", ((4,),), root=0)}
ODD_TEXT = {"shape": "allreduce float32 [[5]] sum", "dtype": "allreduce float64 [[4]] sum",
            "op": "allreduce float32 [[4]] average", "kind": "broadcast float32 [[4]] root 0"}


@pytest.mark.parametrize("case", sorted(ODD))
@pytest.mark.parametrize(("odd", "text"), [
    (0, "rank 0 submitted {odd}, rank 1 submitted {w}"),  # own against a child's: met at the root
    (6, "rank 4 submitted {w}, rank 6 submitted {odd}"),  # met at rank 4 (a leaf's parent), slow vs slow
    (3, "rank 1 submitted {w}, rank 3 submitted {odd}"),  # met at rank 1, the root's other child
])
def test_each_kind_of_mismatch_fails_on_every_rank_wherever_it_is_met(case: str, odd: int, text: str) -> None:
    net = Net(7, 2)  # 0 -> 1, 4; 1 -> 2, 3; 4 -> 5, 6
    for rank in range(7):
        for request in ([grad(0), ODD[case] if rank == odd else W, grad(1)] if rank % 2 else
                        [ODD[case] if rank == odd else W, grad(1), grad(0)]):  # decided alongside, any order
            net.submit(rank, request)
    net.settle()
    error = "collective 'w' mismatch: " + text.format(odd=ODD_TEXT[case], w="allreduce float32 [[4]] sum")
    assert net.failures() == {None} and {(name, e) for name, e, _ in net.errors()} == {("w", error)}
    lists = {tuple((d.request.name, d.error) for d in decided) for decided in net.decided}
    assert len(lists) == 1  # every rank: the same decisions, the error in the same place
    assert [d.request for d in net.decided[odd] if d.error] == [ODD[case]]  # each rank's own request
    assert all(c.table == net.ctl[0].table and W.name not in c._index for c in net.ctl)  # nothing added
    for rank in range(7):  # the job goes on: the same name, agreed, and another op
        net.submit(rank, W)
        net.submit(rank, grad(2))
    net.settle()
    assert all(net.names(r)[-2:] == ["w", "grad.2"] or net.names(r)[-2:] == ["grad.2", "w"] for r in range(7))
    assert len({tuple((d.request.name, d.error) for d in decided) for decided in net.decided}) == 1
    assert net.errors() == {e for e in net.errors() if e[0] == "w"} and net.failures() == {None}


def test_a_mismatch_waits_for_a_joined_subtree_and_the_others_to_submit() -> None:
    net = Net(7, 2)  # 0 -> 1, 4; 1 -> 2, 3; 4 -> 5, 6
    for rank in (5, 6):
        net.submit(rank, Request("join", "join"))
    for rank in (0, 1, 3, 4):
        net.submit(rank, Request("x", "barrier") if rank == 3 else Request("x", "allreduce", "int32", ((2,),)))
    net.settle()
    assert all(d == [] for d in net.decided)  # rank 2 has not submitted: no one is left with a failure yet
    net.submit(2, Request("x", "allreduce", "int32", ((2,),)))
    net.settle()
    text = "collective 'x' mismatch: rank 1 submitted allreduce int32 [[2]] sum, rank 3 submitted barrier"
    assert net.errors() == {("x", text, 0)} and [len(d) for d in net.decided] == [1, 1, 1, 1, 1, 0, 0]


@pytest.mark.parametrize("in_table", [False, True])
@pytest.mark.parametrize("arity", [2, 3])
def test_an_op_submitted_before_joining_keeps_its_description(arity: int, in_table: bool) -> None:
    net = Net(4, arity)
    if in_table:  # then the others' grad.0 goes by the fast path, which a join alone would let through
        for rank in range(4):
            net.submit(rank, grad(0))
        net.settle()
    net.submit(3, grad(0, 9))
    net.submit(3, Request("join", "join"))
    for rank in range(3):
        net.submit(rank, grad(0))
    net.settle()
    text = ("collective 'grad.0' mismatch: rank 0 submitted allreduce float32 [[4, 3]] sum, rank 3 submitted "
            "allreduce float32 [[4, 9]] sum")
    assert net.failures() == {None} and net.errors() == {("grad.0", text, int(in_table))}
    assert all(len(d) == 1 + in_table for d in net.decided)  # rank 3 too: its own request failed
    for rank in range(3):  # the join still counts for rank 3
        net.submit(rank, grad(1))
    net.settle()
    assert all(net.names(r)[-1] == "grad.1" for r in range(4)) and net.failures() == {None}


def test_stall_names_the_ranks_that_did_not_submit_each_op_and_what_else_waits() -> None:
    net = Net(8, 2, stall=1.5)
    for rank in range(8):
        if rank not in (2, 3):
            net.submit(rank, grad(0))
        net.submit(rank, grad(1))
        if rank != 6:
            net.submit(rank, grad(2))
    net.settle()
    assert net.failures() == {None} and all(net.names(r) == ["grad.1"] for r in range(8))
    net.wait(1.0)
    assert net.failures() == {None}  # not yet
    net.submit(0, grad(4))  # waiting, but not for long: not stalled when the root looks
    net.wait(1.5)
    assert net.failures() == {"collective stalled for 1.5 s: ranks 2, 3 did not submit 'grad.0' "
                              "(ranks 0, 1, 4-7 did); rank 6 did not submit 'grad.2' (ranks 0-5, 7 did); "
                              "also waiting: 'grad.4'"}


def test_a_stalled_op_whose_ranks_disagree_names_the_missing_ranks_and_the_mismatch() -> None:
    net = Net(7, 2, stall=1.0)  # 0 -> 1, 4; 1 -> 2, 3; 4 -> 5, 6
    for rank in range(7):
        net.submit(rank, grad(0))
    net.settle()
    net.submit(2, grad(0, 9))  # slow path, held at rank 1 (rank 3 is missing)
    net.submit(5, grad(0))  # fast path, held at rank 4 (rank 6 is missing): no node sees both
    net.wait(3.0)
    assert net.failures() == {"collective stalled for 1 s: ranks 0, 1, 3, 4, 6 did not submit 'grad.0' (ranks 2, 5 "
                              "did); collective 'grad.0' mismatch: rank 2 submitted allreduce float32 [[4, 9]] sum, "
                              "rank 5 submitted allreduce float32 [[4, 3]] sum"}


@pytest.mark.parametrize(("found", "joined", "verdict"), [
    ({0b0011: grad(0), 0b1100: grad(0, 9)}, (), None),  # every rank submitted: its failure is on its way
    ({0b0011: grad(0), 0b0100: grad(0, 9)}, (3,), None),
    ({0b0001: grad(0), 0b0100: grad(0, 9)}, (3,), "collective stalled for 2 s: rank 1 did not submit 'grad.0' "
     "(ranks 0, 2 did); collective 'grad.0' mismatch: rank 0 submitted allreduce float32 [[4, 3]] sum, rank 2 "
     "submitted allreduce float32 [[4, 9]] sum; rank 3 joined"),
    ({0b0111: grad(0)}, (), "collective stalled for 2 s: rank 3 did not submit 'grad.0' (ranks 0-2 did)"),
])
def test_census_verdict_names_missing_ranks_not_a_mismatch_every_rank_submitted(
        found: dict[int, Request], joined: tuple[int, ...], verdict: str | None) -> None:
    census = Census.start((1, ("grad.0",)), 0, (), 0.0, ())
    census.take(0, Answer(1))  # no child: a no-op
    for bits, request in found.items():
        census._add(request, bits)
    assert census.done(0.0)
    assert census.verdict(4, joined, ["grad.0"], 2.0) == verdict


def test_barrier_waits_for_every_rank() -> None:
    net = Net(5, 2)
    for rank in range(4):
        net.submit(rank, Request("sync", "barrier"))
    net.settle()
    assert all(d == [] for d in net.decided)
    net.submit(4, Request("sync", "barrier"))
    net.settle()
    assert all(net.names(r) == ["sync"] and net.decided[r][0].request.kind == "barrier" for r in range(5))


def test_join_counts_as_ready_and_is_decided_with_the_last_rank() -> None:
    net = Net(8, 2)  # 0 -> 1, 5; 1 -> 2, 4; 2 -> 3; 5 -> 6, 7
    ops = [grad(i) for i in range(3)]
    for rank in range(8):
        for op in ops:
            net.submit(rank, op)
    net.settle()
    net.submit(3, Request("join", "join"))
    net.submit(6, Request("join", "join"))
    for _ in range(2):  # the others go on; ranks 3 and 6 take part with zeros
        for rank in (0, 1, 2, 4, 5, 7):
            for op in ops:
                net.submit(rank, op)
        net.settle()
    for rank in (0, 1, 2, 4, 5, 7):
        net.submit(rank, Request("join", "join"))
        net.settle(3)
    net.settle()
    expected = [(i, f"grad.{i}", ()) for i in range(3)] + [(i, f"grad.{i}", (3, 6)) for i in range(3)] * 2
    for rank in range(8):
        got = [(d.index, d.request.name, tuple(sorted(d.joined))) for d in net.decided[rank]]
        assert got[:-1] == expected
        assert got[-1] == (-1, "join", tuple(range(8))) and net.decided[rank][-1].request.root == 7
    for rank in range(8):  # a new epoch: nobody has joined any more
        for op in ops:
            net.submit(rank, op)
    net.settle()
    assert all([d.joined for d in net.decided[r][-3:]] == [frozenset()] * 3 for r in range(8))
    assert net.failures() == {None}


def test_joined_ranks_count_on_the_slow_path_and_a_joined_subtree_stops_reporting() -> None:
    net = Net(7, 2)  # 0 -> 1, 4; 1 -> 2, 3; 4 -> 5, 6
    for rank in (4, 5, 6):
        net.submit(rank, Request("join", "join"))
    net.settle()
    assert not any(net.ctl[0]._child_wild[c] for c in (1,)) and net.ctl[0]._child_wild[4]
    for rank in (0, 1, 2, 3):
        net.submit(rank, Request("x", "allreduce", "float16", ((2,),)))
    net.settle()
    assert all([(d.request.name, sorted(d.joined)) for d in decided] == [("x", [4, 5, 6])] for decided in net.decided)


def test_join_while_a_census_runs_and_join_twice() -> None:
    net = Net(3, 2)
    net.submit(1, Request("join", "join"))
    with pytest.raises(ValueError, match="already joined"):
        net.submit(1, Request("join", "join"))
    net.submit(0, grad(0))
    with pytest.raises(ValueError, match="already pending"):
        net.submit(0, grad(0))
    with pytest.raises(ValueError, match="kind 'reduce'"):
        net.submit(0, Request("y", "reduce", "float32", ((1,),)))
    with pytest.raises(ValueError, match="named 'join'"):
        net.submit(0, Request("leave", "join"))


def test_big_slow_batches_are_split_under_the_header_limit() -> None:
    net = Net(3, 2)
    ops = [Request(f"layer.{i:04d}." + "x" * 200, "allreduce", "bfloat16", ((64, 64, 3, 3),) * 4) for i in range(600)]
    for rank in range(3):
        for op in ops:
            net.submit(rank, op)
    ups = [m for _ in range(40) for _, _, m in net.round() if isinstance(m, Up) and m.new]
    assert len(ups) >= 8 and sum(len(m.new) for m in ups) == 1200  # two leaves, several messages each
    assert max(len(encode(encode_up(m))[0]) for m in ups) < META_BUDGET + 8192 < DATA_HEADER_BYTES
    net.settle()
    assert all(len(d) == 600 for d in net.decided) and net.decided[1] == net.decided[0]


def test_table_capacity() -> None:
    tree = build_tree(["h"], 2)
    ctl = Controller(0, tree, 60.0, capacity=2)
    for i in range(3):
        ctl.submit(grad(i), 0.0)
    ctl.tick(0.1)
    assert ctl.failure is not None and "operation table is full (2 names)" in ctl.failure


def test_ranks_text() -> None:
    assert ranks_text([3]) == "rank 3"
    assert ranks_text([3, 2]) == "ranks 2, 3"
    assert ranks_text([0, 1, 2, 3, 7, 9, 10, 11]) == "ranks 0-3, 7, 9-11"


# ---------------------------------------------------------------------------- hostile and malformed input
def state(ctl: Controller) -> dict[str, Any]:
    return copy.deepcopy(vars(ctl))


@pytest.fixture
def trained() -> Net:
    """A 7-rank tree whose table holds grad.0 and grad.1, rank 5 already reported ready for grad.1."""
    net = Net(7, 2)
    for rank in range(7):
        net.submit(rank, grad(0))
        net.submit(rank, grad(1))
    net.settle()
    net.submit(5, grad(1))
    net.settle()
    return net


@pytest.mark.parametrize(("sender", "message", "error"), [
    (6, Up(1), "not its child"),  # 6 is a child of 4, not of 1
    (0, Up(1), "not its child"),
    (3, Up(3), "follows 1"),
    (3, Up(2, epoch=1), "join epoch 1"),
    (3, Up(2, ready=1 << 2), "marks entry 2 of a table of 2"),
    (3, Up(2, new=((grad(7), 5),)), "outside its subtree"),
    (3, Up(2, joined=(2,)), "outside its subtree"),
    (3, Up(2, joined=(3, 3)), "joined twice"),
    (3, Up(2, wild=True), "not all of it has"),
    (3, Up(2, answer=Answer(1, ((grad(0), 1 << 2),))), "census for ranks outside"),
    (3, Up(2, new=((grad(7), 3),), conflicts=(("grad.7", "t"),)), "reported already"),
    (3, Down(), "not its parent"),  # a child
    (4, Down(), "not its parent"),
])
def test_a_message_that_does_not_fit_changes_nothing(trained: Net, sender: int, message: Up | Down,
                                                      error: str) -> None:
    before = state(trained.ctl[1])  # 1 -> 2, 3
    with pytest.raises(WireError, match=error):
        trained.ctl[1].receive(sender, message, trained.now)
    assert state(trained.ctl[1]) == before


@pytest.mark.parametrize(("message", "error"), [
    (Down(ack=9), "acknowledges message 9"),
    (Down(entries=((3, grad(3)),)), "sets table entry 3 of 2"),
    (Down(entries=((0, grad(5)),)), "sets table entry 0"),
    (Down(entries=((2, grad(0)),)), "second index"),
    (Down(decided=1 << 2), "beyond the table"),
    (Down(joined=(9,)), "unknown"),
    (Down(joined=(2, 2)), "unknown or joined already"),
    (Down(join_last=7), "last to join"),
    (Down(failed=(("grad.1", "t"),)), "not submitted"),  # rank 4 has no grad.1 pending (rank 5 has)
])
def test_a_down_that_does_not_fit_changes_nothing(trained: Net, message: Down, error: str) -> None:
    before = state(trained.ctl[4])
    with pytest.raises(WireError, match=error):
        trained.ctl[4].receive(0, message, trained.now)
    assert state(trained.ctl[4]) == before


def test_a_failed_op_must_be_pending_not_decided_and_reported_once(trained: Net) -> None:
    rank5 = trained.ctl[5]  # grad.1 pending, reported up to rank 4
    before = state(rank5)
    with pytest.raises(WireError, match="decides it too"):
        rank5.receive(4, Down(decided=1 << 1, failed=(("grad.1", "t"),)), trained.now)
    assert state(rank5) == before
    rank5.receive(4, Down(failed=(("grad.1", "t"),)), trained.now)
    assert [(d.request, d.error) for d in rank5.take_decisions()] == [(grad(1), "t")] and not rank5._own
    trained.submit(3, grad(7))  # reported up to rank 1 as new: it may not come again, as new or conflicted
    trained.round()
    trained.round()
    rank1 = trained.ctl[1]
    assert rank1._seq_in[3] == 2 and "grad.7" in rank1._child_new[3]
    before = state(rank1)
    for again in (Up(3, new=((grad(7), 3),)), Up(3, conflicts=(("grad.7", "t"),))):
        with pytest.raises(WireError, match="reported already"):
            rank1.receive(3, again, trained.now)
        assert state(rank1) == before


def malformed(kind: Kind, meta: dict[str, Any] | None, round_: int = 1, **fields: Any) -> Message:
    return Message(kind, round=round_, meta=meta, **fields)


@pytest.mark.parametrize(("msg", "error"), [
    (malformed(Kind.COORD_UP, None, round_=0), "sequence number"),
    (malformed(Kind.COORD_UP, {"zz": 1}), "unknown fields"),
    (malformed(Kind.COORD_UP, {"x": [["a"]]}), "2 fields"),
    (malformed(Kind.COORD_UP, {"x": [["a", ""]]}), "a mismatch"),
    (malformed(Kind.COORD_UP, {"x": [["a", "t"], ["a", "u"]]}), "twice"),
    (malformed(Kind.COORD_DOWN, {"f": [[1, "t"]]}), "a name"),
    (malformed(Kind.COORD_DOWN, {"f": [["a", "t" * 3000]]}), "a mismatch"),
    (malformed(Kind.COORD_DOWN, {"f": [["a", "t"], ["a", "t"]]}), "twice"),
    (malformed(Kind.COORD_DOWN, {"f": [["a", "t", 1]]}), "at most 2 items"),
    (malformed(Kind.COORD_DOWN, {"f": {"a": "t"}}), "a list"),
    (malformed(Kind.COORD_UP, {"x": [["a", 7]]}), "a mismatch"),
    (malformed(Kind.COORD_UP, {"x": "a"}), "a list"),
    (malformed(Kind.COORD_UP, {"n": [["a", "allreduce", "float32", [[4]], "sum", -1, 0]]}), "8 fields"),
    (malformed(Kind.COORD_UP, {"n": [["a", "allreduce", "float33", [[4]], "sum", -1, 0, 0]]}), "dtype"),
    (malformed(Kind.COORD_UP, {"n": [["a", "allreduce", "float32", [[-4]], "sum", -1, 0, 0]]}), "shape"),
    (malformed(Kind.COORD_UP, {"n": [["a", "allreduce", ["float32"], [[4]], "sum", -1, 0, 0]]}), "strings"),
    (malformed(Kind.COORD_UP, {"n": [["a", "allreduce", "float32", [[4]], {"x": 1}, -1, 0, 0]]}), "strings"),
    (malformed(Kind.COORD_UP, {"n": [["a", "allreduce", "float32", [[1] * 9], "sum", -1, 0, 0]]}), "at most 8"),
    (malformed(Kind.COORD_UP, {"n": [["a", "allreduce", "float32", [[4]], "median", -1, 0, 0]]}), "op 'median'"),
    (malformed(Kind.COORD_UP, {"n": [["a", "broadcast", "float32", [[4]], "sum", -1, 0, 0]]}), "root -1"),
    (malformed(Kind.COORD_UP, {"n": [["a", "allreduce", "float32", [[4]], "sum", -1, -2, 0]]}), "priority"),
    (malformed(Kind.COORD_UP, {"n": [["", "allreduce", "float32", [[4]], "sum", -1, 0, 0]]}), "a name"),
    (malformed(Kind.COORD_UP, {"n": [[1, "allreduce", "float32", [[4]], "sum", -1, 0, 0]]}), "a name"),
    (malformed(Kind.COORD_UP, {"w": 1}), "'w' must be true"),
    (malformed(Kind.COORD_UP, {"j": [-1]}), "joined rank"),
    (malformed(Kind.COORD_UP, {"e": "x" * 9000}), "an error"),
    (malformed(Kind.COORD_UP, {"c": [1, [], [], 0]}), "5 fields"),
    (malformed(Kind.COORD_UP, {"c": [1, [["a", "barrier", "", [], "sum", -1, 5]], [], 0, []]}), "bitmap"),
    (malformed(Kind.COORD_UP, None, dtype="float32", shape=(1,), payload=b"\0\0\0\0"), "uint8"),
    (malformed(Kind.COORD_UP, None, chunk=1 << 30, dtype="uint8", shape=(1,), payload=b"\1"), "beyond"),
    (malformed(Kind.COORD_DOWN, {"t": [[0, "a", "allreduce", "float32", [[4]], "sum", -1]]}), "8 fields"),
    (malformed(Kind.COORD_DOWN, {"q": [0, []]}), "census query"),
    (malformed(Kind.COORD_DOWN, {"jl": "x"}), "last rank to join"),
    (malformed(Kind.COORD_DOWN, {"hello": True, "e": "x"}), "unknown fields"),
])
def test_malformed_messages_raise_wire_errors(msg: Message, error: str) -> None:
    frames = [bytes(f) for f in encode(msg)]
    back = decode(frames)
    with pytest.raises(WireError, match=error):
        decode_up(back) if msg.kind == Kind.COORD_UP else decode_down(back)


def test_every_field_survives_the_wire() -> None:
    up = Up(7, 2, (1 << 40) | (1 << 43), ((grad(1, priority=4), 3),), True, (3, 4), ("grad.9",),
            Answer(5, ((grad(2), 0b1010),), ("grad.3",), 2, (6,)), "boom", (("grad.4", "they disagree"),))
    down = Down(3, ((0, grad(0)), (1, Request("b", "barrier"))), 0b11, (1, 2), 2, (4, ("grad.1",)), "bang",
                (("grad.4", "they disagree"),))
    assert wire(up)[0] == up and wire(down)[0] == down
    assert wire(Up(1, ready=1 << 199))[1] <= 20  # a vector of 200 bits with one set: the zero bytes are skipped
    assert is_hello(decode([bytes(f) for f in encode(hello(Kind.COORD_UP))]))


# ---------------------------------------------------------------------------- anything at all
junk: st.SearchStrategy[Any] = (
    st.sampled_from([None, True, -1, 0, 1, 2, 7, 1 << 31, 1 << 63, 1.5, "", "x", b"", b"\xff", [], {}])
    | st.recursive(st.integers(-2, 9) | st.text(max_size=4) | st.binary(max_size=4),
                   lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=2), inner, max_size=2),
                   max_leaves=12))
REQUEST = ["grad.0", "allreduce", "float32", [[4, 3]], "sum", -1]
UP_META = {"n": [[*REQUEST, 0, 3]], "w": True, "j": [3], "st": ["grad.0"], "e": "x",
           "c": [1, [[*REQUEST, b"\x08"]], ["grad.1"], 0, [3]], "x": [["grad.2", "mismatch"]]}
DOWN_META = {"t": [[2, "grad.2", "barrier", "", [], "sum", -1, 0]], "j": [2], "jl": 1, "q": [1, ["grad.0"]], "e": "x",
             "f": [["grad.3", "mismatch"]]}


@st.composite
def mutated(draw: st.DrawFn, template: Any) -> Any:
    """`template` with one or two parts (itself included) replaced by junk."""
    value = copy.deepcopy(template)
    for _ in range(draw(st.integers(1, 2))):
        parent, key = None, None
        node = value
        while isinstance(node, dict | list) and node and draw(st.booleans()):
            parent, key = node, draw(st.sampled_from(list(node) if isinstance(node, dict) else range(len(node))))
            node = node[key]
        if parent is None:
            value = draw(junk)
        else:
            parent[key] = draw(junk)  # type: ignore[index]
    return value


coordinator_messages = st.builds(
    lambda kind, meta, round_, key, chunk, bits: Message(
        kind, round=round_, key=key, chunk=chunk, meta=meta if isinstance(meta, dict) else None,
        **({"dtype": "uint8", "shape": (len(bits),), "payload": bits} if bits else {})),
    st.sampled_from([Kind.COORD_UP, Kind.COORD_DOWN]),
    st.sampled_from([UP_META, DOWN_META]).flatmap(mutated) | st.sampled_from([None, UP_META, DOWN_META]),
    st.integers(0, 4), st.integers(0, 2), st.integers(0, 3) | st.just(1 << 30), st.binary(max_size=3))


@settings(max_examples=300, derandomize=True, database=None, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0, 2, 3, 6]), coordinator_messages), max_size=6))
def test_any_message_is_taken_or_refused_with_a_wire_error(attack: list[tuple[int, Message]]) -> None:
    net = Net(7, 2)  # rank 1: parent 0, children 2 and 3
    for rank in range(7):
        net.submit(rank, grad(0))
    net.settle()
    target = net.ctl[1]
    for sender, msg in attack:
        try:
            back = decode([bytes(f) for f in encode(msg)])
            parsed = decode_up(back) if back.kind == Kind.COORD_UP else decode_down(back)
        except WireError:
            continue
        before = state(target)
        try:
            target.receive(sender, parsed, net.now)
        except WireError:
            assert state(target) == before
        target.tick(net.now)
