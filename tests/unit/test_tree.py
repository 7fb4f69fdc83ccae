"""The coordinator tree and the ring order: literal tables of shapes, heights and fan-outs, and their invariants."""

from __future__ import annotations

import math
import random

import pytest

from sluice.worker.collective.tree import Tree, build_tree, dials, ring_order

# height of the tree of n = 1..64 ranks on one host: the optimal k-ary heap's
HEIGHTS = {
    2: [0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 5,
        5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 6],
    4: [0, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3,
        3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3],
    8: [0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2,
        2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2],
}
# the largest fan-out for n = 1, 2, 3, 5, 9, 17, 33, 64 ranks
FAN_OUTS = {
    0: [0, 1, 2, 4, 8, 16, 32, 63],
    2: [0, 1, 2, 2, 2, 2, 2, 2],
    4: [0, 1, 2, 4, 4, 4, 4, 4],
    8: [0, 1, 2, 4, 8, 8, 8, 8],
}


def one_host(n: int) -> list[str]:
    return ["h"] * n


def per_host(n: int, ranks_per_host: int) -> list[str]:
    return [f"h{r // ranks_per_host}" for r in range(n)]


def uneven(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    hosts: list[str] = []
    while len(hosts) < n:
        hosts += [f"h{len(set(hosts))}"] * rng.choice([1, 2, 3, 5, 8, 13])
    hosts = hosts[:n]
    if seed % 3 == 0:  # ranks of one host need not be consecutive
        rng.shuffle(hosts)
    return hosts


def fan_out(tree: Tree) -> int:
    return max(map(len, tree.children))


def check(tree: Tree, hosts: list[str], arity: int, racks: list[str] | None = None) -> None:
    """Every rank once, parent and children agree, rank 0 the root, fan-out bounded, hosts (and racks)
    connected, each under its lowest rank."""
    n = len(hosts)
    assert tree.root == 0 and tree.parent[0] is None and len(tree.parent) == len(tree.children) == n
    assert tree.subtree(0) == tuple(range(n))
    for rank in range(1, n):
        parent = tree.parent[rank]
        assert parent is not None and rank in tree.children[parent]
    assert sum(map(len, tree.children)) == n - 1
    assert fan_out(tree) <= (n - 1 if arity == 0 else arity)
    for labels in (hosts, racks) if arity else ():  # flat: no grouping
        if labels is None:
            continue
        outside = [labels[r] if p is None else labels[p] for r, p in enumerate(tree.parent)]  # root: itself
        for label in set(labels):
            members = [r for r in range(n) if labels[r] == label]
            entries = [r for r in members if r == 0 or outside[r] != label]
            assert entries == [min(members)], (label, entries)


@pytest.mark.parametrize("arity", [2, 4, 8])
def test_heights_on_one_host_are_the_heaps(arity: int) -> None:
    heights = [build_tree(one_host(n), arity).height() for n in range(1, 65)]
    assert heights == HEIGHTS[arity]
    assert heights == [math.ceil(math.log(n * (arity - 1) + 1, arity) - 1e-9) - 1 for n in range(1, 65)]


@pytest.mark.parametrize("arity", [0, 2, 4, 8])
def test_fan_outs(arity: int) -> None:
    assert [fan_out(build_tree(one_host(n), arity)) for n in (1, 2, 3, 5, 9, 17, 33, 64)] == FAN_OUTS[arity]


def test_flat_is_one_level_under_rank_0() -> None:
    tree = build_tree(per_host(64, 8), 0)
    assert tree.parent == (None, *[0] * 63) and tree.children[0] == tuple(range(1, 64)) and tree.height() == 1
    assert build_tree(["h"], 0) == Tree((None,), ((),))


def test_literal_shapes() -> None:
    # one host: subtrees are ranges of consecutive ranks
    assert build_tree(one_host(7), 2).parent == (None, 0, 1, 1, 0, 4, 4)
    assert build_tree(one_host(10), 3).parent == (None, 0, 1, 1, 0, 4, 4, 0, 7, 7)
    # hosts of 3, 1, 5, 2 and 4 ranks: one edge enters each host, at its leader
    hosts = ["h0"] * 3 + ["h1"] + ["h2"] * 5 + ["h3"] * 2 + ["h4"] * 4
    tree = build_tree(hosts, 2)
    assert tree.parent == (None, 0, 0, 1, 1, 4, 5, 4, 7, 2, 9, 2, 11, 12, 11) and tree.height() == 4
    # hosts interleaved: a = 0, 2, 6; b = 1, 3, 7; c = 4, 5 (a parent may have the higher rank)
    assert build_tree(["a", "b", "a", "b", "c", "c", "a", "b"], 2).parent == (None, 2, 0, 1, 6, 4, 0, 1)
    # racks x = hosts a, c and y = b, d: each rack one connected subtree
    racks = ["x", "x", "y", "y", "x", "x", "y", "y"]
    assert build_tree(["a", "a", "b", "b", "c", "c", "d", "d"], 2, racks).parent == (None, 0, 0, 2, 1, 4, 2, 6)


def test_eight_hosts_of_eight_ranks() -> None:
    hosts = per_host(64, 8)
    tree = build_tree(hosts, 4)
    assert tree.height() == 4 and fan_out(tree) == 4
    # the upper levels: rank 0 leads hosts 1-3, and hosts 4-7 hang under ranks 1, 8, 16 and 24
    assert tree.children[0] == (1, 8, 16, 24) and [tree.parent[r] for r in (32, 40, 48, 56)] == [1, 8, 16, 24]
    assert sum(hosts[r] != hosts[p] for r, p in enumerate(tree.parent) if p is not None) == 7  # one edge per host
    assert (build_tree(hosts, 2).height(), build_tree(hosts, 8).height()) == (6, 2)


@pytest.mark.parametrize("arity", [0, 2, 4, 8])
@pytest.mark.parametrize("layout", ["one host", "8 per host", "uneven"])
def test_every_size_keeps_the_invariants_and_the_height_bound(arity: int, layout: str) -> None:
    for n in range(1, 65):
        hosts = one_host(n) if layout == "one host" else per_host(n, 8) if layout == "8 per host" else uneven(n, n)
        tree = build_tree(hosts, arity)
        check(tree, hosts, arity)
        if arity == 0:
            assert tree.height() == min(n - 1, 1)
        else:
            assert tree.height() <= math.ceil(math.log(n, arity) - 1e-9) + 1, (n, hosts)
        assert build_tree(hosts, arity) == tree  # deterministic


def test_height_bound_on_many_random_layouts() -> None:
    rng = random.Random(7)
    for trial in range(300):
        n = rng.randint(2, 256)
        hosts = uneven(n, trial)
        for arity in (2, 3, 4, 8):
            tree = build_tree(hosts, arity)
            assert tree.height() <= math.ceil(math.log(n, arity) - 1e-9) + 1, (n, arity, hosts)
            assert fan_out(tree) <= arity


def test_racks_keep_racks_and_hosts_together() -> None:
    hosts = per_host(48, 4)
    racks = [f"r{r // 16}" for r in range(48)]
    for arity in (2, 4, 8):
        tree = build_tree(hosts, arity, racks)
        check(tree, hosts, arity, racks)
        assert tree.height() <= math.ceil(math.log(48, arity)) + 2


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="arity"):
        build_tree(one_host(4), 1)
    with pytest.raises(ValueError, match="at least one rank"):
        build_tree([], 2)
    with pytest.raises(ValueError, match="two racks"):
        build_tree(["a", "a"], 2, ["x", "y"])
    with pytest.raises(ValueError, match="racks names 1 ranks"):
        ring_order(["a", "a"], ["x"])


