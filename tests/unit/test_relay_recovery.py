"""An aggregator's part in server recovery (ps/relay.py `server_back`): what it sends again to a replaced server."""

from __future__ import annotations

import pytest

from sluice.ps.relay import Relay
from sluice.scheduler.hierarchy.routes import Routing
from sluice.scheduler.resend import Answered
from sluice.transport.wire import Flag, Kind, WireError
from tests.unit.relay_helpers import TWO_LEVEL, new_relay, push, reply, summary, values_of

pytestmark = pytest.mark.timeout(60)


def _round(relay: Relay, round_: int, chunk: int = 0, base: float = 0.0, opt: dict[str, float] | None = None) -> None:
    """Workers 0 and 1 push round `round_` of key 7 `chunk` (values base + round and 1): forwarded up."""
    meta = {"route": [1, 0], **({"opt": opt} if opt else {})}
    relay.handle("worker-0", 2, push("worker-0", [base + round_] * 4, chunk=chunk, round_=round_, meta=meta))
    assert len(relay.handle("worker-1", 2, push("worker-1", [1.0] * 4, chunk=chunk, round_=round_))) == 1


def test_a_replaced_server_gets_again_the_forwarded_pushes_it_did_not_answer() -> None:
    relay = new_relay()
    _round(relay, 1, chunk=0, opt={"lr": 0.1})
    relay.handle("server-0", 2, reply(round_=1))
    _round(relay, 2, chunk=0)  # forwarded to server 0, never answered: it died
    _round(relay, 1, chunk=1)  # server 1's: not server 0's business
    again = relay.server_back(0)
    assert summary(again) == [("server-0", 2, Kind.PUSH, 3, 7, 0, 2, 0, Flag.WANT_REPLY | Flag.RESEND, "float32",
                               (4,), {"ranks": [0, 1], "opt": {"lr": 0.1}})]  # the settings the replacement lacks
    assert values_of(again[0][2]) == [3.0] * 4
    assert [m.round for _, _, m in relay.server_back(1)] == [1]
    # the replacement answers the round from its state: the reply fans down as any other
    down = relay.handle("server-0", 2, reply(round_=2, values=[9.0] * 4))
    assert [(peer, m.kind, m.round) for peer, _, m in down] == [("worker-0", Kind.REPLY, 2),
                                                                ("worker-1", Kind.REPLY, 2)]
    assert relay.server_back(0) == []


def test_with_replicas_the_answered_rounds_kept_are_replayed_first_oldest_first_as_they_were() -> None:
    relay = new_relay()
    relay.kept = Answered(2)
    for round_ in (1, 2, 3):
        _round(relay, round_, base=10.0)
        relay.handle("server-0", 2, reply(round_=round_))
    _round(relay, 4, base=10.0)  # unanswered
    again = relay.server_back(0)
    assert [(peer, channel, m.round, m.flags) for peer, channel, m in again] == [
        ("server-0", 2, 2, Flag.RESEND | Flag.REPLAY), ("server-0", 2, 3, Flag.RESEND | Flag.REPLAY),
        ("server-0", 2, 4, Flag.RESEND | Flag.WANT_REPLY)]
    # copies: the sum buffer has held round 4's sum since; each replay carries its own round's
    assert [values_of(m) for _, _, m in again] == [[13.0] * 4, [14.0] * 4, [15.0] * 4]
    assert all(m.meta == {"ranks": [0, 1]} for _, _, m in again)
    assert relay.server_back(1) == []


def test_a_middle_aggregator_sends_nothing_again_its_parent_is_an_aggregator() -> None:
    middle = new_relay("aggregator-1", Routing(1, (TWO_LEVEL,)))
    middle.kept = Answered(2)
    middle.handle("worker-1", 0, push("worker-1", [1.0] * 4))
    up = middle.handle("worker-2", 0, push("worker-2", [1.0] * 4))
    assert up[0][0] == "aggregator-0"
    middle.handle("aggregator-0", 0, reply(values=[1.0] * 4, sender=3))
    middle.handle("worker-1", 0, push("worker-1", [1.0] * 4, round_=2))
    middle.handle("worker-2", 0, push("worker-2", [1.0] * 4, round_=2))
    assert middle.server_back(0) == []  # the top aggregator keeps and sends the sums the server had


# ------------------------------------------------------------------------------------------ a replaced aggregator
def test_a_replaced_aggregator_forwards_pushes_sent_again_marked_so() -> None:
    fresh = new_relay()  # the replacement: no round seen
    fresh.handle("worker-0", 2, push("worker-0", [1.0] * 4, round_=7, flags=Flag.WANT_REPLY | Flag.RESEND))
    up = fresh.handle("worker-1", 2, push("worker-1", [2.0] * 4, round_=7))  # this one had not pushed yet
    assert [(peer, m.round, m.flags) for peer, _, m in up] == [("server-0", 7, Flag.WANT_REPLY | Flag.RESEND)]
    assert values_of(up[0][2]) == [3.0] * 4


