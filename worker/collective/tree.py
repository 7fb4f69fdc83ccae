"""Pure layouts of a job's ranks: the coordinator tree (bounded fan-out and height, grouped by host) and the ring.

`build_tree` (seed 000, claims 2 and 3: a balanced tree of bounded height and fan-out whose neighbours
are close in the physical topology):

- arity 0: flat, every rank a child of rank 0 (Horovod's coordinator), the baseline.
- arity k >= 2: built top-down. Below each rank lies a pool: the remaining ranks of its own host (free),
  and whole hosts (and whole racks, when racks are given) that must stay together. The pool is split
  into at most k parts of balanced size (whole hosts and racks largest first into the lightest part,
  then the free ranks topping up the lightest ones), and each part gets one child: the part's lowest
  free rank, else the leader (lowest rank) of its lowest host, else of its lowest rack. A host or rack
  is opened only at its leader, so each is one connected subtree under its leader and exactly one
  edge enters it. One host gives a tree of the optimal height, ceil(log_k(n (k - 1) + 1)) - 1, whose
  subtrees are ranges of consecutive ranks; with hosts the height stays within ceil(log_k n) + 1 (every
  layout of 2-256 ranks in equal or random host sizes that tests/unit/test_tree.py tries; 8 hosts of
  8 ranks at arity 4: 4, where hanging hosts under host leaders only would need 5).

The root is always rank 0, fan-out is at most `arity` everywhere, and the same input gives the same
tree. `ring_order` lists the ranks rack by rack and host by host, so the ring crosses each host
boundary once. `dials` says which side of a pair opens the connection (see its docstring).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Tree:
    parent: tuple[int | None, ...]  # per rank; the root's is None
    children: tuple[tuple[int, ...], ...]  # per rank, ascending
    root: int = 0

    @property
    def size(self) -> int:
        return len(self.parent)

    def height(self) -> int:
        """Edges on the longest path from the root down (0 for a single rank)."""
        depth = {self.root: 0}
        stack = [self.root]
        while stack:
            rank = stack.pop()
            for child in self.children[rank]:
                depth[child] = depth[rank] + 1
                stack.append(child)
        return max(depth.values())

    def subtree(self, rank: int) -> tuple[int, ...]:
        """The ranks of `rank`'s subtree, itself included, ascending."""
        found, stack = [], [rank]
        while stack:
            node = stack.pop()
            found.append(node)
            stack.extend(self.children[node])
        return tuple(sorted(found))

    def neighbours(self, rank: int) -> tuple[int, ...]:
        """The parent (if any) and the children of `rank`: the ranks its controller talks to."""
        up = self.parent[rank]
        return self.children[rank] if up is None else (up, *self.children[rank])


def dials(rank: int, other: int) -> bool:
    """Whether `rank` opens the connection to `other`: the higher rank dials the lower. A transport drops a
    message that arrives on its listening side from a peer it dialled itself, so each pair must be dialled
    once, from one side, whatever else (ring, tree, data plane) the pair is for. The side that did not dial
    can send only once it has heard from the other (a ROUTER learns its route from a message)."""
    return rank > other


#: a unit of the pool below a rank: ("rank", (r,)) a rank of that rank's own host, free to place anywhere
#: below it; ("host", ranks) a whole host; ("rack", hosts) a whole rack (a tuple of hosts' rank tuples)
_Block = tuple[str, tuple[Any, ...]]


def _size(block: _Block) -> int:
    return sum(map(len, block[1])) if block[0] == "rack" else len(block[1])


def _first(block: _Block) -> int:
    first: int = block[1][0][0] if block[0] == "rack" else block[1][0]
    return first


def _open(block: _Block) -> tuple[int, list[_Block]]:
    """The rank that roots a host or rack block (its lowest, the leader) and the pool below it."""
    hosts = block[1] if block[0] == "rack" else (block[1],)
    leader, *rest = hosts[0]
    return leader, [("rank", (r,)) for r in rest] + [("host", h) for h in hosts[1:]]


