"""The mid-round switch planner: which workers' held pushes of a chunk may take the new tree (literal tables)."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from sluice.errors import SluiceError
from sluice.scheduler.hierarchy.midround import (
    MAX_HELD,
    MOVED_BYTES,
    Held,
    movers,
    parse_held,
    parse_moved,
    path_up,
    plan_moves,
)
from sluice.scheduler.hierarchy.routes import Route, Routing
from sluice.scheduler.hierarchy.switch import RouteSwitch, Told, parse_told
from sluice.transport.wire import CONTROL_HEADER_BYTES, Flag, Kind, Message, WireError
from sluice.worker.handle import Handle
from sluice.worker.midround import HeldBack
from sluice.worker.routing import Router

W = [f"worker-{i}" for i in range(4)]
W0, W1, W2, W3 = W


def tree(**parents: str) -> Route:
    """A tree from child=parent pairs written w0="a0" (w: worker-, a: aggregator-)."""
    def name(short: str) -> str:
        return short if short == "server" else {"w": "worker-", "a": "aggregator-"}[short[0]] + short[1:]
    return Route(1.0, {name(child): name(parent) for child, parent in parents.items()})


DIRECT = None
RACK0_AT_A0 = tree(w0="a0", w1="a0")  # the cut rack's two workers summed at its aggregator; the others direct
PAIRS = tree(w0="a0", w1="a0", w2="a1", w3="a1")


def test_paths_up_a_tree_nearest_first() -> None:
    two_levels = tree(w0="a0", w1="a0", a0="a1", w2="a1")
    assert [path_up(two_levels, w) for w in W] == [
        ("aggregator-0", "aggregator-1"), ("aggregator-0", "aggregator-1"), ("aggregator-1",), ()]
    assert path_up(None, W0) == ()


@pytest.mark.parametrize(("old", "new", "holders", "moved"), [
    # bench/replan.py's case: the cut rack's workers sent their direct tree's chunks straight to the servers
    # and still hold some; the re-plan sums the rack at its aggregator: both move, the others have nothing to move
    (DIRECT, RACK0_AT_A0, {W0, W1}, {W0, W1}),
    (DIRECT, RACK0_AT_A0, set(W), {W0, W1}),
    # one of the rack's workers already sent its push straight to the server: its aggregator would wait for it
    (DIRECT, RACK0_AT_A0, {W0}, set()),
    # the other way: a rack summed at its aggregator goes straight to the servers, held by both
    (RACK0_AT_A0, DIRECT, {W0, W1, W2}, {W0, W1}),
    # groups that overlap chain into one component: all four must hold
    (PAIRS, tree(w1="a2", w2="a2"), {W0, W1, W2}, set()),
    (PAIRS, tree(w1="a2", w2="a2"), set(W), set(W)),
    # nothing changes for these workers: no move (their paths are the same in both trees)
    (PAIRS, PAIRS, set(W), set()),
    (RACK0_AT_A0, tree(w0="a0", w1="a0", w2="a1", w3="a1"), set(W), {W2, W3}),
])
def test_whole_components_held_by_all_with_a_path_that_changes_move(old: Route | None, new: Route | None,
                                                                     holders: set[str], moved: set[str]) -> None:
    assert movers(W, holders, old, new) == moved


def test_an_aggregator_takes_one_trees_round_of_a_chunk_at_a_time() -> None:
    # w0 and w1 already sent theirs to a0 on the old tree; w2 and w3 would be summed at a0 on the new one
    old, new = tree(w0="a0", w1="a0"), tree(w2="a0", w3="a0")
    assert movers(W, {W2, W3}, old, new) == set()
    # at another aggregator they move
    assert movers(W, {W2, W3}, old, tree(w2="a1", w3="a1")) == {W2, W3}


def test_a_component_that_stays_can_keep_another_from_moving() -> None:
    # {w0, w1} cannot move (w1 sent its push); staying, it keeps a0 busy on the old tree, so {w2, w3},
    # whose new path runs through a0, stays too
    old = tree(w0="a0", w1="a0")
    new = tree(w0="a1", w1="a1", w2="a2", w3="a2", a2="a0")
    assert movers(W, {W0, W2, W3}, old, new) == set()
    assert movers(W, set(W), old, new) == set(W)


def test_a_component_kept_back_keeps_its_old_aggregators_busy_for_the_others() -> None:
    # w3 still sent its push through a3 on the old tree, so w2 (a1 -> a3) stays; staying, w2 keeps a1 busy on the
    # old tree, through which w0 and w1 would go on the new one: they stay as well
    old, new = tree(w2="a1", w3="a3"), tree(w0="a1", w1="a1", w2="a3")
    assert movers(W, {W0, W1, W2}, old, new) == set()
    # with a3 out of it, all three move
    assert movers(W, {W0, W1, W2}, old, tree(w0="a1", w1="a1", w2="a2")) == {W0, W1, W2}


# ---------------------------------------------------------------- across chunks: plan_moves, the wire, the switch
A0, A1 = "aggregator-0", "aggregator-1"
#: epoch 1: half the chunks summed per pair of workers, half straight to the servers; epoch 2: all summed per pair
EPOCH1 = Routing(1, (Route(0.5, {W0: A0, W1: A0, W2: A1, W3: A1}), Route(0.5, {})))
EPOCH2 = Routing(2, (Route(1.0, {W0: A0, W1: A0, W2: A1, W3: A1}),))


def held(*chunks: int, tree: int = 1, epoch: int = 1) -> list[Held]:
    """Pushes of key 7, round 5 held back: chunk, on `tree` of `epoch`, tree 0 announced."""
    return [(7, 5, chunk, epoch, tree, 0) for chunk in chunks]


def test_plan_moves_chunk_by_chunk_the_groups_that_hold_theirs() -> None:
    # w0 and w1 still hold chunks 3 and 5 of the direct tree, w2 and w3 only chunk 5 (w3 sent chunk 3)
    said = {W0: held(3, 5), W1: held(3, 5), W2: held(3, 5), W3: held(5)}
    assert plan_moves(said, W, [EPOCH1], EPOCH2) == [(7, 5, 3, (W0, W1)), (7, 5, 5, (W0, W1, W2, W3))]
    # a worker gone holds nothing: its group stays (it still counts in the trees' groups)
    del said[W3]
    assert plan_moves(said, W, [EPOCH1], EPOCH2) == [(7, 5, 3, (W0, W1)), (7, 5, 5, (W0, W1))]


@pytest.mark.parametrize("said", [
    {W0: held(3), W1: held(3, tree=0)},  # the holders disagree on the chunk's tree
    {W0: held(3, epoch=4), W1: held(3, epoch=4)},  # an epoch not known here
    {W0: held(3, tree=9), W1: held(3, tree=9)},  # a tree the epoch does not have
    {W0: [(7, 5, 3, 1, 1, 9)], W1: [(7, 5, 3, 1, 1, 9)]},  # nor the announced trees
    {W0: held(3, tree=0), W1: held(3, tree=0)},  # already summed at a0: the same path in both
])
def test_plan_moves_moves_nothing_it_cannot_check(said: dict[str, list[Held]]) -> None:
    assert plan_moves(said, W, [EPOCH1], EPOCH2) == []


def test_rounds_before_the_jobs_first_trees_move_nowhere() -> None:
    said = {W0: held(3, epoch=0, tree=-1), W1: held(3, epoch=0, tree=-1)}
    assert plan_moves(said, W, [], EPOCH2) == []
    # the same pushes on epoch 1's direct tree move
    said = {W0: held(3), W1: held(3)}
    assert plan_moves(said, W, [EPOCH1], EPOCH2) == [(7, 5, 3, (W0, W1))]


@pytest.mark.parametrize("raw", [
    None, [[7, 5, 3, 1, 1]], [[7, 5, 3, 1, 1, "0"]], [[-1, 5, 3, 1, 1, 0]], [[7, 5, 3, 1, -2, 0]],
    [[7, 5, 3, 1, 1, 1 << 16]], [[True, 5, 3, 1, 1, 0]], [[7, 5, 3, 1, 1, 0]] * (MAX_HELD + 1),
])
def test_hostile_held_lists_are_refused(raw: object) -> None:
    with pytest.raises(WireError):
        parse_held(raw)


@pytest.mark.parametrize("raw", [
    None, [[7, 5, 3]], [[7, 5, 3, W0]], [[7, 5, -3, [W0]]], [[7, 5, 3, [1]]], [[7, 5, 3, ["w" * 65]]],
])
def test_hostile_moved_lists_are_refused(raw: object) -> None:
    with pytest.raises(WireError):
        parse_moved(raw)


def test_held_and_moved_round_trip() -> None:
    assert parse_held([[7, 5, 3, 0, -1, 0], [7, 5, 4, 1, 1, 0]]) == [(7, 5, 3, 0, -1, 0), (7, 5, 4, 1, 1, 0)]
    assert parse_moved([[7, 5, 3, [W0, W1]]]) == [(7, 5, 3, (W0, W1))]


def switched_to_epoch1() -> RouteSwitch:
    switch = RouteSwitch()
    switch.start(W, [A0, A1])
    switch.propose(EPOCH1.trees)
    for name in (A0, A1):
        switch.on_ack(name, "aggregator", 1, [])
    for name in W:
        switch.on_ack(name, "worker", 1, [])
    return switch


def test_the_commit_names_what_moved_and_a_standby_sends_the_same() -> None:
    switch = switched_to_epoch1()
    switch.propose(EPOCH2.trees)
    for name in (A0, A1):
        switch.on_ack(name, "aggregator", 2, [])
    for name in W[:3]:
        assert switch.on_ack(name, "worker", 2, [(7, 5)], held(3)) == []
    out = switch.on_ack(W3, "worker", 2, [(7, 5)], [])
    moved = [[7, 5, 3, [W0, W1]]]
    assert {(to, m.kind.name) for to, m in out} == {(w, "COMMIT") for w in W}
    assert all(m.meta == {"epoch": 2, "rounds": [[7, 6]], "moved": moved} for _, m in out)
    # a standby that took over: some workers have the COMMIT, the others get it as it was, moved and all
    told = parse_told({"routes": EPOCH2.encode(), "acked": [[7, 5]], "committed": [2, [[7, 6]], moved]})
    assert told.moved == ((7, 5, 3, (W0, W1)),)
    others = {W2: Told(EPOCH2, [(7, 5)]), W3: Told(EPOCH2, [(7, 5)]), A0: Told(EPOCH2), A1: Told(EPOCH2)}
    out = RouteSwitch().resume({W0: told, W1: told, **others}, W, [A0, A1], [])
    assert [(to, m.meta) for to, m in out] == [(W2, {"epoch": 2, "rounds": [[7, 6]], "moved": moved}),
                                               (W3, {"epoch": 2, "rounds": [[7, 6]], "moved": moved})]


def test_a_commit_with_nothing_held_names_nothing_moved() -> None:
    switch = switched_to_epoch1()
    switch.propose(EPOCH2.trees)
    for name in (A0, A1):
        switch.on_ack(name, "aggregator", 2, [])
    out = [m for name in W for _, m in switch.on_ack(name, "worker", 2, [(7, 5)])]
    assert [m.meta for m in out] == [{"epoch": 2, "rounds": [[7, 6]]}] * 4


# ---------------------------------------------------------------- the worker's side: HeldBack, a handle's names
class Queue:
    """A transport's send queue, as Transport.withdraw sees it (pure logic: the real one is tested with sockets)."""

    def __init__(self, queued: list[tuple[str, int, Message]]) -> None:
        self.queued = queued

    def withdraw(self, match: Any) -> list[tuple[str, int, Message]]:
        taken = [q for q in self.queued if match(*q)]
        self.queued = [q for q in self.queued if q not in taken]
        return taken


