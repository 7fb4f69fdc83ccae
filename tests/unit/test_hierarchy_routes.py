"""Aggregation trees: config and wire forms, checks, subtrees, chunk assignment, the scheduler's switch protocol and
the worker's side of it; literal tables, no sockets."""

from __future__ import annotations

import copy
import itertools
import math
from typing import Any

import msgpack
import pytest

from sluice.scheduler.hierarchy.routes import (
    MAX_EDGES,
    MAX_TREES,
    SERVERS,
    ChunkAssignment,
    Route,
    Routing,
    assign_chunks,
    check_trees,
    parse_routing,
    parse_static_trees,
    subtree_ranks,
)
from sluice.scheduler.hierarchy.switch import MAX_ACK_KEYS, RouteSwitch, parse_rounds
from sluice.transport.wire import Message, WireError
from sluice.worker.routing import Router

W0, W1, W2, W3 = "worker-0", "worker-1", "worker-2", "worker-3"
A0, A1, A2 = "aggregator-0", "aggregator-1", "aggregator-2"


# ------------------------------------------------------------------------------------------ parse_static_trees
@pytest.mark.parametrize(
    ("entries", "sets"),
    [
        ([], {}),
        (["1: worker-0>aggregator-0 aggregator-0>server"], {0: [Route(1.0, {W0: A0, A0: SERVERS})]}),
        (["3: worker-0>aggregator-0", "1: worker-1>aggregator-0"],
         {0: [Route(0.75, {W0: A0}), Route(0.25, {W1: A0})]}),
        (["0.5: worker-0>aggregator-1", "1.5: worker-1>aggregator-1 worker-0>aggregator-0"],
         {0: [Route(0.25, {W0: A1}), Route(0.75, {W1: A1, W0: A0})]}),
        (["  0.5:worker-0>server  "], {0: [Route(1.0, {W0: SERVERS})]}),
        (["1:"], {0: [Route(1.0, {})]}),
        (["2: worker-123456>aggregator-999999"], {0: [Route(1.0, {"worker-123456": "aggregator-999999"})]}),
        (["@0 1: worker-0>aggregator-0", "@1 2: worker-1>aggregator-1", "@1 2: worker-0>aggregator-1"],
         {0: [Route(1.0, {W0: A0})], 1: [Route(0.5, {W1: A1}), Route(0.5, {W0: A1})]}),
        (["@1 1: worker-0>server", "@0 1: worker-1>server"],
         {1: [Route(1.0, {W0: SERVERS})], 0: [Route(1.0, {W1: SERVERS})]}),
        (["1e-3: worker-0>aggregator-0"], {0: [Route(1.0, {W0: A0})]}),
    ],
)
def test_static_trees_parse_to_sets_with_normalised_weights(entries: list[str], sets: dict[int, list[Route]]) -> None:
    parsed = parse_static_trees(entries)
    assert parsed == sets
    for trees in parsed.values():
        assert sum(t.weight for t in trees) == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        ("worker-0>aggregator-0", "must start with a weight"),
        ("x: worker-0>aggregator-0", "must start with a weight"),
        ("0.5 worker-0>aggregator-0", "must start with a weight"),
        (": worker-0>aggregator-0", "must start with a weight"),
        ("0.5", "want a positive weight, then ':' and edges"),
        ("0: worker-0>aggregator-0", "want a positive weight"),
        ("-1: worker-0>aggregator-0", "want a positive weight"),
        ("nan: worker-0>aggregator-0", "want a positive weight"),
        ("inf: worker-0>aggregator-0", "want a positive weight"),
        ("1e400: worker-0>aggregator-0", "want a positive weight"),
        ("1: worker-0-aggregator-0", "edge 'worker-0-aggregator-0' is not CHILD>PARENT"),
        ("1: worker-0>", "is not CHILD>PARENT"),
        ("1: >aggregator-0", "is not CHILD>PARENT"),
        ("1: server>aggregator-0", "is not CHILD>PARENT"),
        ("1: server-0>aggregator-0", "is not CHILD>PARENT"),
        ("1: worker-0>worker", "is not CHILD>PARENT"),
        ("1: worker-0>servers", "is not CHILD>PARENT"),
        ("1: worker-0>aggregator-0>server", "is not CHILD>PARENT"),
        ("1: worker-1234567>aggregator-0", "is not CHILD>PARENT"),
        ("1: Worker-0>aggregator-0", "is not CHILD>PARENT"),
        ("1: worker-0>aggregator-0 worker-0>aggregator-1", "gives 'worker-0' two parents"),
        ("1: worker-0>aggregator-0 worker-0>aggregator-0", "two parents"),
        ("@x 1: worker-0>aggregator-0", "a set is written @0, @1"),
        ("@ 1: worker-0>aggregator-0", "a set is written"),
        ("@-1 1: worker-0>aggregator-0", "a set is written"),
        ("@1", "must start with a weight"),
    ],
)
def test_bad_static_tree_entries_are_refused(entry: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_static_trees(["1: worker-3>server", entry])


@pytest.mark.parametrize(
    ("entries", "found"),
    [
        (["@0 1: worker-0>server", "@2 1: worker-1>server"], r"\[0, 2\]"),
        (["@1 1: worker-0>server"], r"\[1\]"),
        (["1: worker-0>server", "@2 1: worker-1>server"], r"\[0, 2\]"),
    ],
)
def test_tree_sets_must_be_numbered_without_gaps(entries: list[str], found: str) -> None:
    with pytest.raises(ValueError, match=f"without gaps, got {found}"):
        parse_static_trees(entries)


# ------------------------------------------------------------------------------------------ check_trees
WORKERS = [W0, W1, W2, W3]
AGGREGATORS = [A0, A1, A2]
#: three levels: aggregator-2 -> aggregator-1 -> aggregator-0 -> the servers
CHAIN = {W0: A2, W1: A2, A2: A1, W2: A1, A1: A0, W3: A0}


@pytest.mark.parametrize(
    "trees",
    [
        [Route(1.0, CHAIN)],
        [Route(1.0, {})],
        [Route(0.5, {W0: A0, W1: A0}), Route(0.5, {W2: A1, A1: A0})],
        [Route(0.1, {}), Route(0.2, {W0: A1}), Route(0.7, {W1: SERVERS, A2: SERVERS})],
        [Route(1 / MAX_TREES, {})] * MAX_TREES,
    ],
)
def test_good_trees_pass(trees: list[Route]) -> None:
    check_trees(trees, WORKERS, AGGREGATORS)


@pytest.mark.parametrize(
    ("trees", "problem"),
    [
        ([], "an epoch needs 1..64 trees, got 0"),
        ([Route(1 / 65, {})] * 65, "an epoch needs 1..64 trees, got 65"),
        ([Route(0.5, {}), Route(0.4, {})], "positive and sum to 1"),
        ([Route(1.0, {}), Route(0.0, {})], "positive and sum to 1"),
        ([Route(1.5, {}), Route(-0.5, {})], "positive and sum to 1"),
        ([Route(float("nan"), {})], "positive and sum to 1"),
        ([Route(1.0 + 1e-5, {})], "positive and sum to 1"),
        ([Route(1.0, {"worker-7": A0})], "tree 0 names 'worker-7': neither a worker nor an aggregator"),
        ([Route(1.0, {"server-0": A0})], "neither a worker nor an aggregator"),
        ([Route(0.5, {}), Route(0.5, {"aggregator-9": SERVERS})], "tree 1 names 'aggregator-9'"),
        ([Route(1.0, {W0: W1})], "gives 'worker-0' the parent 'worker-1': a parent must be an aggregator"),
        ([Route(1.0, {W0: "aggregator-9"})], "a parent must be an aggregator"),
        ([Route(1.0, {W0: "server-0"})], "a parent must be an aggregator"),
        ([Route(1.0, {A0: A1})], "gives 'aggregator-0' the parent 'aggregator-1': an aggregator's parent aggregator "
                                 "must have a lower rank"),
        ([Route(1.0, {A1: A1})], "must have a lower rank"),
        ([Route(1.0, {A1: A0, A2: A1, A0: A2})], "must have a lower rank"),
        ([Route(0.5, CHAIN), Route(0.5, {**CHAIN, A1: A2, A2: A0})], "tree 1 gives 'aggregator-1' the parent "
                                                                     "'aggregator-2'"),
    ],
)
def test_bad_trees_are_refused(trees: list[Route], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        check_trees(trees, WORKERS, AGGREGATORS)


@pytest.mark.parametrize(
    "cycle",
    [{A1: A2, A2: A1}, {A0: A1, A1: A2, A2: A0}, {A0: A0}, {W0: A1, A1: A2, A2: A1}],
)
def test_cycles_are_refused(cycle: dict[str, str]) -> None:
    """Every cycle runs through an aggregator whose parent has a higher or equal rank, so the rank rule finds it."""
    with pytest.raises(ValueError, match=r"lower rank|cycle"):
        check_trees([Route(1.0, cycle)], WORKERS, AGGREGATORS)


# ------------------------------------------------------------------------------------------ subtree_ranks
#: three levels: workers 0, 1 -> aggregator-1, workers 2, 3 -> aggregator-2, both and worker 4 -> aggregator-0
THREE_LEVELS = Route(1.0, {W0: A1, W1: A1, W2: A2, W3: A2, A1: A0, A2: A0, "worker-4": A0, A0: SERVERS})
RANKS = {f"worker-{i}": i for i in range(6)}
REVERSED = {f"worker-{i}": 5 - i for i in range(6)}


@pytest.mark.parametrize(
    ("node", "ranks", "below"),
    [
        (A0, RANKS, (0, 1, 2, 3, 4)),
        (A1, RANKS, (0, 1)),
        (A2, RANKS, (2, 3)),
        (W0, RANKS, (0,)),
        ("worker-4", RANKS, (4,)),
        ("worker-5", RANKS, (5,)),  # not in the tree: sends straight to the servers, itself only
        ("aggregator-3", RANKS, ()),
        (A0, REVERSED, (1, 2, 3, 4, 5)),
        (A1, REVERSED, (4, 5)),
        (A2, REVERSED, (2, 3)),
        (A1, {W0: 0}, (0,)),  # a worker the job does not know is not counted
    ],
)
def test_subtree_ranks_of_a_three_level_tree(node: str, ranks: dict[str, int], below: tuple[int, ...]) -> None:
    assert subtree_ranks(THREE_LEVELS, node, ranks) == below


# ------------------------------------------------------------------------------------------ assign_chunks
def equal(count: int, nbytes: int = 100, key: int = 0) -> list[tuple[int, int, int]]:
    return [(key, chunk, nbytes) for chunk in range(count)]


@pytest.mark.parametrize(
    ("weights", "chunks", "trees"),
    [
        ([0.5, 0.5], equal(4), [0, 1, 0, 1]),
        ([0.75, 0.25], equal(8), [0, 0, 1, 0, 0, 0, 1, 0]),
        ([0.25, 0.75], equal(4), [1, 0, 1, 1]),
        ([0.5, 0.25, 0.25], equal(4), [0, 1, 2, 0]),
        ([1.0], equal(3), [0, 0, 0]),
        ([0.5, 0.5], [(0, 0, 300), (1, 0, 100), (2, 0, 100), (3, 0, 100)], [0, 1, 1, 1]),
        ([0.5, 0.5], [(0, 0, 100), (0, 1, 100), (1, 0, 100), (2, 0, 100), (2, 1, 100)], [0, 1, 0, 1, 0]),
        ([0.5, 0.5], [], []),
    ],
)
def test_chunks_go_to_trees_by_weight(weights: list[float], chunks: list[tuple[int, int, int]],
                                      trees: list[int]) -> None:
    assert assign_chunks(chunks, weights) == {(key, chunk): tree for (key, chunk, _), tree in zip(chunks, trees,
                                                                                                   strict=True)}


#: chunks of several tensors, of uneven sizes, as the planner may cut them
MIXED = [(key, chunk, (key * 7919 + chunk * 104729) % 1000 + 1) for key in range(12) for chunk in range(key % 4 + 1)]


@pytest.mark.parametrize("weights", [[0.5, 0.5], [0.6, 0.3, 0.1], [0.1, 0.2, 0.3, 0.4]])
def test_a_chunks_tree_depends_only_on_the_chunks_before_it(weights: list[float]) -> None:
    full = assign_chunks(MIXED, weights)
    for end in range(len(MIXED) + 1):
        assert assign_chunks(MIXED[:end], weights) == {(k, c): full[(k, c)] for k, c, _ in MIXED[:end]}
    for split in range(len(MIXED) + 1):
        assignment = ChunkAssignment(weights)
        assignment.extend(MIXED[:split])
        assert len(assignment) == split
        assignment.extend(iter(MIXED[split:]))  # any iterable
        assert assignment.trees == full and len(assignment) == len(MIXED)
    given = [sum(n for k, c, n in MIXED if full[(k, c)] == t) for t in range(len(weights))]
    total = sum(n for _, _, n in MIXED)
    assert all(abs(g - w * total) <= 1000 for g, w in zip(given, weights, strict=True))  # within one chunk's size


# ------------------------------------------------------------------------------------------ parse_routing
ROUTING = Routing(3, (Route(0.25, {W1: A0, W0: A0, A1: A0}), Route(0.75, {W2: A1, W3: SERVERS})))


def test_routing_round_trips_through_the_wire_form() -> None:
    raw = ROUTING.encode()
    assert raw == [3, [[0.25, [[A1, A0], [W0, A0], [W1, A0]]], [0.75, [[W2, A1], [W3, SERVERS]]]]]
    assert parse_routing(msgpack.unpackb(msgpack.packb(raw))) == ROUTING
    assert parse_routing([1, [[1.0, []]]]) == Routing(1, (Route(1.0, {}),))
    long_name = "w" * 64
    assert parse_routing([(1 << 31) - 1, [[1.0, [[long_name, SERVERS]]]]]).trees[0].parents == {long_name: SERVERS}


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        (None, r"routes must be \[epoch, trees\]"),
        ("routes", "routes must be"),
        ([], "routes must be"),
        ([1], "routes must be"),
        ([1, [], 3], "routes must be"),
        ([True, [[1.0, []]]], "routes must be"),
        (["1", [[1.0, []]]], "routes must be"),
        ([1.0, [[1.0, []]]], "routes must be"),
        ([1, "trees"], "routes must be"),
        ([1, {"weight": 1.0}], "routes must be"),
        ([0, [[1.0, []]]], r"epoch in \[1, 2\*\*31\)"),
        ([-1, [[1.0, []]]], "epoch in"),
        ([1 << 31, [[1.0, []]]], "epoch in"),
        ([1, []], "1..64 trees"),
        ([1, [[1 / 65, []]] * 65], "1..64 trees"),
        ([1, ["tree"]], r"a tree must be \[weight, \[\[child, parent\], ...\]\]"),
        ([1, [[1.0]]], "a tree must be"),
        ([1, [[1.0, [], 0]]], "a tree must be"),
        ([1, [[1, []]]], "a tree must be"),  # an int weight
        ([1, [["1.0", []]]], "a tree must be"),
        ([1, [[None, []]]], "a tree must be"),
        ([1, [[1.0, "edges"]]], "a tree must be"),
        ([1, [[1.0, {W0: A0}]]], "a tree must be"),
        ([1, [[1.0, [[W0, A0]] * (MAX_EDGES + 1)]]], "a tree must be"),
        ([1, [[0.0, []]]], r"weight must be in \(0, 1\]"),
        ([1, [[-0.5, []], [1.5, []]]], r"weight must be in \(0, 1\]"),
        ([1, [[float("nan"), []]]], "weight must be in"),
        ([1, [[float("inf"), []]]], "weight must be in"),
        ([1, [[0.5, []]]], "tree weights must sum to 1, got 0.5"),
        ([1, [[0.5, []], [0.6, []]]], "must sum to 1"),
        ([1, [[1.0, [W0]]]], r"a tree edge must be \[child, parent\] names"),
        ([1, [[1.0, [[W0]]]]], "a tree edge must be"),
        ([1, [[1.0, [[W0, A0, A1]]]]], "a tree edge must be"),
        ([1, [[1.0, [[W0, 0]]]]], "a tree edge must be"),
        ([1, [[1.0, [[None, A0]]]]], "a tree edge must be"),
        ([1, [[1.0, [[b"worker-0", A0]]]]], "a tree edge must be"),
        ([1, [[1.0, [["w" * 65, SERVERS]]]]], "a tree edge must be"),
    ],
)
def test_hostile_routes_are_refused(raw: Any, problem: str) -> None:
    with pytest.raises(WireError, match=problem) as caught:
        parse_routing(raw)
    assert len(str(caught.value)) < 300


