"""An aggregator's relay: children's pushes summed in rank order and forwarded once, replies fanned down, refusals
that change nothing, routing epochs; no sockets."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluice.ps.ranked_sum import bf16_to_f32, f32_to_bf16
from sluice.ps.relay import Relay
from sluice.ps.relay_tables import TreeView
from sluice.scheduler.hierarchy.routes import MAX_EPOCHS, SERVERS, Route, Routing
from sluice.transport.wire import DTYPES, Flag, Kind, Message, WireError
from tests.unit.relay_helpers import (
    DTYPE,
    FLAT_TREE,
    IDS,
    LENGTH,
    TWO_LEVEL,
    VISIBLE,
    WORKERS,
    bits_of,
    f32,
    new_relay,
    push,
    received,
    reply,
    state,
    summary,
    values_of,
)

pytestmark = pytest.mark.timeout(60)

# ------------------------------------------------------------------------------------------ one level
def test_two_children_make_one_push_up_and_the_reply_fans_down() -> None:
    relay = new_relay()
    a, b = f32([1.0, 2.0, 3.0, 4.0]), f32([10.0, 20.0, 30.0, 40.0])
    assert relay.handle("worker-0", 2, push("worker-0", a, priority=5)) == []
    out = relay.handle("worker-1", 4, push("worker-1", b, priority=3))
    assert summary(out) == [("server-0", 2, Kind.PUSH, 3, 7, 0, 1, 3, Flag.WANT_REPLY, "float32", (4,),
                             {"ranks": [0, 1]})]
    assert values_of(out[0][2]) == [11.0, 22.0, 33.0, 44.0]
    assert received(out[0][2]) is not None  # a message the wire takes
    back = relay.handle("server-0", 2, reply(values=[5.0, 6.0, 7.0, 8.0]))
    assert summary(back) == [
        ("worker-0", 2, Kind.REPLY, 3, 7, 0, 1, 5, 0, "float32", (4,), None),
        ("worker-1", 4, Kind.REPLY, 3, 7, 0, 1, 3, 0, "float32", (4,), None),
    ]
    assert [values_of(m) for _, _, m in back] == [[5.0, 6.0, 7.0, 8.0]] * 2
    assert relay._rounds == {} and relay._buffers[(7, 0)].last_round == 1


def test_each_chunk_goes_to_the_server_that_owns_it_and_rounds_follow_each_other() -> None:
    relay = new_relay()
    for round_ in (1, 2, 3):
        relay.handle("worker-1", 0, push("worker-1", [round_] * 4, chunk=1, round_=round_, flags=Flag.NONE))
        out = relay.handle("worker-0", 1, push("worker-0", [1.0] * 4, chunk=1, round_=round_, flags=Flag.NONE))
        assert [(peer, channel, m.kind, m.round, m.flags, m.meta) for peer, channel, m in out] == [
            ("server-1", 0, Kind.PUSH, round_, Flag.NONE, {"ranks": [0, 1]})]
        assert values_of(out[0][2]) == [round_ + 1.0] * 4
        acks = relay.handle("server-1", 0, reply(chunk=1, round_=round_, sender=2))
        assert summary(acks) == [
            ("worker-1", 0, Kind.REPLY, 3, 7, 1, round_, 0, 0, "", (), None),
            ("worker-0", 1, Kind.REPLY, 3, 7, 1, round_, 0, 0, "", (), None),
        ]
        assert all(m.payload is None for _, _, m in acks)


def test_only_children_that_asked_get_the_value() -> None:
    relay = new_relay()
    relay.handle("worker-0", 0, push("worker-0", [1.0] * 4, flags=Flag.NONE))
    out = relay.handle("worker-1", 0, push("worker-1", [1.0] * 4, flags=Flag.WANT_REPLY))
    assert out[0][2].flags == Flag.WANT_REPLY  # one child wants the value: the push up asks for it
    back = relay.handle("server-0", 0, reply(values=[9.0] * 4))
    assert [(peer, m.payload is None, m.dtype) for peer, _, m in back] == [("worker-0", True, ""),
                                                                          ("worker-1", False, "float32")]


@pytest.mark.parametrize("order", list(itertools.permutations(["worker-0", "worker-1", "aggregator-1"])), ids=str)
def test_the_sum_is_in_rank_order_whatever_the_arrival_order(order: tuple[str, ...]) -> None:
    """Pieces of ranks (0,), (1,) and (2, 3) (a child aggregator): ((p0 + p1) + p23) bit for bit."""
    tree = Route(1.0, {"worker-0": "aggregator-0", "worker-1": "aggregator-0", "worker-2": "aggregator-1",
                       "worker-3": "aggregator-1", "aggregator-1": "aggregator-0"})
    relay = new_relay("aggregator-0", Routing(1, (tree,)))
    pieces = {"worker-0": f32(VISIBLE[0]), "worker-1": f32(VISIBLE[1]), "aggregator-1": f32(VISIBLE[2])}
    out: list[Any] = []
    for child in order:
        out += relay.handle(child, 0, push(child, pieces[child], ranks=[2, 3] if child == "aggregator-1" else None))
    expected = (pieces["worker-0"] + pieces["worker-1"]) + pieces["aggregator-1"]
    assert [(peer, m.meta) for peer, _, m in out] == [("server-0", {"ranks": [0, 1, 2, 3]})]
    assert bits_of(out[0][2]) == expected.tobytes()


def test_bfloat16_and_int32_chunks() -> None:
    relay = new_relay()
    a, b = f32([1.5, -2.0, 1e8, 0.1]), f32([0.25, 2.0, 1.0, 0.2])
    a16, b16 = np.zeros(4, np.uint16), np.zeros(4, np.uint16)
    f32_to_bf16(a.copy(), a16)
    f32_to_bf16(b.copy(), b16)
    relay.handle("worker-1", 0, push("worker-1", b16, key=8))
    out = relay.handle("worker-0", 0, push("worker-0", a16, key=8))
    expected = np.zeros(4, np.uint16)
    f32_to_bf16(bf16_to_f32(a16) + bf16_to_f32(b16), expected)
    assert [(peer, m.dtype, m.shape) for peer, _, m in out] == [("server-1", "bfloat16", (4,))]
    assert bits_of(out[0][2]) == expected.tobytes()
    back = relay.handle("server-1", 0, reply(key=8, values=expected, sender=2))
    assert [bits_of(m) for _, _, m in back] == [expected.tobytes()] * 2
    relay.handle("worker-0", 0, push("worker-0", [7, -(1 << 30)], key=9))
    out = relay.handle("worker-1", 0, push("worker-1", [5, -(1 << 30)], key=9))
    assert values_of(out[0][2]) == [12, -(1 << 31)] and out[0][0] == "server-0"


def test_the_optimizer_settings_of_the_children_travel_up() -> None:
    relay = new_relay()
    opt = {"name": "sgd", "lr": 0.1}
    relay.handle("worker-0", 0, push("worker-0", [1.0] * 4, meta={"route": [1, 0], "opt": opt}))
    out = relay.handle("worker-1", 0, push("worker-1", [1.0] * 4, meta={"route": [1, 0], "opt": opt}))
    assert out[0][2].meta == {"ranks": [0, 1], "opt": opt}


# ------------------------------------------------------------------------------------------ two levels
def test_a_child_aggregator_sums_its_subtree_and_the_parent_sums_every_rank() -> None:
    top = new_relay("aggregator-0", Routing(1, (TWO_LEVEL,)))
    middle = new_relay("aggregator-1", Routing(1, (TWO_LEVEL,)))
    assert top.tables.epochs[1] == [TreeView(SERVERS, frozenset({"worker-0", "aggregator-1"}), (0, 1, 2),
                                             {"aggregator-1": (1, 2)})]
    assert middle.tables.epochs[1] == [TreeView("aggregator-0", frozenset({"worker-1", "worker-2"}), (1, 2))]
    w0, w1, w2 = f32(VISIBLE[0]), f32(VISIBLE[1]), f32(VISIBLE[2])
    # worker 2 first, then worker 1: aggregator-1 still sums p1 + p2
    assert middle.handle("worker-2", 3, push("worker-2", w2, priority=4)) == []
    up = middle.handle("worker-1", 5, push("worker-1", w1, priority=6))
    assert summary(up) == [("aggregator-0", 3, Kind.PUSH, 4, 7, 0, 1, 4, Flag.WANT_REPLY, "float32", (4,),
                            {"ranks": [1, 2], "route": [1, 0]})]
    assert bits_of(up[0][2]) == (w1 + w2).tobytes()
    # aggregator-1's piece arrives before worker 0's
    assert top.handle("aggregator-1", 3, received(up[0][2])) == []  # type: ignore[arg-type]
    out = top.handle("worker-0", 1, push("worker-0", w0, priority=2))
    assert summary(out) == [("server-0", 3, Kind.PUSH, 3, 7, 0, 1, 2, Flag.WANT_REPLY, "float32", (4,),
                             {"ranks": [0, 1, 2]})]
    assert bits_of(out[0][2]) == (w0 + (w1 + w2)).tobytes()  # p0 + p12: the pieces' lowest-rank order
    down = top.handle("server-0", 0, reply(values=[1.0, 2.0, 3.0, 4.0]))
    assert [(peer, channel, m.round, m.priority) for peer, channel, m in down] == [("aggregator-1", 3, 1, 4),
                                                                                   ("worker-0", 1, 1, 2)]
    leaves = middle.handle("aggregator-0", 3, received(down[0][2]))  # type: ignore[arg-type]
    assert [(peer, channel, m.kind, m.priority, values_of(m)) for peer, channel, m in leaves] == [
        ("worker-2", 3, Kind.REPLY, 4, [1.0, 2.0, 3.0, 4.0]), ("worker-1", 5, Kind.REPLY, 6, [1.0, 2.0, 3.0, 4.0])]


def test_a_reply_from_the_servers_to_a_middle_aggregator_is_refused() -> None:
    middle = new_relay("aggregator-1", Routing(1, (TWO_LEVEL,)))
    middle.handle("worker-1", 0, push("worker-1", [1.0] * 4))
    middle.handle("worker-2", 0, push("worker-2", [1.0] * 4))
    before = state(middle)
    with pytest.raises(WireError, match="not its parent"):
        middle.handle("server-0", 0, reply(values=[1.0] * 4))
    assert state(middle) == before


# ------------------------------------------------------------------------------------------ failures
def test_an_error_from_the_parent_reaches_every_child() -> None:
    relay = new_relay()
    relay.handle("worker-0", 2, push("worker-0", [1.0] * 4, priority=5))
    relay.handle("worker-1", 3, push("worker-1", [1.0] * 4, priority=1))
    down = relay.handle("server-0", 0, reply(kind=Kind.ERROR, meta={"error": "the server refused round 1"}))
    assert summary(down) == [
        ("worker-0", 2, Kind.ERROR, 3, 7, 0, 1, 5, 0, "", (), {"error": "the server refused round 1"}),
        ("worker-1", 3, Kind.ERROR, 3, 7, 0, 1, 1, 0, "", (), {"error": "the server refused round 1"}),
    ]
    with pytest.raises(WireError, match="finished up to round 1"):  # the round is over
        relay.handle("worker-0", 2, push("worker-0", [1.0] * 4))
    relay.handle("worker-0", 0, push("worker-0", [1.0] * 4, round_=2))  # the next round goes on
    out = relay.handle("worker-1", 0, push("worker-1", [2.0] * 4, round_=2))
    assert values_of(out[0][2]) == [3.0] * 4
    down = relay.handle("server-0", 0, reply(round_=2, kind=Kind.ERROR, meta={"error": 5}))
    assert [m.meta for _, _, m in down] == [{"error": "the parent refused the round"}] * 2


def test_a_worker_that_leaves_fails_the_rounds_that_wait_for_it() -> None:
    relay = new_relay()
    relay.handle("worker-0", 2, push("worker-0", [1.0] * 4, priority=5))  # key 7 chunk 0 waits for worker 1
    relay.handle("worker-1", 0, push("worker-1", [1.0] * 4, chunk=1))  # chunk 1 waits for worker 0
    assert relay.worker_left(3) == []  # not below aggregator-0
    failed = relay.worker_left(1)
    assert [(peer, channel, m.kind, m.key, m.chunk, m.round, m.priority) for peer, channel, m in failed] == [
        ("worker-0", 2, Kind.ERROR, 7, 0, 1, 5)]
    assert "worker 1 has left the job" in failed[0][2].meta["error"]
    assert relay.worker_left(1) == [] and relay.departed == [3, 1]
    # a new round that needs worker 1 fails at once
    now = relay.handle("worker-0", 1, push("worker-0", [1.0] * 4, round_=2))
    assert [(peer, m.kind, m.round) for peer, _, m in now] == [("worker-0", Kind.ERROR, 2)]
    assert "worker 1 has left the job" in now[0][2].meta["error"]
    # chunk 1 already has worker 1's push: worker 0 completes it
    out = relay.handle("worker-0", 0, push("worker-0", [1.0] * 4, chunk=1))
    assert [(peer, m.kind) for peer, _, m in out] == [("server-1", Kind.PUSH)]


@pytest.mark.parametrize("rank", [-1, WORKERS, 1 << 40, True, "1"])
def test_leaving_needs_a_rank_of_the_job(rank: Any) -> None:
    relay = new_relay()
    before = state(relay)
    with pytest.raises(WireError, match="cannot leave"):
        relay.worker_left(rank)
    assert state(relay) == before


def test_stalled_rounds_name_what_they_wait_for() -> None:
    relay = new_relay()
    relay.handle("worker-0", 0, push("worker-0", [1.0] * 4))
    relay.handle("worker-0", 0, push("worker-0", [1.0] * 4, chunk=1))
    relay.handle("worker-1", 0, push("worker-1", [1.0] * 4, chunk=1))
    started = relay._rounds[(7, 0)].started
    assert relay.stalled(started + 1.0, 5.0) == []
    lines = relay.stalled(started + 100.0, 5.0)
    assert len(lines) == 2 and "workers [1]" in lines[0] and "its parent's reply" in lines[1]


# ------------------------------------------------------------------------------------------ refusals
def mid_relay() -> Relay:
    """aggregator-0 with epochs 1 (FLAT_TREE) and 2 (TWO_LEVEL, and a tree of worker 3 alone) and rounds in every
    state: key 7 chunk 0 at round 2 with worker 0's push in; chunk 1 round 1 forwarded to server-1; key 9 finished
    round 3, nothing in progress."""
    relay = new_relay("aggregator-0", Routing(1, (FLAT_TREE,)),
                      Routing(2, (Route(0.5, TWO_LEVEL.parents), Route(0.5, {"worker-3": "aggregator-0"}))))
    for round_ in (1, 2):
        relay.handle("worker-0", 0, push("worker-0", [1.0] * 4, round_=round_))
        if round_ == 1:
            relay.handle("worker-1", 0, push("worker-1", [1.0] * 4))
            relay.handle("server-0", 0, reply(values=[2.0] * 4))
    relay.handle("worker-0", 0, push("worker-0", [1.0] * 4, chunk=1))
    relay.handle("worker-1", 0, push("worker-1", [1.0] * 4, chunk=1))
    relay.handle("worker-1", 0, push("worker-1", [1, 1], key=9, round_=3))
    relay.handle("worker-0", 0, push("worker-0", [1, 1], key=9, round_=3))
    relay.handle("server-0", 0, reply(key=9, round_=3))
    assert sorted(relay._rounds) == [(7, 0), (7, 1)] and relay._rounds[(7, 1)].forwarded
    return relay


F4 = [1.0] * 4
REFUSED: list[tuple[str, str, Message, str]] = [
    # who is sending
    ("unknown sender", "worker-9", push("worker-9", F4), "not a worker or aggregator"),
    ("server as a child", "server-0", push("server-0", F4), "not a worker or aggregator"),
    ("sender id of another peer", "worker-1", push("worker-0", F4, round_=2), "not a worker or aggregator"),
    # the route
    ("no meta", "worker-1", push("worker-1", F4, round_=2, meta={}), r"must name its \[epoch, tree\]"),
    ("meta without route", "worker-1", push("worker-1", F4, round_=2, meta={"ranks": [1]}), "must name"),
    ("route too short", "worker-1", push("worker-1", F4, round_=2, route=[1]), "must name"),
    ("route of strings", "worker-1", push("worker-1", F4, round_=2, route=["1", "0"]), "must name"),
    ("route of bools", "worker-1", push("worker-1", F4, round_=2, route=[True, False]), "must name"),
    ("route of three", "worker-1", push("worker-1", F4, round_=2, route=[1, 0, 0]), "must name"),
    ("unknown epoch", "worker-1", push("worker-1", F4, round_=2, route=[3, 0]), "unknown tree 0 of routing epoch 3"),
    ("epoch 0", "worker-1", push("worker-1", F4, round_=2, route=[0, 0]), "unknown tree"),
    ("unknown tree", "worker-1", push("worker-1", F4, round_=2, route=[1, 1]), "unknown tree 1"),
    ("negative tree", "worker-1", push("worker-1", F4, round_=2, route=[2, -1]), "unknown tree -1"),
    # not a child in that tree
    ("worker of another tree", "worker-2", push("worker-2", F4, round_=2), "not a child of aggregator-0"),
    ("worker below a child", "worker-1", push("worker-1", F4, key=9, round_=4, route=[2, 0]), "not a child"),
    ("aggregator not a child", "aggregator-1", push("aggregator-1", F4, round_=2, ranks=[1]), "not a child"),
    ("worker 3 in tree 0", "worker-3", push("worker-3", F4, key=9, round_=4, route=[2, 0]), "not a child"),
    # ranks of a child aggregator
    ("no ranks", "aggregator-1", push("aggregator-1", [1, 1], key=9, round_=4, route=[2, 0]), "sorted, distinct"),
    ("unsorted ranks", "aggregator-1", push("aggregator-1", [1, 1], key=9, round_=4, route=[2, 0], ranks=[2, 1]),
     "sorted, distinct"),
    ("repeated ranks", "aggregator-1", push("aggregator-1", [1, 1], key=9, round_=4, route=[2, 0], ranks=[1, 1]),
     "sorted, distinct"),
    ("rank out of the job", "aggregator-1", push("aggregator-1", [1, 1], key=9, round_=4, route=[2, 0],
                                                 ranks=[1, WORKERS]), "sorted, distinct"),
    ("rank not below", "aggregator-1", push("aggregator-1", [1, 1], key=9, round_=4, route=[2, 0], ranks=[1, 3]),
     "not below aggregator-0"),
    # the chunk
    ("unknown key", "worker-1", push("worker-1", F4, key=5, round_=2, dtype="float32"), "unknown key 5 chunk 0"),
    ("unknown chunk", "worker-1", push("worker-1", F4, chunk=2, round_=2, dtype="float32"), "unknown key 7 chunk 2"),
    ("wrong dtype", "worker-1", push("worker-1", F4, round_=2, dtype="float64"), r"holds float32\[4\]"),
    ("int32 for float32", "worker-1", push("worker-1", [1, 1, 1, 1], round_=2, dtype="int32"), "holds float32"),
    ("wrong length", "worker-1", push("worker-1", [1.0] * 5, round_=2), r"float32\[5\]"),
    ("empty", "worker-1", push("worker-1", np.zeros(0), round_=2), r"float32\[0\]"),
    ("no payload", "worker-1", Message(Kind.PUSH, sender=11, key=7, round=2, dtype="float32", shape=(4,),
                                       meta={"route": [1, 0]}, shm=("sluice-1-0-0", 0, 16)), r"holds float32\[4\]"),
    ("no dtype", "worker-1", Message(Kind.PUSH, sender=11, key=7, round=2, meta={"route": [1, 0]}), "carries nothing"),
    # rounds
    ("duplicate rank", "worker-0", push("worker-0", F4, round_=2), "duplicated"),
    ("round already finished", "worker-0", push("worker-0", [1, 1], key=9, round_=3), "finished up to round 3"),
    ("older round finished", "worker-0", push("worker-0", [1, 1], key=9, round_=1), "finished up to round 3"),
    ("round 0 after round 3", "worker-0", push("worker-0", [1, 1], key=9, round_=0), "finished up to round 3"),
    ("next round too early", "worker-1", push("worker-1", F4, round_=3), "round 2 .* is in progress"),
    ("previous round again", "worker-1", push("worker-1", F4, round_=1), "is in progress"),
    ("same round, other epoch", "worker-0", push("worker-0", F4, round_=2, route=[2, 0]), "is in progress"),
    ("a forwarded round", "worker-0", push("worker-0", F4, chunk=1), "is in progress"),
    ("the round after a forwarded one", "worker-0", push("worker-0", F4, chunk=1, round_=2), "is in progress"),
    # replies
    ("reply never forwarded", "server-0", reply(round_=2, values=F4), "did not forward"),
    ("reply of a finished round", "server-0", reply(key=9, round_=3), "did not forward"),
    ("reply of another round", "server-1", reply(chunk=1, round_=2, sender=2), "did not forward"),
    ("reply of an unknown chunk", "server-0", reply(key=5), "did not forward"),
    ("reply from another server", "server-0", reply(chunk=1), "not its parent"),
    ("reply from a child", "worker-0", reply(chunk=1, sender=10), "not its parent"),
    ("error from a child", "worker-1", reply(chunk=1, kind=Kind.ERROR, sender=11, meta={"error": "x"}),
     "not its parent"),
    ("reply of the wrong dtype", "server-1", Message(Kind.REPLY, sender=2, key=7, chunk=1, round=1, dtype="float64",
                                                     shape=(4,), payload=memoryview(np.zeros(4))), "carries float64"),
    ("reply of the wrong length", "server-1", reply(chunk=1, values=[1.0] * 3, sender=2), r"carries float32\[3\]"),
    # kinds
    *((f"a {kind.name}", "worker-0", Message(kind, sender=10, key=7, round=2, meta={"route": [1, 0]}),
       f"does not take {kind.name}")
      for kind in Kind if kind not in (Kind.PUSH, Kind.REPLY, Kind.ERROR)),
]


@pytest.mark.parametrize(("peer", "message", "problem"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_refused_messages_change_nothing(peer: str, message: Message, problem: str) -> None:
    relay = mid_relay()
    before = state(relay)
    with pytest.raises(WireError, match=problem) as caught:
        relay.handle(peer, 0, message)
    assert len(str(caught.value)) < 300
    assert state(relay) == before
    # the relay still works: round 2 of key 7 chunk 0 completes, chunk 1's reply fans down
    out = relay.handle("worker-1", 0, push("worker-1", [2.0] * 4, round_=2))
    assert [(peer, m.round, m.meta) for peer, _, m in out] == [("server-0", 2, {"ranks": [0, 1]})]
    assert values_of(out[0][2]) == [3.0] * 4
    assert len(relay.handle("server-1", 0, reply(chunk=1, values=F4, sender=2))) == 2


def test_the_state_snapshot_sees_a_change() -> None:
    """The refusal test compares snapshots: make sure one taken push does change it."""
    relay = mid_relay()
    before = state(relay)
    relay.handle("worker-1", 0, push("worker-1", F4, key=8))
    assert state(relay) != before


def test_a_child_aggregator_may_only_push_the_ranks_of_its_own_subtree() -> None:
    relay = new_relay("aggregator-0", Routing(1, (TWO_LEVEL,)))
    before = state(relay)
    with pytest.raises(WireError):
        relay.handle("aggregator-1", 0, push("aggregator-1", F4, ranks=[0]))
    assert state(relay) == before


# ------------------------------------------------------------------------------------------ epochs
def epoch(number: int, tree: Route = FLAT_TREE) -> Routing:
    return Routing(number, (tree,))


def test_install_keeps_every_epoch_from_keep_from_on() -> None:
    relay = new_relay("aggregator-0", epoch(1))
    for number in range(2, 7):  # no keep_from yet: a round of epoch 1 may still be in flight
        assert relay.tables.install(epoch(number)) == []  # parent: the servers, nothing to connect to
    assert sorted(relay.tables.epochs) == [1, 2, 3, 4, 5, 6]
    relay.tables.install(epoch(7), keep_from=4)
    assert sorted(relay.tables.epochs) == [4, 5, 6, 7]
    with pytest.raises(WireError, match="unknown tree 0 of routing epoch 3"):
        relay.handle("worker-0", 0, push("worker-0", F4, route=[3, 0]))
    relay.handle("worker-0", 0, push("worker-0", F4, route=[4, 0]))  # the oldest kept still works
    out = relay.handle("worker-1", 0, push("worker-1", F4, route=[4, 0]))
    assert [peer for peer, _, _ in out] == ["server-0"]
    relay.tables.install(epoch(8), keep_from=99)  # never the epoch being installed
    assert sorted(relay.tables.epochs) == [8]


def test_install_keeps_at_most_max_epochs() -> None:
    relay = new_relay("aggregator-0", epoch(1))
    for number in range(2, MAX_EPOCHS + 11):
        relay.tables.install(epoch(number))
    assert sorted(relay.tables.epochs) == list(range(11, MAX_EPOCHS + 11))


@pytest.mark.parametrize("number", [1, 2, 3])
def test_an_epoch_not_newer_is_refused(number: int) -> None:
    relay = new_relay("aggregator-0", epoch(2), epoch(3))
    before = state(relay)
    with pytest.raises(WireError, match="not newer than 3"):
        relay.tables.install(epoch(number))
    assert state(relay) == before


@pytest.mark.parametrize(
    ("parent", "problem"),
    [("worker-1", "names 'worker-1' as the parent"), ("aggregator-7", "'aggregator-7'"), ("", "not an aggregator")],
)
def test_a_parent_that_is_not_an_aggregator_is_refused(parent: str, problem: str) -> None:
    relay = new_relay("aggregator-1", epoch(1))
    before = state(relay)
    bad = Routing(2, (Route(0.5, {"aggregator-1": "aggregator-0"}), Route(0.5, {"aggregator-1": parent})))
    with pytest.raises(WireError, match=problem):
        relay.tables.install(bad)
    assert state(relay) == before


def test_install_names_the_parent_aggregators_to_connect_to() -> None:
    relay = new_relay("aggregator-1", epoch(1))
    trees = (Route(0.5, TWO_LEVEL.parents), Route(0.25, {"worker-3": "aggregator-1"}),
             Route(0.25, {"worker-0": "aggregator-1", "aggregator-1": "aggregator-0"}))
    assert relay.tables.install(Routing(2, trees)) == ["aggregator-0"]
    assert relay.tables.epochs[2] == [
        TreeView("aggregator-0", frozenset({"worker-1", "worker-2"}), (1, 2)),
        TreeView(SERVERS, frozenset({"worker-3"}), (3,)),
        TreeView("aggregator-0", frozenset({"worker-0"}), (0,)),
    ]


@pytest.mark.timeout(0.5, method="signal")  # a correct install returns at once
def test_a_routing_with_a_cycle_is_refused() -> None:
    relay = new_relay("aggregator-0", epoch(1))
    before = state(relay)
    with pytest.raises(WireError):
        relay.tables.install(epoch(2, Route(1.0, {"aggregator-0": "aggregator-1", "aggregator-1": "aggregator-0"})))
    assert state(relay) == before


@pytest.mark.parametrize(
    "table",
    [
        "not a list",
        [[7, "w", [4], "float32", 0]],
        [[7, "w", [4], "complex64", 0, [[0, 0, 4, 0]]]],
        [[7, "w", [4], ["float32"], 0, [[0, 0, 4, 0]]]],
        [["7", "w", [4], "float32", 0, [[0, 0, 4, 0]]]],
        [[7, "w", [4], "float32", 0, [[0, 0, 4, 2]]]],  # server 2 of 2
        [[7, "w", [4], "float32", 0, [[0, 0, -1, 0]]]],
        [[7, "w", [4], "float32", 0, [[0, 0, 1 << 30, 0]]]],  # 4 GiB
        [[7, "w", [4], "float32", 0, [[0, 0, 4]]]],
        [[20, "w", [4], "float32", 0, [[0, 0, 4, 0]]], "junk"],  # a valid first entry: nothing may be added
    ],
)
def test_a_malformed_plan_changes_nothing(table: Any) -> None:
    relay = new_relay()
    before = state(relay)
    with pytest.raises(WireError):
        relay.tables.add_plan(table)
    assert state(relay) == before


# ------------------------------------------------------------------------------------------ hostile messages
PROPERTY = settings(max_examples=200, derandomize=True, database=None, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
junk = st.sampled_from([None, True, -1, 0, 1, 2, 3, 1 << 40, 1.5, "", "x", [], {}, [1], [[1, 0]]])
routes = st.sampled_from([[1, 0], [2, 0], [2, 1], [3, 0], [2, -1], [1, 0, 0]]) | junk
rank_lists = st.lists(st.integers(-1, WORKERS), max_size=4) | st.sampled_from([[1, 2], [0], [3]]) | junk
meta = st.none() | st.fixed_dictionaries({}, optional={
    "route": routes, "ranks": rank_lists, "error": st.text(max_size=5) | junk,
    "opt": st.sampled_from([None, {}, {"name": "sgd", "lr": 0.1}]) | junk,
})
PEERS = [*IDS, "stranger"]
#: (child, route) pairs aggregator-0 of mid_relay() takes pushes from
CHILDREN = [("worker-0", [1, 0]), ("worker-1", [1, 0]), ("worker-0", [2, 0]), ("aggregator-1", [2, 0]),
            ("worker-3", [2, 1])]


#: the round of each chunk mid_relay() takes next (chunk 1 of key 7 waits for its reply to round 1)
NEXT_ROUND = {(7, 0): 2, (7, 1): 2, (8, 0): 1, (9, 0): 4}
OWNER = {(7, 0): "server-0", (7, 1): "server-1", (8, 0): "server-1", (9, 0): "server-0"}
any_dtype_shape = st.sampled_from(["", *DTYPES]).flatmap(
    lambda dtype: st.tuples(st.just(dtype), st.sampled_from([[4], [2], [3], [0], [2, 2], []] if dtype else [[]])))
#: a field of a plausible message drawn at random instead
MUTATIONS: dict[str, st.SearchStrategy[Any]] = {
    "kind": st.sampled_from(list(Kind)),
    "peer": st.sampled_from(PEERS),
    "sender": st.sampled_from([*IDS.values(), -1, 0, 99]),
    "at": st.sampled_from([*LENGTH, (7, 2), (5, 0)]),
    "round": st.sampled_from([0, 1, 2, 3, 4, 5, 1 << 40]),
    "dtype_shape": any_dtype_shape,
    "meta": meta,
    "shm": st.just(True),
}


@st.composite
def relay_messages(draw: st.DrawFn) -> tuple[str, Message]:
    """A data message as an aggregator may get one: a plausible push from a child of mid_relay()'s aggregator-0 or
    reply from a server, to a chunk it knows, with none, one or two of its fields drawn at random instead."""
    at = draw(st.sampled_from(list(LENGTH)))
    fields: dict[str, Any] = {"at": at, "round": NEXT_ROUND[at] + draw(st.integers(-1, 1)), "shm": False}
    if draw(st.booleans()):
        fields["peer"], route = draw(st.sampled_from(CHILDREN))
        fields["kind"] = Kind.PUSH
        fields["meta"] = {"route": route, **({"ranks": [1, 2]} if fields["peer"] == "aggregator-1" else {})}
        fields["dtype_shape"] = (DTYPE[fields["at"]], [LENGTH[fields["at"]]])
    else:
        fields["peer"] = OWNER[at] if draw(st.integers(0, 3)) else draw(st.sampled_from(["server-0", "aggregator-0"]))
        fields["round"] = NEXT_ROUND[at] - draw(st.integers(0, 1))  # a round forwarded, or the one before
        fields["kind"] = draw(st.sampled_from([Kind.REPLY, Kind.ERROR]))
        with_value = fields["kind"] == Kind.REPLY and draw(st.booleans())
        fields["dtype_shape"] = (DTYPE[fields["at"]], [LENGTH[fields["at"]]]) if with_value else ("", [])
        fields["meta"] = {"error": "refused"} if fields["kind"] == Kind.ERROR else None
    fields["sender"] = IDS.get(fields["peer"], 99)
    count = draw(st.sampled_from([0, 0, 0, 1, 1, 2]))
    for name in draw(st.lists(st.sampled_from(sorted(MUTATIONS)), min_size=count, max_size=count, unique=True)):
        fields[name] = draw(MUTATIONS[name])
    (key, chunk), (dtype, shape) = fields["at"], fields["dtype_shape"]
    nbytes = int(np.prod(shape)) * DTYPES[dtype] if dtype else 0
    msg = Message(fields["kind"], sender=fields["sender"], key=key, chunk=chunk, round=fields["round"],
                  priority=draw(st.integers(0, 3)), dtype=dtype, shape=tuple(shape),
                  flags=draw(st.sampled_from([Flag.NONE, Flag.WANT_REPLY, Flag.LOCAL, Flag.WANT_REPLY | Flag.LOCAL])),
                  meta=fields["meta"])
    if dtype and fields["shm"]:
        msg.shm = ("sluice-1-0-0", 0, nbytes)
    elif dtype:
        msg.payload = draw(st.binary(min_size=nbytes, max_size=nbytes))
    return fields["peer"], msg


relay_ops = st.tuples(st.just("handle"), relay_messages()) | st.tuples(st.just("left"), st.integers(-1, WORKERS) | junk)


def check_invariants(relay: Relay) -> None:
    """Every round in progress holds only its tree's ranks, and each rank pushed is summed or waits in the stash."""
    for at, round_ in relay._rounds.items():
        assert set(round_.pushed) <= set(round_.view.ranks) and round_.children
        if not round_.forwarded:
            total = relay._buffers[at].sum
            waiting = {r for ranks, _ in total.stash.values() for r in ranks}
            assert total.covered | waiting == round_.pushed and not total.covered & waiting


@PROPERTY
@given(st.lists(relay_ops, max_size=10))
def test_the_relay_takes_any_message(ops: list[tuple[str, Any]]) -> None:
    relay = mid_relay()
    for what, value in ops:
        before = state(relay)
        try:
            if what == "left":
                out = relay.worker_left(value)
            else:
                peer, generated = value
                msg = received(generated)
                if msg is None:
                    continue
                out = relay.handle(peer, 0, msg)
        except WireError as exc:
            assert len(str(exc)) < 400
            assert state(relay) == before, f"a refused {what} changed the relay"
            continue
        for to, channel, sent in out:
            assert type(to) is str and type(channel) is int and received(sent) is not None
        check_invariants(relay)