def push(chunk: int, round_: int = 5, flags: Flag = Flag.NONE, kind: Kind = Kind.PUSH) -> Message:
    return Message(kind, sender=3, key=7, chunk=chunk, round=round_, flags=flags)


def test_a_worker_holds_back_its_queued_pushes_of_the_round_in_flight_and_sends_each_where_the_commit_says() -> None:
    router = Router(W0)
    router.declare([(7, 0, 100, 0), (7, 1, 100, 1)])  # chunk 0 on tree 0 (summed at a0), chunk 1 on tree 1 (direct)
    held_back = HeldBack(Queue([]), W0)  # type: ignore[arg-type]
    router.begin(EPOCH1, {A0, A1})
    assert held_back.take(router, {(7, 5)}) == []  # before the first trees: nothing is taken back
    router.commit(1, [])
    router.begin(EPOCH2, {A0, A1})
    on_tree, direct = push(0), push(1)
    on_tree.meta = {"route": [1, 0], "opt": {"lr": 0.1}}
    others = [("server-0", 1, push(1, round_=4)), ("server-1", 1, push(1, flags=Flag.RESEND)),
              ("server-1", 1, push(1, kind=Kind.PULL))]
    queue = Queue([(A0, 1, on_tree), ("server-1", 1, direct), *others])
    held_back = HeldBack(queue, W0)  # type: ignore[arg-type]
    assert held_back.take(router, {(7, 5)}) == [[7, 5, 0, 1, 0, 0], [7, 5, 1, 1, 1, 0]]
    assert queue.queued == others  # another round's, a push sent again, a pull: left where they were
    router.commit(2, [(7, 6)])
    out, onto = held_back.release(router, [(7, 5, 1, (W0, W1)), (7, 5, 0, (W2, W3))], lambda rank: f"server-{rank}")
    assert [(peer, channel, msg.chunk, msg.meta) for peer, channel, msg in out] == [
        (A0, 1, 0, {"route": [1, 0], "opt": {"lr": 0.1}}),  # not listed for this worker: where it was going
        (A0, 1, 1, {"route": [2, 0]})]  # moved: summed at a0 in epoch 2's tree
    assert onto == [(direct, A0)] and held_back.pushes == [] and set(router.moved_at) == {2}


def test_a_handle_names_where_a_moved_push_went_if_it_never_answers() -> None:
    handle = Handle("push_pull of 'grad' round 5", {0: "server 0", 1: "server 1"}, 0.01)
    handle.via(1, "aggregator 0")
    with pytest.raises(SluiceError, match=r"from aggregator 0 \(for server 1\), server 0"):
        handle.wait()
    handle.via(1, None)  # moved off its tree inside the round: straight to its server
    with pytest.raises(SluiceError, match=r"chunks \[0, 1\] from server 0, server 1$"):
        handle.wait()


def test_a_commit_lists_no_more_moves_than_a_control_message_carries() -> None:
    said = {w: held(*range(MAX_HELD + 10)) for w in (W0, W1)}
    moves = plan_moves(said, W, [EPOCH1], EPOCH2)
    assert 0 < len(moves) <= MAX_HELD
    assert sum(32 + sum(len(w) + 2 for w in workers) for *_, workers in moves) <= MOVED_BYTES
    encoded = msgpack.packb([[key, round_, chunk, list(workers)] for key, round_, chunk, workers in moves])
    assert len(encoded) < CONTROL_HEADER_BYTES // 2