def test_the_tree_limit_is_the_wire_forms() -> None:
    assert len(parse_routing([1, [[1 / MAX_TREES, []]] * MAX_TREES]).trees) == MAX_TREES


# ------------------------------------------------------------------------------------------ RouteSwitch
TREES = (Route(1.0, {W0: A0, W1: A0}),)
TREES2 = (Route(0.5, {W0: A0}), Route(0.5, {W1: A0}))
TREES3 = (Route(1.0, {W1: A1}),)


def sent(out: list[tuple[str, Message]]) -> list[tuple[str, str, Any]]:
    assert all(m.sender == 0 for _, m in out)
    return [(to, m.kind.name, m.meta) for to, m in out]


def routes(epoch: int, trees: tuple[Route, ...]) -> dict[str, Any]:
    return {"routes": Routing(epoch, trees).encode()}


def test_a_switch_goes_aggregators_then_workers_then_commit() -> None:
    switch = RouteSwitch()
    assert switch.propose(TREES) == [] and not switch.switching  # before the job formed: queued
    out = switch.start([W0, W1], [A0, A1])
    assert sent(out) == [(A0, "ROUTES", routes(1, TREES)), (A1, "ROUTES", routes(1, TREES))]
    assert out[0][1].meta == {"routes": [1, [[1.0, [[W0, A0], [W1, A0]]]]]}
    assert switch.switching and switch.epoch == 1 and switch.current is None
    assert switch.on_ack(A1, "aggregator", 1, []) == []
    out = switch.on_ack(A0, "aggregator", 1, [])
    assert sent(out) == [(W0, "ROUTES", routes(1, TREES)), (W1, "ROUTES", routes(1, TREES))]
    assert switch.on_ack(W1, "worker", 1, [(7, 4), (9, 0)]) == []
    out = switch.on_ack(W0, "worker", 1, [(7, 3), (8, 12)])
    assert sent(out) == [(name, "COMMIT", {"epoch": 1, "rounds": [[7, 5], [8, 13], [9, 1]]}) for name in (W0, W1)]
    assert switch.current == Routing(1, TREES) and not switch.switching


