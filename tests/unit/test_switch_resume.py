"""A standby's aggregation trees (scheduler/hierarchy/switch.py `RouteSwitch.resume`): the routing epoch rebuilt from
what each node was told, a switch the scheduler left open finished; the REJOIN's part checked; no sockets."""

from __future__ import annotations

from typing import Any

import pytest

from sluice.scheduler.hierarchy.routes import Route, Routing
from sluice.scheduler.hierarchy.switch import RouteSwitch, Told, parse_told
from sluice.scheduler.rejoin import Recall
from sluice.transport.wire import Kind, Message, WireError

pytestmark = pytest.mark.timeout(60)

W0, W1, W2, A0, A1 = "worker-0", "worker-1", "worker-2", "aggregator-0", "aggregator-1"
WORKERS, AGGREGATORS = [W0, W1, W2], [A0, A1]
OLD = Routing(1, (Route(1.0, {W0: A0, W1: A0}),))
NEW = Routing(2, (Route(0.5, {W0: A0, W1: A1}), Route(0.5, {W2: A1})))


def sent(out: list[tuple[str, Message]]) -> list[tuple[str, str, Any]]:
    return [(to, m.kind.name, m.meta) for to, m in out]


def committed(epoch: int, rounds: list[tuple[int, int]]) -> Told:
    return Told(OLD if epoch == 1 else NEW, rounds, (epoch, [(7, 5)]))


def test_every_node_committed_the_newest_epoch_nothing_to_send_and_epochs_go_on_from_it() -> None:
    switch = RouteSwitch()
    switch.propose(OLD.trees)  # the standby's own proposal from the config, before taking over: dropped
    told = {W0: committed(2, [(7, 4)]), W1: committed(2, [(7, 4)]), W2: committed(2, [(7, 3)]),
            A0: Told(NEW), A1: Told(NEW)}
    assert switch.resume(told, WORKERS, AGGREGATORS, []) == []
    assert switch.epoch == 2 and switch.current == NEW and not switch.switching
    assert [m.meta for _, m in switch.installed(A0)] == [{"routes": NEW.encode(), "again": True}]  # for a replacement
    out = switch.propose(OLD.trees)  # a re-plan: the next epoch is 3
    assert sent(out) == [(A0, "ROUTES", {"routes": Routing(3, OLD.trees).encode()}),
                         (A1, "ROUTES", {"routes": Routing(3, OLD.trees).encode()})]


def test_a_commit_some_workers_got_goes_to_the_others_as_it_was() -> None:
    switch = RouteSwitch()
    told = {W0: committed(2, [(7, 4)]), W1: Told(NEW, [(7, 4)], (1, [])), W2: Told(NEW, [(7, 3)]),
            A0: Told(NEW), A1: Told(NEW)}
    assert sent(switch.resume(told, WORKERS, AGGREGATORS, [])) == [
        (W1, "COMMIT", {"epoch": 2, "rounds": [[7, 5]]}), (W2, "COMMIT", {"epoch": 2, "rounds": [[7, 5]]})]
    assert switch.current == NEW and not switch.switching


def test_answers_given_to_the_scheduler_count_and_the_workers_without_one_are_asked_again() -> None:
    switch = RouteSwitch()
    told = {W0: Told(NEW, [(7, 4), (9, 1)]), W1: Told(NEW, None, (1, [])), W2: Told(OLD, [(7, 2)], (1, [])),
            A0: Told(NEW), A1: Told(NEW)}
    out = switch.resume(told, WORKERS, AGGREGATORS, [])
    assert sent(out) == [(W1, "ROUTES", {"routes": NEW.encode()}), (W2, "ROUTES", {"routes": NEW.encode()})]
    assert switch.switching and switch.epoch == 2
    assert switch.on_ack(W2, "worker", 2, [(7, 5)]) == []
    out = switch.on_ack(W1, "worker", 2, [(7, 4)])
    assert sent(out) == [(w, "COMMIT", {"epoch": 2, "rounds": [[7, 6], [9, 2]]}) for w in WORKERS]


