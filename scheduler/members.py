"""The job's members as the scheduler admits them (pure): a Node, its rank and id assigned, the address book.

Node ids: the scheduler is 0, servers 1..S, workers S+1..S+W, aggregators after them; ranks are
counted per role from 0, a node's rank hint kept when it gave one.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

ROLES = ("server", "worker", "aggregator")


@dataclass
class Node:
    name: str
    role: str
    rank_hint: int
    endpoints: list[str]
    pid: int
    arrival: int
    node_id: int = -1
    rank: int = -1

    def describe(self) -> str:
        return f"{self.role} {self.rank} (node {self.node_id}, pid {self.pid})"


def assign(nodes: Iterable[Node]) -> str | None:
    """Give every node its rank (its hint, else the lowest free, by arrival) and id, role by role; the
    error text if a role's hints are duplicated or out of range (the roles before it are assigned)."""
    nodes = list(nodes)
    next_id = 1
    for role in ("server", "worker", "aggregator"):
        members = [n for n in nodes if n.role == role]
        hinted = sorted(n.rank_hint for n in members if n.rank_hint >= 0)
        if len(set(hinted)) != len(hinted) or any(r >= len(members) for r in hinted):
            return f"{role} ranks {hinted} are duplicated or out of range 0..{len(members) - 1}"
        free = iter(r for r in range(len(members)) if r not in hinted)
        for node in sorted(members, key=lambda n: n.arrival):
            node.rank = node.rank_hint if node.rank_hint >= 0 else next(free)
        for node in sorted(members, key=lambda n: n.rank):
            node.node_id, next_id = next_id, next_id + 1
    return None


def address_book(nodes: Iterable[Node]) -> list[Any]:
    """What a WELCOME carries: [[node id, role, rank, name, endpoints], ...]."""
    return [[n.node_id, n.role, n.rank, n.name, n.endpoints] for n in nodes]