def test_without_aggregators_the_switch_goes_straight_to_the_workers() -> None:
    switch = RouteSwitch()
    switch.start([W0, W1], [])
    out = switch.propose(TREES)
    assert sent(out) == [(W0, "ROUTES", routes(1, TREES)), (W1, "ROUTES", routes(1, TREES))]
    switch.on_ack(W0, "worker", 1, [])
    assert sent(switch.on_ack(W1, "worker", 1, [])) == [(n, "COMMIT", {"epoch": 1, "rounds": []}) for n in (W0, W1)]


def test_with_no_members_the_switch_commits_at_once() -> None:
    switch = RouteSwitch()
    switch.propose(TREES)
    assert switch.start([], []) == [] and switch.current == Routing(1, TREES) and not switch.switching


def test_nothing_proposed_nothing_sent() -> None:
    switch = RouteSwitch()
    assert switch.start([W0], [A0]) == [] and switch.epoch == 0 and not switch.switching


def test_the_latest_proposal_before_start_wins() -> None:
    switch = RouteSwitch()
    switch.propose(TREES)
    switch.propose(TREES2)
    assert sent(switch.start([W0], [A0])) == [(A0, "ROUTES", routes(1, TREES2))]


def test_a_worker_that_leaves_is_no_longer_awaited() -> None:
    switch = RouteSwitch()
    switch.start([W0, W1, W2], [A0])
    switch.propose(TREES)
    assert switch.gone(W2) == []  # during the aggregators' phase: it will not even be asked
    out = switch.on_ack(A0, "aggregator", 1, [])
    assert [to for to, _ in out] == [W0, W1]
    assert switch.on_ack(W0, "worker", 1, [(7, 2)]) == []
    out = switch.gone(W1)  # the last one awaited: commit now, to those still here
    assert sent(out) == [(W0, "COMMIT", {"epoch": 1, "rounds": [[7, 3]]})]
    assert switch.gone(W0) == [] and switch.gone("worker-9") == []  # no switch open