def test_all_answers_in_before_the_scheduler_died_the_standby_commits_at_once() -> None:
    switch = RouteSwitch()
    told = {W0: Told(NEW, [(7, 4)]), W1: Told(NEW, [(7, 5)]), A0: Told(NEW), A1: Told(NEW)}
    out = switch.resume(told, [W0, W1], AGGREGATORS, [W2])  # worker 2 left before: not awaited
    assert sent(out) == [(w, "COMMIT", {"epoch": 2, "rounds": [[7, 6]]}) for w in (W0, W1)]


def test_an_aggregator_without_the_newest_trees_is_told_again_and_the_workers_after_it() -> None:
    switch = RouteSwitch()
    told = {W0: committed(1, []), W1: committed(1, []), W2: committed(1, []), A0: Told(NEW), A1: Told(OLD)}
    assert sent(switch.resume(told, WORKERS, AGGREGATORS, [])) == [(A1, "ROUTES", {"routes": NEW.encode()})]
    out = switch.on_ack(A1, "aggregator", 2, [])
    assert sent(out) == [(w, "ROUTES", {"routes": NEW.encode()}) for w in WORKERS]


def test_no_node_told_of_trees_the_standby_starts_its_own_first_switch() -> None:
    switch = RouteSwitch()
    switch.propose(OLD.trees)
    out = switch.resume({W0: Told(), A0: Told()}, [W0], [A0], [])
    assert sent(out) == [(A0, "ROUTES", {"routes": OLD.encode()})] and switch.epoch == 1


def test_nodes_that_disagree_on_the_newest_trees_are_refused() -> None:
    other = Routing(2, (Route(1.0, {W0: A1}),))
    with pytest.raises(WireError, match="different trees for routing epoch 2"):
        RouteSwitch().resume({W0: Told(NEW), W1: Told(other)}, [W0, W1], [A0, A1], [])


def test_what_a_node_recalls_is_what_the_standby_parses() -> None:
    recall = Recall()
    assert parse_told(recall.rejoin_meta("worker", 0, 3, [], 1, "f", "tcp://h:1")["routing"]) == Told()
    recall.on_message(Message(Kind.ROUTES, meta={"routes": NEW.encode()}))
    recall.sent(Kind.ROUTES_ACK, {"epoch": 2, "rounds": [[7, 4]]})
    assert parse_told(recall.rejoin_meta("worker", 0, 3, [], 1, "f", "tcp://h:1")["routing"]) == Told(NEW, [(7, 4)])
    recall.on_message(Message(Kind.COMMIT, meta={"epoch": 2, "rounds": [[7, 5]]}))
    assert parse_told(recall.rejoin_meta("worker", 0, 3, [], 1, "f", "tcp://h:1")["routing"]) == Told(NEW, [(7, 4)],
                                                                                         (2, [(7, 5)]))
    recall.on_message(Message(Kind.ROUTES, meta={"routes": Routing(3, OLD.trees).encode()}))  # a new switch opens
    assert parse_told(recall.rejoin_meta("worker", 0, 3, [], 1, "f", "tcp://h:1")["routing"]).acked is None


@pytest.mark.parametrize("raw", [
    [], {"routes": None}, {"routes": None, "acked": None, "committed": None, "x": 1},
    {"routes": [0, []], "acked": None, "committed": None},
    {"routes": None, "acked": [[1]], "committed": None},
    {"routes": None, "acked": None, "committed": [2]},
    {"routes": None, "acked": None, "committed": ["2", []]},
    {"routes": None, "acked": None, "committed": [2, [[1, -1]]]},
])
def test_a_bad_routing_in_a_rejoin_is_refused(raw: object) -> None:
    with pytest.raises(WireError):
        parse_told(raw)