def test_a_push_sent_again_that_is_in_already_changes_nothing_and_a_finished_round_is_answered_again() -> None:
    top = new_relay("aggregator-0", Routing(1, (TWO_LEVEL,)))
    top.handle("aggregator-1", 3, push("aggregator-1", [1.0] * 4, ranks=[1, 2]))
    again = push("aggregator-1", [1.0] * 4, ranks=[1, 2], flags=Flag.WANT_REPLY | Flag.RESEND)
    assert top.handle("aggregator-1", 3, again) == []  # its reply goes to the name, the replacement now
    top.handle("worker-0", 1, push("worker-0", [1.0] * 4))
    top.handle("server-0", 0, reply(values=[6.0] * 4))  # fanned down; aggregator-1 died before it got it
    out = top.handle("aggregator-1", 3, again)
    assert [(peer, channel, m.kind, m.round, values_of(m)) for peer, channel, m in out] == [
        ("aggregator-1", 3, Kind.REPLY, 1, [6.0] * 4)]


def test_a_replaced_parent_aggregator_gets_again_what_was_forwarded_to_it_unanswered() -> None:
    middle = new_relay("aggregator-1", Routing(1, (TWO_LEVEL,)))
    middle.handle("worker-1", 0, push("worker-1", [1.0] * 4))
    up = middle.handle("worker-2", 0, push("worker-2", [1.0] * 4))
    again = middle.parent_back("aggregator-0")
    assert [(peer, m.round, m.flags, m.meta) for peer, _, m in again] == [
        ("aggregator-0", 1, Flag.WANT_REPLY | Flag.RESEND, up[0][2].meta)]
    assert middle.parent_back("aggregator-9") == []


RESENT = Flag.WANT_REPLY | Flag.RESEND


def test_a_replacement_passes_up_alone_a_push_sent_again_of_a_round_a_child_is_past() -> None:
    """The dead aggregator fanned round 10's reply to worker 0 only, which went on to push round 11: worker 1's
    round 10, sent again after it, is passed up alone (the server answers it from its value), and its reply
    goes to worker 1 only; round 11 then completes as any round."""
    fresh = new_relay()
    assert fresh.handle("worker-0", 2, push("worker-0", [5.0] * 4, round_=11, flags=RESENT)) == []
    up = fresh.handle("worker-1", 2, push("worker-1", [2.0] * 4, round_=10, flags=RESENT))
    assert summary(up) == [("server-0", 2, Kind.PUSH, 3, 7, 0, 10, 0, RESENT, "float32", (4,), {"ranks": [1]})]
    assert values_of(up[0][2]) == [2.0] * 4
    down = fresh.handle("server-0", 2, reply(round_=10, values=[7.0] * 4))
    assert [(peer, channel, m.kind, m.round, values_of(m)) for peer, channel, m in down] == [
        ("worker-1", 2, Kind.REPLY, 10, [7.0] * 4)]
    up = fresh.handle("worker-1", 2, push("worker-1", [1.0] * 4, round_=11))
    assert [(peer, m.round, m.flags, values_of(m)) for peer, _, m in up] == [("server-0", 11, RESENT, [6.0] * 4)]
    with pytest.raises(WireError, match="did not forward"):  # answered once: a second reply of round 10 is refused
        fresh.handle("server-0", 2, reply(round_=10, values=[7.0] * 4))


def test_a_replacement_that_began_a_round_of_pushes_sent_again_passes_them_up_when_a_child_pushes_the_next() -> None:
    """Worker 1's round 10 came first, sent again: the replacement cannot tell yet that the round is over upstream.
    Worker 0's round 11 (not sent again: it was pushed after the replacement) says so: worker 1's push goes up
    alone and round 11 begins with worker 0's."""
    fresh = new_relay()
    assert fresh.handle("worker-1", 2, push("worker-1", [2.0] * 4, round_=10, flags=RESENT)) == []
    up = fresh.handle("worker-0", 2, push("worker-0", [5.0] * 4, round_=11))
    assert summary(up) == [("server-0", 2, Kind.PUSH, 3, 7, 0, 10, 0, RESENT, "float32", (4,), {"ranks": [1]})]
    assert values_of(up[0][2]) == [2.0] * 4
    error = fresh.handle("server-0", 2, reply(round_=10, kind=Kind.ERROR, meta={"error": "no"}))
    assert [(peer, m.kind, m.round, m.meta) for peer, _, m in error] == [("worker-1", Kind.ERROR, 10, {"error": "no"})]
    up = fresh.handle("worker-1", 2, push("worker-1", [1.0] * 4, round_=11))
    assert [(peer, m.round, values_of(m)) for peer, _, m in up] == [("server-0", 11, [6.0] * 4)]