def test_every_worker_gone_commits_at_once() -> None:
    switch = RouteSwitch()
    switch.start([W0, W1], [A0])
    switch.gone(W0)
    switch.gone(W1)
    switch.propose(TREES)
    assert switch.on_ack(A0, "aggregator", 1, []) == [] and switch.current == Routing(1, TREES)


def test_a_proposal_during_a_switch_starts_right_after_its_commit() -> None:
    switch = RouteSwitch()
    switch.start([W0, W1], [A0])
    switch.propose(TREES)
    assert switch.propose(TREES2) == [] and switch.propose(TREES3) == []  # queued: TREES3 replaced TREES2
    switch.on_ack(A0, "aggregator", 1, [])
    switch.on_ack(W0, "worker", 1, [(7, 1)])
    out = switch.on_ack(W1, "worker", 1, [(7, 1)])
    commit = {"epoch": 1, "rounds": [[7, 2]]}
    assert sent(out) == [(W0, "COMMIT", commit), (W1, "COMMIT", commit), (A0, "ROUTES", routes(2, TREES3))]
    assert switch.current == Routing(1, TREES) and switch.switching and switch.epoch == 2
    with pytest.raises(WireError, match="epoch 1"):
        switch.on_ack(A0, "aggregator", 1, [])
    switch.on_ack(A0, "aggregator", 2, [])
    switch.on_ack(W0, "worker", 2, [])
    out = switch.on_ack(W1, "worker", 2, [(7, 6)])
    assert sent(out) == [(n, "COMMIT", {"epoch": 2, "rounds": [[7, 7]]}) for n in (W0, W1)]
    assert switch.current == Routing(2, TREES3)


