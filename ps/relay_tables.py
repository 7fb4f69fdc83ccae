"""What an aggregator knows of its job: who its peers are, the declared chunks, and its place in each tree."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sluice.scheduler.hierarchy.routes import SERVERS, Routing, has_cycle, stale_epochs, subtree_ranks
from sluice.transport.dtypes import STORAGE
from sluice.transport.wire import MAX_PAYLOAD_BYTES, Message, WireError, brief


@dataclass(frozen=True)
class TreeView:
    """One tree as one aggregator sees it."""

    parent: str  # an aggregator's name, or SERVERS
    children: frozenset[str]
    ranks: tuple[int, ...]  # the workers whose pushes reach this aggregator, sorted
    #: each child aggregator's subtree: exactly the ranks its pushes may list
    child_ranks: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def parent_is_aggregator(self) -> bool:
        return self.parent != SERVERS


class Tables:
    def __init__(self, name: str) -> None:
        self.name = name
        #: node id -> peer name, for every worker and aggregator of the job
        self.names: dict[int, str] = {}
        self.worker_ranks: dict[str, int] = {}
        self.aggregators: set[str] = set()
        self.server_names: list[str] = []
        #: (key, chunk) -> (length, dtype, server rank)
        self.chunks: dict[tuple[int, int], tuple[int, str, int]] = {}
        self.epochs: dict[int, list[TreeView]] = {}

    def sender(self, peer: str, sender: int) -> str:
        """The child's name, or WireError if `sender` on connection `peer` is no worker or aggregator."""
        if self.names.get(sender) != peer:
            raise WireError(f"sender {sender} on connection {peer!r:.60} is not a worker or aggregator of this job")
        return peer

    def route_of(self, msg: Message) -> tuple[int, int]:
        route = msg.meta.get("route") if msg.meta else None
        if type(route) is not list or len(route) != 2 or not all(type(v) is int for v in route):
            raise WireError(f"a push to an aggregator must name its [epoch, tree], got {brief(route)}")
        return route[0], route[1]

    def view(self, route: tuple[int, int]) -> TreeView:
        views = self.epochs.get(route[0])
        if views is None or not 0 <= route[1] < len(views):
            raise WireError(f"unknown tree {route[1]} of routing epoch {route[0]} (known: {sorted(self.epochs)})")
        return views[route[1]]

    def chunk(self, key: int, chunk: int) -> tuple[int, str, int]:
        found = self.chunks.get((key, chunk))
        if found is None:
            raise WireError(f"unknown key {key} chunk {chunk}")
        return found

    def parent_peer(self, view: TreeView, key: int, chunk: int) -> str:
        return view.parent if view.parent_is_aggregator else self.server_names[self.chunk(key, chunk)[2]]

    def install(self, routing: Routing, keep_from: int = 0) -> list[str]:
        """Take a new epoch's trees, forgetting the epochs before `keep_from` (none of their rounds is in flight
        any more: scheduler/hierarchy/switch.py); the aggregators this one sends to (its parents), to connect to."""
        if routing.epoch in self.epochs or (self.epochs and routing.epoch < max(self.epochs)):
            raise WireError(f"routing epoch {routing.epoch} is not newer than {max(self.epochs)}")
        views = []
        for index, tree in enumerate(routing.trees):
            parent = tree.parent(self.name)
            if parent != SERVERS and parent not in self.aggregators:
                raise WireError(f"tree names {brief(parent)} as the parent of {self.name}: not an aggregator")
            if has_cycle(tree):
                raise WireError(f"tree {index} of routing epoch {routing.epoch} has a cycle")
            children = frozenset(tree.children(self.name))
            below = {c: subtree_ranks(tree, c, self.worker_ranks) for c in children if c in self.aggregators}
            views.append(TreeView(parent, children, subtree_ranks(tree, self.name, self.worker_ranks), below))
        self.epochs[routing.epoch] = views
        for old in stale_epochs(self.epochs, min(keep_from, routing.epoch)):
            del self.epochs[old]
        return sorted({v.parent for v in views if v.parent_is_aggregator})

    def add_plan(self, table: Any) -> None:
        """The declared tensors, as workers get them: [[key, name, shape, dtype, priority,
        [[chunk, offset, length, server], ...]], ...]; a malformed table raises WireError, changes nothing."""
        if type(table) is not list:
            raise WireError(f"a plan must be a list, got {brief(table)}")
        found: dict[tuple[int, int], tuple[int, str, int]] = {}
        for entry in table:
            if type(entry) is not list or len(entry) != 6 or type(entry[0]) is not int or type(entry[5]) is not list:
                raise WireError(f"a plan entry must be [key, name, shape, dtype, priority, chunks], got {brief(entry)}")
            key, dtype, chunks = entry[0], entry[3], entry[5]
            if type(dtype) is not str or dtype not in STORAGE:
                raise WireError(f"key {key} of the plan has dtype {brief(dtype)}")
            itemsize = np.dtype(STORAGE[dtype]).itemsize
            for item in chunks:
                if (type(item) is not list or len(item) != 4 or not all(type(v) is int for v in item)
                        or not 0 <= item[2] * itemsize < MAX_PAYLOAD_BYTES
                        or not 0 <= item[3] < len(self.server_names)):
                    raise WireError(f"a chunk of key {key} must be [chunk, offset, length, server], got {brief(item)}")
                found[(key, item[0])] = (item[2], dtype, item[3])
        self.chunks.update(found)