def test_a_round_of_first_pushes_is_not_taken_as_over_upstream() -> None:
    """Without pushes sent again, a push of the next round while a round is in progress is refused as before."""
    relay = new_relay()
    relay.handle("worker-1", 2, push("worker-1", [2.0] * 4, round_=10))
    with pytest.raises(WireError, match=r"while round 10 .* is in progress"):
        relay.handle("worker-0", 2, push("worker-0", [5.0] * 4, round_=11))


REPLAYED = Flag.RESEND | Flag.REPLAY


def test_a_replacement_on_another_host_sums_the_replayed_rounds_again_and_keeps_them_for_the_server() -> None:
    """The aggregator was lost with its host (and its copies of the sums): its children replay their answered
    pushes, several rounds at once in any interleaving; each round is summed over the same subtree, sent up as
    it first was (no reply wanted), and kept for a server replaced later. A round one child no longer holds
    never completes, and goes once a live round of the chunk is answered."""
    fresh = new_relay()
    fresh.kept = Answered(4)
    meta = {"route": [1, 0], "opt": {"lr": 0.5}}
    assert fresh.handle("worker-0", 2, push("worker-0", [1.0] * 4, round_=4, flags=REPLAYED, meta=meta)) == []
    assert fresh.handle("worker-0", 2, push("worker-0", [2.0] * 4, round_=5, flags=REPLAYED, meta=meta)) == []
    up5 = fresh.handle("worker-1", 2, push("worker-1", [10.0] * 4, round_=5, flags=REPLAYED))
    up6 = fresh.handle("worker-1", 2, push("worker-1", [20.0] * 4, round_=6, flags=REPLAYED))
    assert up6 == [] and summary(up5) == [("server-0", 2, Kind.PUSH, 3, 7, 0, 5, 0, REPLAYED, "float32", (4,),
                                           {"ranks": [0, 1], "opt": {"lr": 0.5}})]
    assert values_of(up5[0][2]) == [12.0] * 4
    up6 = fresh.handle("worker-0", 2, push("worker-0", [3.0] * 4, round_=6, flags=REPLAYED, meta=meta))
    assert [(m.round, values_of(m)) for _, _, m in up6] == [(6, [23.0] * 4)]
    # the same replay again begins a round that never completes (the server would drop it anyway)
    assert fresh.handle("worker-0", 2, push("worker-0", [3.0] * 4, round_=6, flags=REPLAYED, meta=meta)) == []
    assert [(m.round, m.flags, values_of(m)) for _, _, m in fresh.server_back(0)] == [
        (5, REPLAYED, [12.0] * 4), (6, REPLAYED, [23.0] * 4)]
    # the live round 7, then its reply: round 4 (worker 1 no longer held it) and the stray 6 are dropped
    _round(fresh, 7)
    fresh.handle("server-0", 2, reply(round_=7))
    assert fresh.replays._replaying == {}
    with pytest.raises(WireError, match="not a child"):  # checked as any push
        fresh.handle("worker-2", 2, push("worker-2", [1.0] * 4, round_=3, flags=REPLAYED))


@pytest.mark.parametrize("replay_first", [True, False], ids=["replay-first", "resend-first"])
def test_a_round_one_child_replays_and_another_sends_again_is_summed_once_and_answered_to_the_second(
        replay_first: bool) -> None:
    """The lost aggregator had answered round 9 to worker 0 only: worker 0 replays it (answered), worker 1 sends it
    again (unanswered). Whatever their order, the replacement sums the two into round 9 as it first was, forwards
    it wanting a reply, and fans the reply to worker 1 alone."""
    fresh = new_relay()
    replay = push("worker-0", [4.0] * 4, round_=9, flags=REPLAYED, meta={"route": [1, 0], "opt": {"lr": 0.1}})
    again = push("worker-1", [1.0] * 4, round_=9, flags=RESENT)
    first, second = (("worker-0", replay), ("worker-1", again)) if replay_first else (("worker-1", again),
                                                                                      ("worker-0", replay))
    assert fresh.handle(first[0], 2, first[1]) == []
    up = fresh.handle(second[0], 2, second[1])
    assert summary(up) == [("server-0", 2, Kind.PUSH, 3, 7, 0, 9, 0, RESENT, "float32", (4,),
                            {"ranks": [0, 1], "opt": {"lr": 0.1}})]
    assert values_of(up[0][2]) == [5.0] * 4
    down = fresh.handle("server-0", 2, reply(round_=9, values=[3.0] * 4))
    assert [(peer, m.round, values_of(m)) for peer, _, m in down] == [("worker-1", 9, [3.0] * 4)]