@pytest.mark.parametrize(
    ("name", "role", "epoch", "problem"),
    [
        (A0, "aggregator", 2, "ROUTES_ACK for epoch 2 from aggregator-0, which is not being switched to"),
        (A0, "aggregator", 0, "not being switched to"),
        (A1, "aggregator", 1, "unexpected ROUTES_ACK for epoch 1 from aggregator-1"),  # acked already
        (W0, "worker", 1, "unexpected ROUTES_ACK"),  # the aggregators have not all answered
        (A0, "worker", 1, "unexpected ROUTES_ACK"),
        ("aggregator-7", "aggregator", 1, "unexpected ROUTES_ACK"),
        ("worker-7", "worker", 1, "unexpected ROUTES_ACK"),
        (A0, "server", 1, "unexpected ROUTES_ACK"),
    ],
)
def test_unexpected_acks_are_refused_and_change_nothing(name: str, role: str, epoch: int, problem: str) -> None:
    switch = RouteSwitch()
    switch.start([W0, W1], [A0, A1])
    switch.propose(TREES)
    switch.on_ack(A1, "aggregator", 1, [])
    before = copy.deepcopy(switch)
    with pytest.raises(WireError, match=problem):
        switch.on_ack(name, role, epoch, [(7, 1)])
    assert switch == before