def _bins(pool: list[_Block], arity: int) -> list[list[_Block]]:
    """Split a pool into at most `arity` parts of balanced size: whole hosts and racks first, largest
    first into the lightest part (LPT), then the free ranks, ascending, topping up the lightest parts."""
    bins: list[list[_Block]] = [[] for _ in range(arity)]
    loads = [0] * arity
    for block in sorted((b for b in pool if b[0] != "rank"), key=lambda b: (-_size(b), _first(b))):
        lightest = loads.index(min(loads))
        bins[lightest].append(block)
        loads[lightest] += _size(block)
    free = sorted(b for b in pool if b[0] == "rank")
    counts = [0] * arity
    for _ in free:
        lightest = loads.index(min(loads))
        counts[lightest] += 1
        loads[lightest] += 1
    start = 0
    for part, count in zip(bins, counts, strict=True):
        part.extend(free[start:start + count])  # consecutive ranks stay together
        start += count
    return [part for part in bins if part]


def _place(root: int, pool: list[_Block], arity: int, parent: list[int | None], children: list[list[int]]) -> None:
    """Hang `pool` below `root`, top-down: each part of the pool gets a child of `root`. A part's child is its
    lowest free rank (the root's host goes on below it), else the leader of its lowest host, else of its
    lowest rack; hosts and racks are opened only at their leader, so each stays one connected subtree."""
    stack = [(root, pool)]
    while stack:
        top, below = stack.pop()
        for part in _bins(below, arity):
            free = [b for b in part if b[0] == "rank"]
            if free:
                chosen, rest = free[0], [b for b in part if b is not free[0]]
                child = chosen[1][0]
            else:
                chosen = min(part, key=lambda b: (b[0] != "host", _first(b)))
                child, rest = _open(chosen)
                rest += [b for b in part if b is not chosen]
            parent[child] = top
            children[top].append(child)
            stack.append((child, rest))


def _groups(keys: Sequence[str], members: Sequence[int]) -> list[list[int]]:
    """`members` grouped by keys[member], groups in order of their first member (members ascending)."""
    grouped: dict[str, list[int]] = {}
    for member in sorted(members):
        grouped.setdefault(keys[member], []).append(member)
    return list(grouped.values())


def _check(hosts: Sequence[str], racks: Sequence[str] | None) -> None:
    if not hosts:
        raise ValueError("a tree needs at least one rank")
    if racks is None:
        return
    if len(racks) != len(hosts):
        raise ValueError(f"racks names {len(racks)} ranks, hosts {len(hosts)}")
    rack_of: dict[str, str] = {}
    for rank, host in enumerate(hosts):
        if rack_of.setdefault(host, racks[rank]) != racks[rank]:
            raise ValueError(f"host {host!r} is in two racks, {rack_of[host]!r} and {racks[rank]!r} (rank {rank})")


def build_tree(hosts: Sequence[str], arity: int, racks: Sequence[str] | None = None) -> Tree:
    """The coordinator tree of len(hosts) ranks; hosts[r] is rank r's host, racks[r] its rack (optional)."""
    _check(hosts, racks)
    if arity < 0 or arity == 1:
        raise ValueError(f"arity must be 0 (flat) or at least 2, got {arity}")
    n = len(hosts)
    if arity == 0:
        rest = tuple(range(1, n))
        return Tree((None, *(0 for _ in rest)), (rest, *(() for _ in rest)))
    hosts_of = [tuple(group) for group in _groups(hosts, range(n))]
    if racks is None:
        blocks: list[_Block] = [("host", h) for h in hosts_of]
    else:
        by_leader = {h[0]: h for h in hosts_of}
        blocks = [("rack", tuple(by_leader[r] for r in group)) for group in _groups(racks, list(by_leader))]
    parent: list[int | None] = [None] * n
    children: list[list[int]] = [[] for _ in range(n)]
    root, pool = _open(blocks[0])  # the block of rank 0
    _place(root, pool + blocks[1:], arity, parent, children)
    return Tree(tuple(parent), tuple(tuple(sorted(c)) for c in children))


def ring_order(hosts: Sequence[str], racks: Sequence[str] | None = None) -> tuple[int, ...]:
    """Every rank once, starting at rank 0: racks contiguous, hosts contiguous within them, ranks ascending."""
    _check(hosts, racks)
    rack = racks if racks is not None else [""] * len(hosts)
    order: list[int] = []
    for rack_group in _groups(rack, range(len(hosts))):
        for host_group in _groups(hosts, rack_group):
            order.extend(host_group)
    return tuple(order)
