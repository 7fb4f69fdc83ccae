"""An aggregator across a switch of trees inside a round (ps/relay.py): a push of the next round from a child
that was not below it in the round still awaiting its reply is held, and taken when that reply is in."""

from __future__ import annotations

import pytest

from sluice.ps.relay import Relay
from sluice.scheduler.hierarchy.routes import Route, Routing
from sluice.transport.wire import Kind, WireError
from tests.unit.relay_helpers import FLAT_TREE, f32, new_relay, push, reply, state, summary, values_of

#: epoch 2: workers 0 and 2 send to aggregator-0 (epoch 1: workers 0 and 1; worker 2 to the server directly)
ZERO_TWO = Route(1.0, {"worker-0": "aggregator-0", "worker-2": "aggregator-0"})


def forwarded_round_one() -> Relay:
    """aggregator-0 has forwarded round 1 of key 7 chunk 0 (workers 0 and 1, epoch 1); its reply is not in."""
    relay = new_relay("aggregator-0", Routing(1, (FLAT_TREE,)), Routing(2, (ZERO_TWO,)))
    relay.handle("worker-0", 0, push("worker-0", [1.0] * 4))
    assert relay.handle("worker-1", 0, push("worker-1", [2.0] * 4))[0][0] == "server-0"
    return relay


def test_a_push_of_the_next_round_from_a_child_outside_the_forwarded_one_waits_for_its_reply() -> None:
    """Worker 2 pushed round 1 to the server itself, had its reply first, and pushes round 2 up the new tree before
    the server's reply of round 1 reaches aggregator-0 (a race of two connections): once refused, so round 2
    never completed and every worker waited (tests/integration/test_failover.py hung on it under load)."""
    relay = forwarded_round_one()
    assert relay.handle("worker-2", 1, push("worker-2", [4.0] * 4, round_=2, route=(2, 0))) == []
    assert list(relay._rounds) == [(7, 0)] and relay._rounds[(7, 0)].round == 1
    out = relay.handle("server-0", 0, reply(values=[3.0] * 4))  # round 1's reply: fanned down, worker 2's push taken
    assert [(peer, m.kind, m.round) for peer, _, m in out] == [("worker-0", Kind.REPLY, 1), ("worker-1", Kind.REPLY, 1)]
    assert relay._rounds[(7, 0)].round == 2 and relay._rounds[(7, 0)].pushed == {2}
    up = relay.handle("worker-0", 0, push("worker-0", [8.0] * 4, round_=2, route=(2, 0)))
    assert [(peer, m.round, m.meta) for peer, _, m in up] == [("server-0", 2, {"ranks": [0, 2]})]
    assert values_of(up[0][2]) == [12.0] * 4
    back = relay.handle("server-0", 0, reply(round_=2, values=[6.0] * 4))
    assert [(peer, channel, m.round) for peer, channel, m in back] == [("worker-2", 1, 2), ("worker-0", 0, 2)]
    assert relay._rounds == {} and not relay._held


def test_a_held_push_keeps_its_own_copy_of_the_payload() -> None:
    """The transport reuses a received payload's buffer once the handler returns."""
    relay = forwarded_round_one()
    data = f32([4.0] * 4)
    relay.handle("worker-2", 0, push("worker-2", data, round_=2, route=(2, 0)))
    data[:] = -1.0
    relay.handle("server-0", 0, reply(values=[3.0] * 4))
    up = relay.handle("worker-0", 0, push("worker-0", [1.0] * 4, round_=2, route=(2, 0)))
    assert values_of(up[0][2]) == [5.0] * 4


def test_after_an_error_for_the_forwarded_round_the_held_push_begins_the_next() -> None:
    relay = forwarded_round_one()
    relay.handle("worker-2", 0, push("worker-2", [4.0] * 4, round_=2, route=(2, 0)))
    out = relay.handle("server-0", 0, reply(kind=Kind.ERROR, meta={"error": "worker 3 has left the job"}))
    assert [(peer, m.kind) for peer, _, m in out] == [("worker-0", Kind.ERROR), ("worker-1", Kind.ERROR)]
    assert relay._rounds[(7, 0)].round == 2 and relay._rounds[(7, 0)].pushed == {2}


def test_a_held_push_refused_when_its_turn_comes_is_answered_with_an_error() -> None:
    """Its epoch was forgotten meanwhile: its sender waits for an answer, so it hears why instead of nothing."""
    relay = forwarded_round_one()
    relay.handle("worker-2", 3, push("worker-2", [4.0] * 4, round_=2, route=(2, 0), priority=2))
    relay.tables.install(Routing(3, (FLAT_TREE,)), keep_from=3)
    out = relay.handle("server-0", 0, reply(values=[3.0] * 4))
    assert summary(out)[2][:8] == ("worker-2", 3, Kind.ERROR, 3, 7, 0, 2, 2)
    error = out[2][2].meta["error"]
    assert error.startswith("aggregator-0 refused the push: ") and "unknown tree 0 of routing epoch 2" in error
    assert relay._rounds == {} and not relay._held


@pytest.mark.parametrize(("peer", "round_", "route", "problem"), [
    ("worker-0", 2, (2, 0), "round 1 .* is in progress"),  # in the forwarded round: its reply comes from here
    ("worker-1", 2, (1, 0), "round 1 .* is in progress"),
    ("worker-2", 3, (2, 0), "round 1 .* is in progress"),  # two rounds ahead
    ("worker-2", 1, (2, 0), "round 1 .* is in progress"),
    ("worker-3", 2, (2, 0), "not a child"),
])
def test_other_pushes_during_a_forwarded_round_are_still_refused(peer: str, round_: int, route: tuple[int, int],
                                                                   problem: str) -> None:
    relay = forwarded_round_one()
    before = state(relay)
    with pytest.raises(WireError, match=problem):
        relay.handle(peer, 0, push(peer, [1.0] * 4, round_=round_, route=route))
    assert state(relay) == before


def test_a_second_push_of_ranks_already_held_is_refused() -> None:
    relay = forwarded_round_one()
    relay.handle("worker-2", 0, push("worker-2", [4.0] * 4, round_=2, route=(2, 0)))
    before = state(relay)
    with pytest.raises(WireError, match="is in progress"):
        relay.handle("worker-2", 0, push("worker-2", [4.0] * 4, round_=2, route=(2, 0)))
    assert state(relay) == before
