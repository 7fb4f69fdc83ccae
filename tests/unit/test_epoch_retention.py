"""Which routing epochs the scheduler, the workers and the aggregators keep: every epoch a round in flight may still
travel, named by the workers' answers (`oldest`) and passed on as `keep_from`; literal tables, no sockets."""

from __future__ import annotations

from typing import Any

import pytest

from sluice.scheduler.hierarchy.routes import MAX_EPOCHS, Route, Routing, epoch_field, stale_epochs
from sluice.scheduler.hierarchy.switch import RouteSwitch
from sluice.transport.wire import WireError
from sluice.worker.routing import Router

W0, W1, A0, A1 = "worker-0", "worker-1", "aggregator-0", "aggregator-1"


def trees(epoch: int) -> tuple[Route, ...]:
    return (Route(1.0, {W0: A0 if epoch % 2 else A1, W1: A0 if epoch % 2 else A1}),)


# each switch: the oldest epoch W0's and W1's rounds in flight travel as they answer, then the COMMIT's keep_from
# and the epochs the scheduler keeps (the newest three always; older ones while a round named them)
SWITCHES = [
    (1, (0, 0), 0, [1]),
    (2, (0, 0), 0, [1, 2]),
    (3, (2, 0), 1, [1, 2, 3]),
    (4, (2, 3), 2, [2, 3, 4]),
    (5, (2, 0), 2, [2, 3, 4, 5]),  # a round of epoch 2 outlasts three switches: epoch 2 stays
    (6, (2, 5), 2, [2, 3, 4, 5, 6]),
    (7, (0, 0), 5, [5, 6, 7]),  # it completed: back to the newest three
    (8, (6, 0), 6, [6, 7, 8]),
]


def test_the_scheduler_keeps_the_epochs_of_rounds_in_flight_and_tells_the_workers_and_aggregators() -> None:
    switch = RouteSwitch()
    switch.start([W0, W1], [A0])
    previous_keep = 0
    for epoch, (oldest0, oldest1), keep_from, kept in SWITCHES:
        routes = switch.propose(trees(epoch))
        assert [(to, m.kind.name) for to, m in routes] == [(A0, "ROUTES")]
        assert epoch_field(routes[0][1].meta, "keep_from") == previous_keep  # the last COMMIT's, one switch late
        switch.on_ack(A0, "aggregator", epoch, [])
        switch.on_ack(W0, "worker", epoch, [(7, epoch)], oldest=oldest0)
        out = switch.on_ack(W1, "worker", epoch, [(7, epoch)], oldest=oldest1)
        assert [(to, m.kind.name) for to, m in out] == [(W0, "COMMIT"), (W1, "COMMIT")]
        meta: dict[str, Any] = out[0][1].meta or {}
        assert meta.get("keep_from", 0) == keep_from  # absent while 0
        assert switch.keep_from == keep_from and [r.epoch for r in switch.history] == kept
        previous_keep = keep_from


def test_the_scheduler_never_keeps_more_than_max_epochs() -> None:
    switch = RouteSwitch()
    switch.start([W0], [])
    for epoch in range(1, MAX_EPOCHS + 6):
        switch.propose(trees(epoch))
        switch.on_ack(W0, "worker", epoch, [], oldest=1)  # a round of epoch 1 that never ends
    assert [r.epoch for r in switch.history] == list(range(6, MAX_EPOCHS + 6))


@pytest.mark.parametrize(
    ("epochs", "keep_from", "stale"),
    [
        ([], 5, []),
        ([3, 1, 2], 0, []),
        ([1, 2, 3, 4], 3, [1, 2]),
        ([4, 5], 9, [4, 5]),  # callers cap keep_from at the epoch they install
        (list(range(1, MAX_EPOCHS + 3)), 0, [1, 2]),
        (list(range(1, MAX_EPOCHS + 3)), 4, [1, 2, 3]),
    ],
)
def test_stale_epochs(epochs: list[int], keep_from: int, stale: list[int]) -> None:
    assert stale_epochs(epochs, keep_from) == stale


@pytest.mark.parametrize(("meta", "value"), [(None, 0), ({}, 0), ({"keep_from": 0}, 0), ({"keep_from": 7}, 7),
                                             ({"keep_from": (1 << 31) - 1}, (1 << 31) - 1)])
def test_epoch_fields_parse(meta: dict[str, Any] | None, value: int) -> None:
    assert epoch_field(meta, "keep_from") == value


@pytest.mark.parametrize("raw", [-1, 1 << 31, True, 2.0, "3", None, [3], {"e": 3}])
def test_hostile_epoch_fields_are_refused(raw: object) -> None:
    with pytest.raises(WireError, match="keep_from must be a routing epoch"):
        epoch_field({"keep_from": raw}, "keep_from")


def committed_router(switch_rounds: list[int], keep_from: int = 0) -> Router:
    """A worker's router through one switch per entry, tensor 7's switch round of epoch e being switch_rounds[e-1]."""
    router = Router(W0)
    router.declare([(7, 0, 100), (8, 0, 100)])
    for epoch, switch_round in enumerate(switch_rounds, 1):
        router.begin(Routing(epoch, trees(epoch)), {A0, A1})
        router.commit(epoch, [(7, switch_round), (8, 1)], keep_from if epoch == len(switch_rounds) else 0)
    return router


def test_a_worker_names_the_oldest_epoch_its_rounds_in_flight_travel() -> None:
    router = committed_router([3, 6, 9, 12, 15])
    assert router.oldest_in_use([]) == 0
    assert router.oldest_in_use([(7, 2)]) == 0  # before epoch 1's switch round: straight to the servers
    assert router.oldest_in_use([(7, 4), (7, 13), (8, 40)]) == 1
    assert router.oldest_in_use([(7, 10), (7, 14)]) == 3


def test_a_worker_keeps_every_epoch_until_a_commit_says_otherwise() -> None:
    router = committed_router([3, 6, 9, 12, 15, 18])  # six epochs, none forgotten (the old rule kept four)
    assert [router.epoch_of(7, r) for r in (3, 6, 9, 12, 15, 18)] == [1, 2, 3, 4, 5, 6]
    assert router.route(7, 0, 4) == (1, 0, A0)
    router = committed_router([3, 6, 9, 12, 15, 18], keep_from=4)
    assert [router.parent(e, 0) for e in range(1, 7)] == [None, None, None, A1, A0, A1]
    assert [router.epoch_of(7, r) for r in (12, 15, 18)] == [4, 5, 6]