@pytest.mark.parametrize(
    ("name", "role"), [(W0, "worker"), (A0, "aggregator"), (W1, "aggregator")],
)
def test_acks_in_the_workers_phase_that_are_not_awaited_are_refused(name: str, role: str) -> None:
    switch = RouteSwitch()
    switch.start([W0, W1], [A0])
    switch.propose(TREES)
    switch.on_ack(A0, "aggregator", 1, [])
    switch.on_ack(W0, "worker", 1, [(7, 1)])
    before = copy.deepcopy(switch)
    with pytest.raises(WireError, match="unexpected ROUTES_ACK"):
        switch.on_ack(name, role, 1, [(7, 9)])
    assert switch == before


def test_an_ack_with_no_switch_is_refused() -> None:
    switch = RouteSwitch()
    with pytest.raises(WireError, match="not being switched to"):
        switch.on_ack(W0, "worker", 1, [])
    switch.start([W0], [])
    with pytest.raises(WireError, match="not being switched to"):
        switch.on_ack(W0, "worker", 0, [])


@pytest.mark.parametrize(
    ("raw", "rounds"),
    [
        ([], []),
        ([[7, 3]], [(7, 3)]),
        ([[0, 0], [(1 << 31) - 1, (1 << 62) - 1]], [(0, 0), ((1 << 31) - 1, (1 << 62) - 1)]),
    ],
)
def test_ack_rounds_parse(raw: Any, rounds: list[tuple[int, int]]) -> None:
    assert parse_rounds(raw) == rounds


@pytest.mark.parametrize(
    "raw",
    [None, "rounds", {"7": 3}, [7, 3], [[7]], [[7, 3, 1]], [[7, "3"]], [[True, 3]], [[7, 3.0]], [[-1, 3]],
     [[7, -1]], [[1 << 31, 0]], [[0, 1 << 62]], [(7, 3)], [[0, 0]] * (MAX_ACK_KEYS + 1)],
)
def test_hostile_ack_rounds_are_refused(raw: Any) -> None:
    with pytest.raises(WireError, match="round") as caught:
        parse_rounds(raw)
    assert len(str(caught.value)) < 300


# ------------------------------------------------------------------------------------------ Router
#: worker-1 sends to aggregator-0 in tree 0 and to aggregator-1 in tree 1; worker-0 to the servers in tree 1
EPOCH1 = Routing(1, (Route(0.5, {W0: A0, W1: A0}), Route(0.5, {W1: A1})))
EPOCH2 = Routing(2, (Route(1.0, {W0: A1, W1: A1}),))
AGG = {A0, A1}
CHUNKS = [(7, 0, 100), (7, 1, 100), (8, 0, 100), (8, 1, 100)]  # trees 0, 1, 0, 1 with weights 0.5, 0.5


def committed(name: str = W0, rounds: list[tuple[int, int]] | None = None) -> Router:
    router = Router(name)
    router.declare(CHUNKS)
    router.begin(EPOCH1, AGG)
    router.commit(1, rounds if rounds is not None else [(7, 5)])
    return router


def test_before_any_commit_every_push_goes_to_the_servers() -> None:
    router = Router(W0)
    router.declare(CHUNKS)
    assert router.epoch == 0 and not router.holding
    assert [router.route(7, c, r) for c in (0, 1) for r in (0, 1, 9)] == [None] * 6
    router.begin(EPOCH1, AGG)
    assert router.holding and router.epoch == 0 and router.route(7, 0, 9) is None  # nothing committed yet
    assert router.routed == 0


def test_the_switch_round_of_each_key_decides_the_tree() -> None:
    router = Router(W0)
    router.declare(CHUNKS)
    router.begin(EPOCH1, AGG)
    assert router.commit(1, [(7, 5)]) == [A0]  # worker-0's parents to connect to
    assert router.epoch == 1 and not router.holding
    table = [
        ((7, 0, 4), None),  # below the switch round: no earlier epoch, the servers
        ((7, 0, 5), (1, 0, A0)),
        ((7, 0, 6), (1, 0, A0)),
        ((7, 1, 5), None),  # tree 1: worker-0 sends to the servers
        ((8, 0, 0), (1, 0, A0)),  # key 8 not listed: switched at once
        ((8, 1, 0), None),
    ]
    assert [router.route(*at) for at, _ in table] == [want for _, want in table]
    assert router.routed == 3
    router.begin(EPOCH2, AGG)
    assert router.route(8, 0, 1) == (1, 0, A0)  # still epoch 1 until COMMIT
    assert router.commit(2, [(7, 9), (8, 3)]) == [A1]
    table = [
        ((7, 0, 4), None),
        ((7, 0, 8), (1, 0, A0)),  # below epoch 2's switch round: epoch 1
        ((7, 1, 8), None),
        ((7, 0, 9), (2, 0, A1)),
        ((7, 1, 9), (2, 0, A1)),
        ((8, 0, 2), (1, 0, A0)),
        ((8, 1, 2), None),
        ((8, 0, 3), (2, 0, A1)),
        ((8, 1, 3), (2, 0, A1)),
    ]
    assert [router.route(*at) for at, _ in table] == [want for _, want in table]