def test_subtree_and_neighbours() -> None:
    tree = build_tree(one_host(7), 2)
    assert tree.subtree(1) == (1, 2, 3) and tree.subtree(0) == tuple(range(7)) and tree.subtree(6) == (6,)
    assert tree.neighbours(0) == (1, 4) and tree.neighbours(4) == (0, 5, 6) and tree.neighbours(3) == (1,)


def test_ring_order_keeps_hosts_and_racks_contiguous() -> None:
    assert ring_order(["a", "b", "a", "b"]) == (0, 2, 1, 3)
    assert ring_order(["b", "a", "a", "c", "b"]) == (0, 4, 1, 2, 3)
    assert ring_order(["a", "b", "c", "d"], ["x", "y", "x", "y"]) == (0, 2, 1, 3)
    for seed in range(20):
        hosts = uneven(40, seed)
        order = ring_order(hosts)
        assert order[0] == 0 and sorted(order) == list(range(40))
        crossings = sum(hosts[a] != hosts[b] for a, b in zip(order, order[1:] + order[:1], strict=True))
        assert crossings == (len(set(hosts)) if len(set(hosts)) > 1 else 0)


def test_the_higher_rank_dials() -> None:
    assert dials(5, 2) and not dials(2, 5)
    tree = build_tree(["a", "b", "a", "b", "c", "c", "a", "b"], 2)
    edges = {(r, p) for r, p in enumerate(tree.parent) if p is not None}
    assert all(dials(a, b) != dials(b, a) for a, b in edges)  # every edge dialled from exactly one side
