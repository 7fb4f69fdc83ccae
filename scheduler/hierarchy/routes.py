"""Aggregation trees between nodes: their wire form, checks, subtrees, and which chunk takes which tree.

A routing epoch is a list of trees. Tree t carries the share `weight` of every tensor's bytes and
says, for each node, its parent: an aggregator's name, or SERVERS (the server that owns the chunk).
A node a tree does not name sends straight to the servers. Workers pick a tree per chunk with
`assign_chunks`, a pure function of the declared chunks and the weights, so every worker picks the
same without being told; each push to an aggregator names its (epoch, tree), so an aggregator needs
only the trees, not the assignment.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from sluice.transport.wire import WireError, brief

SERVERS = "server"
#: trees in one epoch and nodes named by one tree (the wire form must fit a control header)
MAX_TREES = 64
MAX_EDGES = 1 << 14
#: routing epochs a node keeps at most: it keeps every epoch whose rounds may still be in flight (`keep_from`,
#: scheduler/hierarchy/switch.py), and never more than this, a bound on memory far past a job's need
MAX_EPOCHS = 64
_NAME = re.compile(r"(worker|aggregator)-\d{1,6}")


@dataclass(frozen=True)
class Route:
    """One aggregation tree: its share of every tensor's bytes and each node's parent in it."""

    weight: float
    parents: Mapping[str, str]

    def parent(self, node: str) -> str:
        return self.parents.get(node, SERVERS)

    def children(self, node: str) -> list[str]:
        return sorted(child for child, parent in self.parents.items() if parent == node)


@dataclass(frozen=True)
class Routing:
    """The trees of one routing epoch (epoch 0: no trees, everyone straight to the servers)."""

    epoch: int
    trees: tuple[Route, ...]

    def encode(self) -> list[object]:
        return [self.epoch, [[t.weight, sorted([c, p] for c, p in t.parents.items())] for t in self.trees]]


FLAT = Routing(0, ())


def stale_epochs(epochs: Iterable[int], keep_from: int) -> list[int]:
    """The epochs to forget: those older than `keep_from` (no round of them is in flight), and those past the
    newest MAX_EPOCHS."""
    ordered = sorted(epochs)
    return [e for index, e in enumerate(ordered) if e < keep_from or index < len(ordered) - MAX_EPOCHS]


def epoch_field(meta: Mapping[str, object] | None, name: str) -> int:
    """An optional routing epoch in a control message's meta (0 when absent), checked (WireError): a ROUTES' or
    COMMIT's `keep_from` (the oldest epoch whose rounds may be in flight; 0: keep every epoch), a ROUTES_ACK's
    `oldest`."""
    raw = (meta or {}).get(name, 0)
    if type(raw) is not int or not 0 <= raw < 1 << 31:
        raise WireError(f"{name} must be a routing epoch, got {brief(raw)}")
    return raw


def check_trees(trees: Sequence[Route], workers: Iterable[str], aggregators: Iterable[str]) -> None:
    """Raise ValueError unless every tree joins known workers and aggregators without a cycle."""
    known_workers, known_aggregators = set(workers), set(aggregators)
    if not trees or len(trees) > MAX_TREES:
        raise ValueError(f"an epoch needs 1..{MAX_TREES} trees, got {len(trees)}")
    if abs(sum(t.weight for t in trees) - 1.0) > 1e-6 or any(not t.weight > 0 for t in trees):
        raise ValueError(f"tree weights must be positive and sum to 1, got {[t.weight for t in trees]}")
    for index, tree in enumerate(trees):
        for child, parent in tree.parents.items():
            if child not in known_workers | known_aggregators:
                raise ValueError(f"tree {index} names {child!r}: neither a worker nor an aggregator of this job")
            if parent != SERVERS and parent not in known_aggregators:
                raise ValueError(f"tree {index} gives {child!r} the parent {parent!r}: a parent must be an "
                                 f"aggregator of this job or {SERVERS!r}")
            if child in known_aggregators and parent != SERVERS and _rank(parent) >= _rank(child):
                # the child dials its parent, and a pair of nodes is dialled one way only (transport): with
                # lower-ranked parents the way is the same in every epoch
                raise ValueError(f"tree {index} gives {child!r} the parent {parent!r}: an aggregator's parent "
                                 "aggregator must have a lower rank")
        if has_cycle(tree):
            raise ValueError(f"tree {index} has a cycle")


def _rank(name: str) -> int:
    return int(name.rpartition("-")[2])


def has_cycle(tree: Route) -> bool:
    """Whether following parents from some node of `tree` comes back to a node already passed."""
    for start in tree.parents:
        seen, node = {start}, tree.parent(start)
        while node != SERVERS:
            if node in seen:
                return True
            seen.add(node)
            node = tree.parent(node)
    return False


def subtree_ranks(tree: Route, node: str, worker_ranks: Mapping[str, int]) -> tuple[int, ...]:
    """The ranks of the workers whose pushes reach `node` in `tree` (itself included), sorted; each
    node is visited once, so even a tree with a cycle ends."""
    below: dict[str, list[str]] = {}
    for child, parent in tree.parents.items():
        below.setdefault(parent, []).append(child)
    ranks, stack, seen = [], [node], {node}
    while stack:
        current = stack.pop()
        if current in worker_ranks:
            ranks.append(worker_ranks[current])
        for child in below.get(current, ()):
            if child not in seen:
                seen.add(child)
                stack.append(child)
    return tuple(sorted(ranks))


class ChunkAssignment:
    """(key, chunk) -> tree index for chunks given as (key, chunk, nbytes[, server]) in a fixed order, extendable.

    Each chunk goes to the tree furthest below its share of the bytes so far, so every tensor with
    several chunks is split across the trees by weight, and the carry from one tensor to the next
    keeps the total on the weights too when tensors are single chunks. Ties go to the lower index.
    With `servers` (the job's server count, chunks naming their server), each tree sends to as few
    servers as its weight allows: the trees' weights and the servers' equal shares are laid end to end
    on [0, 1), and a chunk of server s goes only to the trees whose part overlaps s's, by the same rule
    within s. Fewer streams then share each rack uplink, so its queue (a chunk in flight per stream)
    is shorter and the trees' pipelines fill sooner (docs/aggregation.md). A tree heavier than one
    server's share takes its share of every server instead: laid end to end it would bring every
    worker's stream of it onto two or three servers' links (measured slower). A chunk's tree depends
    only on the chunks before it, so extending the list as tensors are declared gives every worker the
    same assignment whenever it computes it.
    """

    def __init__(self, weights: Sequence[float], servers: int = 0) -> None:
        self.weights = list(weights)
        self.servers = servers
        self.trees: dict[tuple[int, int], int] = {}
        #: per server (one pool without `servers`): each tree's share of its bytes, its bytes so far, and
        #: each tree's part of them
        pools = max(servers, 1)
        total = sum(self.weights) or 1.0
        spread = [w / total > 1 / servers for w in self.weights] if servers else []
        self._shares = [_shares(self.weights, spread, s, servers) for s in range(pools)] if servers else [self.weights]
        self._given = [[0.0] * len(self.weights) for _ in range(pools)]
        self._total = [0.0] * pools

    def __len__(self) -> int:
        return len(self.trees)

    def extend(self, chunks: Iterable[tuple[int, ...]]) -> None:
        for key, chunk, nbytes, *server in chunks:
            pool = server[0] % self.servers if self.servers and server else 0
            shares, given = self._shares[pool], self._given[pool]
            self._total[pool] += nbytes
            total = self._total[pool]
            tree = max((t for t in range(len(shares)) if shares[t] > 0),
                       key=lambda t: (shares[t] * total - given[t], -t))
            given[tree] += nbytes
            self.trees[(key, chunk)] = tree


def _shares(weights: Sequence[float], spread: Sequence[bool], server: int, servers: int) -> list[float]:
    """Each tree's share of `server`'s bytes: a spread tree's weight; for the others, the overlap of
    their stretches of [0, 1) (laid end to end, scaled to their total) with the server's, times their total."""
    total = sum(weights) or 1.0
    gathered = sum(w for w, s in zip(weights, spread, strict=True) if not s) / total or 1.0
    low, high = server / servers, (server + 1) / servers
    shares, start = [], 0.0
    for weight, alike in zip(weights, spread, strict=True):
        if alike:
            shares.append(weight / total)
            continue
        end = start + weight / total / gathered
        shares.append(max(0.0, min(end, high) - max(start, low)) * servers * gathered)
        start = end
    if not any(shares):  # rounding left the last server uncovered: the last tree takes it
        shares[-1] = 1.0
    return shares


def assign_chunks(chunks: Sequence[tuple[int, ...]], weights: Sequence[float],
                  servers: int = 0) -> dict[tuple[int, int], int]:
    """(key, chunk) -> tree index (see ChunkAssignment)."""
    assignment = ChunkAssignment(weights, servers)
    assignment.extend(chunks)
    return assignment.trees


def parse_static_trees(entries: Sequence[str]) -> dict[int, list[Route]]:
    """Config entries "[@SET] WEIGHT: CHILD>PARENT ..." -> the tree sets, weights normalised per set."""
    sets: dict[int, list[tuple[float, dict[str, str]]]] = {}
    for entry in entries:
        text = entry.strip()
        which = 0
        if text.startswith("@"):
            head, _, text = text[1:].partition(" ")
            if not head.isdigit():
                raise ValueError(f"aggregation.trees entry {entry!r}: a set is written @0, @1, ...")
            which = int(head)
        weight_text, colon, edges_text = text.partition(":")
        try:
            weight = float(weight_text)
        except ValueError:
            raise ValueError(f"aggregation.trees entry {entry!r} must start with a weight, e.g. "
                             "\"0.5: worker-0>aggregator-0 aggregator-0>server\"") from None
        if not colon or not math.isfinite(weight) or weight <= 0:
            raise ValueError(f"aggregation.trees entry {entry!r}: want a positive weight, then ':' and edges")
        parents: dict[str, str] = {}
        for edge in edges_text.split():
            child, arrow, parent = edge.partition(">")
            if not arrow or not _NAME.fullmatch(child) or not (parent == SERVERS or _NAME.fullmatch(parent)):
                raise ValueError(f"aggregation.trees entry {entry!r}: edge {edge!r} is not CHILD>PARENT with "
                                 f"nodes like worker-0 or aggregator-1 and PARENT possibly {SERVERS!r}")
            if child in parents:
                raise ValueError(f"aggregation.trees entry {entry!r} gives {child!r} two parents")
            parents[child] = parent
        sets.setdefault(which, []).append((weight, parents))
    if sorted(sets) != list(range(len(sets))):
        raise ValueError(f"aggregation.trees sets must be numbered @0, @1, ... without gaps, got {sorted(sets)}")
    return {which: [Route(w / sum(v for v, _ in trees), p) for w, p in trees] for which, trees in sets.items()}


def parse_routing(raw: object) -> Routing:
    """A ROUTES message's [epoch, [[weight, [[child, parent], ...]], ...]], validated (WireError)."""
    if type(raw) is not list or len(raw) != 2 or type(raw[0]) is not int or type(raw[1]) is not list:
        raise WireError(f"routes must be [epoch, trees], got {brief(raw)}")
    epoch, raw_trees = raw
    if not 0 < epoch < 1 << 31 or not 0 < len(raw_trees) <= MAX_TREES:
        raise WireError(f"routes need an epoch in [1, 2**31) and 1..{MAX_TREES} trees, got {brief(epoch)}")
    trees = []
    for raw_tree in raw_trees:
        if (type(raw_tree) is not list or len(raw_tree) != 2 or type(raw_tree[0]) is not float
                or type(raw_tree[1]) is not list or len(raw_tree[1]) > MAX_EDGES):
            raise WireError(f"a tree must be [weight, [[child, parent], ...]], got {brief(raw_tree)}")
        weight, edges = raw_tree
        if not 0 < weight <= 1:
            raise WireError(f"a tree's weight must be in (0, 1], got {brief(weight)}")
        parents: dict[str, str] = {}
        for edge in edges:
            if type(edge) is not list or len(edge) != 2 or not all(type(n) is str and len(n) <= 64 for n in edge):
                raise WireError(f"a tree edge must be [child, parent] names, got {brief(edge)}")
            if edge[0] in parents:
                raise WireError(f"a tree gives {brief(edge[0])} two parents")
            parents[edge[0]] = edge[1]
        trees.append(Route(weight, parents))
    if abs(sum(t.weight for t in trees) - 1.0) > 1e-6:
        raise WireError(f"tree weights must sum to 1, got {sum(t.weight for t in trees)}")
    return Routing(epoch, tuple(trees))