def test_a_parent_per_tree_for_a_worker_in_both() -> None:
    router = committed(W1, [])
    assert [router.route(k, c, 1) for k, c, _ in CHUNKS] == [(1, 0, A0), (1, 1, A1), (1, 0, A0), (1, 1, A1)]
    assert router.routed == 4


def test_chunks_declared_after_the_commit_are_assigned_as_if_declared_at_once() -> None:
    router = committed(W1, [])
    later = [(9, 1, 50), (9, 0, 300), (10, 0, 10)]  # any order in one declaration
    last = [(11, c, 40 + c) for c in range(5)]
    router.declare(later)
    assert router.route(9, 0, 1) is not None  # extends the assignment up to the newest chunks
    router.declare(last)
    full = assign_chunks(CHUNKS + sorted(later) + last, [0.5, 0.5])
    parents = {0: A0, 1: A1}
    for (key, chunk), tree in full.items():
        assert router.route(key, chunk, 1) == (1, tree, parents[tree]), (key, chunk)
    # a new epoch's assignment covers every chunk declared so far
    router.begin(Routing(2, (Route(0.25, {W1: A0}), Route(0.75, {W1: A1}))), AGG)
    router.commit(2, [])
    full = assign_chunks(CHUNKS + sorted(later) + last, [0.25, 0.75])
    assert {at: router.route(*at, 1) for at in full} == {at: (2, tree, parents[tree]) for at, tree in full.items()}


def test_begin_twice_without_commit_is_refused_unless_the_same_trees_come_again() -> None:
    router = Router(W0)
    router.begin(EPOCH1, AGG)
    with pytest.raises(WireError, match="another switch is open"):
        router.begin(EPOCH2, AGG)
    assert router.pending == EPOCH1
    router.begin(EPOCH1, AGG)  # a standby scheduler finishing the switch: answered again
    assert router.pending == EPOCH1 and router.commit(1, []) == sorted({t.parent(W0) for t in EPOCH1.trees} - {SERVERS})


@pytest.mark.parametrize("epoch", [0, 1])
def test_an_epoch_not_newer_is_refused(epoch: int) -> None:
    router = committed()
    with pytest.raises(WireError, match=f"ROUTES for epoch {epoch}"):
        router.begin(Routing(epoch, EPOCH1.trees), AGG)
    assert router.pending is None and router.epoch == 1


@pytest.mark.parametrize(("pending", "epoch"), [(None, 1), (EPOCH2, 1), (EPOCH2, 3)])
def test_a_commit_of_another_epoch_is_refused(pending: Routing | None, epoch: int) -> None:
    router = committed()
    if pending is not None:
        router.begin(pending, AGG)
    with pytest.raises(WireError, match=f"COMMIT for epoch {epoch}, which was not announced"):
        router.commit(epoch, [])
    assert router.pending == pending and router.epoch == 1


@pytest.mark.parametrize(
    ("trees", "stranger"),
    [
        ((Route(1.0, {W0: "aggregator-5"}),), "aggregator-5"),
        ((Route(0.5, {W0: A0}), Route(0.5, {W0: W1})), W1),
        ((Route(1.0, {W0: "server-0"}),), "server-0"),
    ],
)
def test_a_parent_that_is_not_an_aggregator_is_refused(trees: tuple[Route, ...], stranger: str) -> None:
    router = committed()
    with pytest.raises(WireError, match=f"the parent '{stranger}': not an aggregator"):
        router.begin(Routing(2, trees), AGG)
    assert router.pending is None and not router.holding


def test_a_tree_that_does_not_name_the_worker_sends_it_to_the_servers() -> None:
    router = committed(W2, [])
    assert [router.route(k, c, 1) for k, c, _ in CHUNKS] == [None] * 4 and router.routed == 0


def test_rounds_of_many_switches_keep_their_epochs() -> None:
    """Switch rounds 3, 6, 9, 12 of key 7: each round keeps the epoch it started in, while kept."""
    router = Router(W0)
    router.declare(CHUNKS)
    for epoch, switch_round in zip(itertools.count(1), (3, 6, 9, 12), strict=False):
        router.begin(Routing(epoch, (Route(1.0, {W0: A0 if epoch % 2 else A1}),)), AGG)
        router.commit(epoch, [(7, switch_round)])
    got = [router.route(7, 0, r) for r in range(15)]
    assert got == [None] * 3 + [(1, 0, A0)] * 3 + [(2, 0, A1)] * 3 + [(3, 0, A0)] * 3 + [(4, 0, A1)] * 3


