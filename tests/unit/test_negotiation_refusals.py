"""Refused calls and Horovod's scale factors in the coordinator tree (pure): how requests carrying them are
checked, described and compared, and how a refusal meets the others' requests of the same call."""

from __future__ import annotations

import pytest

from sluice.worker.collective.negotiation import Request
from sluice.worker.collective.negotiation_request import data_op, describe, problem, scaled_op
from tests.unit.negotiation_helpers import Net


def refused(name: str, reason: str = "InvalidCallError: bad splits") -> Request:
    return Request(name, "refused", op=reason)


@pytest.mark.parametrize(("request_", "found"), [
    (refused("x"), ""),
    (Request("x", "refused", op=""), "a refused call carries a reason of 1 to 400 characters"),
    (Request("x", "refused", op="r" * 401), "a refused call carries a reason of 1 to 400 characters"),
    (Request("x", "refused", "float32", ((4,),), op="why"), "dtype 'float32' does not fit a refused"),
    (Request("x", "allreduce", "float32", ((4,),), op="average@1.0,0.5"), ""),
    (Request("x", "allreduce", "float32", ((4,),), op="average@1.0"), "op 'average@1.0' is not one of"),
    (Request("x", "allreduce", "float32", ((4,),), op="average@1.0,nan"), "op 'average@1.0,nan' is not one of"),
    (Request("x", "allreduce", "float32", ((4,),), op="mean@1.0,1.0"), "op 'mean@1.0,1.0' is not one of"),
])
def test_refused_and_scaled_requests_are_checked(request_: Request, found: str) -> None:
    assert problem(request_, 4).startswith(found) and bool(problem(request_, 4)) == bool(found)


@pytest.mark.parametrize(("op", "pre", "post", "text", "data"), [
    ("average", 1.0, 1.0, "average@1.0,1.0", "sum"),  # the caller divides: the data plane sums
    ("sum", 2.0, 0.25, "sum@2.0,0.25", "sum"),
    ("min", 1, 3, "min@1.0,3.0", "min"),
])
def test_scaled_ops_name_the_factors_and_reduce_as_the_caller_scales(op: str, pre: float, post: float, text: str,
                                                                   data: str) -> None:
    assert scaled_op(op, pre, post) == text
    assert data_op(text) == data
    assert data_op(op) == op  # an unscaled average divides in the data plane


@pytest.mark.parametrize(("request_", "text"), [
    (refused("x", "InvalidCallError: bad root"), "nothing: it refused the call (InvalidCallError: bad root)"),
    (Request("x", "allreduce", "float32", ((4,),), op="average@1.0,1.0"), "allreduce float32 [[4]] average"),
    (Request("x", "allreduce", "int32", ((2,),), op="sum@2.0,0.5"),
     "allreduce int32 [[2]] sum prescale 2 postscale 0.5"),
])
def test_descriptions(request_: Request, text: str) -> None:
    assert describe(request_) == text


def test_a_refusal_fails_the_others_same_call_naming_the_rank_and_the_next_call_runs() -> None:
    net = Net(4, 2)
    good = Request("a2a", "alltoall", "float32", ((4,),))
    for rank in range(4):
        net.submit(rank, refused("a2a") if rank == 2 else good)
    net.settle()
    # the two descriptions meet at rank 1 (tree 0 -> 1, 3; 1 -> 2), whose own request the text names
    text = ("collective 'a2a' mismatch: rank 1 submitted alltoall float32 [[4]], rank 2 submitted nothing: it "
            "refused the call (InvalidCallError: bad splits)")
    assert net.errors() == {("a2a", text, 0)}
    assert all(len(decided) == 1 for decided in net.decided)  # every rank, the refusing one too
    for rank in range(4):
        net.submit(rank, good)
    net.settle()
    assert [net.names(r) for r in range(4)] == [["a2a", "a2a"]] * 4 and net.failures() == {None}
    assert all(d[1].error is None for d in net.decided)


def test_a_call_every_rank_refused_alike_is_decided_as_refused_everywhere() -> None:
    net = Net(3, 2)
    for rank in range(3):
        net.submit(rank, refused("x"))
    net.settle()
    assert [[(d.request.kind, d.request.op, d.error) for d in decided] for decided in net.decided] == [
        [("refused", "InvalidCallError: bad splits", None)]] * 3


def test_ranks_that_disagree_on_scale_factors_fail_the_call() -> None:
    net = Net(2, 2)
    net.submit(0, Request("w", "allreduce", "float32", ((4,),), op=scaled_op("average", 1.0, 1.0)))
    net.submit(1, Request("w", "allreduce", "float32", ((4,),), op=scaled_op("average", 2.0, 1.0)))
    net.settle()
    assert net.errors() == {("w", "collective 'w' mismatch: rank 0 submitted allreduce float32 [[4]] average, rank 1 "
                                  "submitted allreduce float32 [[4]] average prescale 2", 0)}