def on_servers(servers: list[int], nbytes: int = 100) -> list[tuple[int, int, int, int]]:
    """One tensor's chunks, chunk i on server servers[i]."""
    return [(0, chunk, nbytes, server) for chunk, server in enumerate(servers)]


@pytest.mark.parametrize(
    ("weights", "servers", "chunks", "trees"),
    [
        # tree 0's half of [0, 1) is server 0's, trees 1 and 2 share server 1's
        ([0.5, 0.25, 0.25], 2, on_servers([0, 1, 0, 1, 0, 1, 0, 1]), [0, 1, 0, 2, 0, 1, 0, 2]),
        # five trees over four servers (the 4:1 testbed's planned trees): each tree on one or two servers
        ([0.2] * 5, 4, on_servers([0, 1, 2, 3] * 2),
         [0, 1, 3, 4, 0, 2, 2, 4]),
        # a tree heavier than a server's share takes its share of each; the others are laid end to end
        ([0.6, 0.2, 0.2], 2, on_servers([0, 1] * 4), [0, 0, 1, 2, 0, 0, 1, 2]),
        # the direct tree of the 2:1 testbed's plan spread, each aggregating tree on one server
        ([0.556] + [0.111] * 4, 4, on_servers([0, 1, 2, 3] * 2), [0, 0, 0, 0, 1, 2, 3, 4]),
        # one server: every tree by weight, as without servers
        ([0.5, 0.5], 1, on_servers([0, 0, 0, 0]), [0, 1, 0, 1]),
        # chunks without a server (a 3-tuple) all count as server 0's
        ([0.5, 0.5], 2, equal(3), [0, 0, 0]),
    ],
)
def test_with_servers_each_tree_takes_the_chunks_of_the_servers_its_weight_covers(
        weights: list[float], servers: int, chunks: list[tuple[int, ...]], trees: list[int]) -> None:
    assert assign_chunks(chunks, weights, servers) == {(c[0], c[1]): t for c, t in zip(chunks, trees, strict=True)}


@pytest.mark.parametrize(("weights", "servers"), [([0.2] * 5, 4), ([0.186] + [0.163] * 5, 4), ([0.6, 0.3, 0.1], 3)])
def test_with_servers_trees_keep_their_weights_and_a_chunks_tree_depends_only_on_those_before(
        weights: list[float], servers: int) -> None:
    chunks = [(k, c, n, (k + c) % servers) for k, c, n in MIXED]
    full = assign_chunks(chunks, weights, servers)
    for split in range(len(chunks) + 1):
        assignment = ChunkAssignment(weights, servers)
        assignment.extend(chunks[:split])
        assignment.extend(chunks[split:])
        assert assignment.trees == full
    # with equal bytes per server (the partitioner balances them), each tree gets its weight's share
    even = [(0, c, 100, c % servers) for c in range(60 * servers)]
    placed = assign_chunks(even, weights, servers)
    for tree, weight in enumerate(weights):
        assert abs(sum(1 for t in placed.values() if t == tree) / len(even) - weight) <= 1.5 * servers / len(even)
    # a tree no heavier than a server's share touches only the servers its stretch of [0, 1) overlaps
    gathered = sum(w for w in weights if w <= 1 / servers)
    for tree, weight in enumerate(weights):
        used = {c % servers for (_, c), t in placed.items() if t == tree}
        assert len(used) == servers if weight > 1 / servers else len(used) <= math.ceil(weight / gathered * servers) + 1


def test_a_push_held_back_names_its_trees_now_and_announced_and_a_moved_one_takes_the_new() -> None:
    router = Router(W1)
    router.declare([(7, 0, 100, 0), (7, 1, 100, 1)])
    assert router.tree_of(7, 0, 5) == (0, -1)  # before the first epoch: no tree
    router.begin(EPOCH1, AGG)
    router.commit(1, [])
    router.begin(EPOCH2, AGG)
    # round 5 runs on epoch 1 (chunk 0 on tree 0, chunk 1 on tree 1); epoch 2 has one tree
    assert [router.tree_of(7, c, 5) for c in (0, 1)] == [(1, 0), (1, 1)]
    assert [router.announced_tree(7, c) for c in (0, 1)] == [0, 0]
    router.commit(2, [(7, 6)])
    assert router.route(7, 1, 5) == (1, 1, A1)  # the round in flight stays on epoch 1...
    assert router.moved_at == {}
    assert router.moved(7, 1) == (2, 0, A1)  # ...but for a push the COMMIT moved
    assert set(router.moved_at) == {2}
    assert [router.server_of(7, c) for c in (0, 1)] == [0, 1]
    assert router.knows(7, 1) and not router.knows(9, 0)  # a process set's tensor: not declared here
    with pytest.raises(ValueError, match="no trees announced"):
        router.announced_tree(7, 0)
