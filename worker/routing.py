"""A worker's routes: which aggregation tree, and so which peer, each chunk of each round is pushed to.

The scheduler switches the job to new trees with the protocol in scheduler/hierarchy/switch.py;
this is the worker's side: `begin` (ROUTES: answer with the last round started of every tensor and
hold new rounds), `commit` (COMMIT: the switch round of each tensor; release what was held), and
`route` (for a chunk of a round: the epoch's tree and the parent to push to, or None for the
server); for a push held back inside its round (worker/midround.py), `tree_of` and `announced_tree`
name its trees now and announced, and `moved` routes it on the new trees. Chunks are given to trees by
`ChunkAssignment`, extended as tensors are declared: keys grow with each declaration and the assignment
of a chunk depends only on the chunks before it, so every worker gets the same assignment whenever it
computes it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sluice.scheduler.hierarchy.routes import SERVERS, ChunkAssignment, Routing, stale_epochs
from sluice.transport.wire import WireError

#: epochs whose ROUTES and COMMIT arrival times are kept (for benchmarks: how long a switch took to reach us)
KEEP_TIMES = 16


@dataclass
class _Epoch:
    routing: Routing
    #: key -> first round on these trees (tensors not listed: every round)
    switch: dict[int, int]
    #: (key, chunk) -> tree index, extended in key order as tensors are declared; made at the epoch's
    #: first push, when the job's servers are known (a COMMIT can come before them: every worker must
    #: compute it with the same server count)
    assignment: ChunkAssignment | None = None


class Router:
    def __init__(self, name: str) -> None:
        self.name = name
        self._epochs: list[_Epoch] = []  # committed, newest last
        self.pending: Routing | None = None
        #: (key, chunk, nbytes, server) of every declared chunk, in key order
        self._chunks: list[tuple[int, ...]] = []
        self._server_of: dict[tuple[int, int], int] = {}
        #: the job's servers: each tree's chunks go to a few of them (ChunkAssignment); set once known
        self.servers = 0
        #: pushes sent up a tree so far (the rest went straight to the servers)
        self.routed = 0
        #: wall-clock times ROUTES and COMMIT of the latest epochs arrived, by epoch (bench/replan.py reads them)
        self.routes_at: dict[int, float] = {}
        self.committed_at: dict[int, float] = {}
        #: when pushes of a round in flight were first sent on an epoch's trees (a switch inside the round)
        self.moved_at: dict[int, float] = {}
        #: the announced trees' chunk assignment, made when a push held back at ROUTES asks for it
        self._announced: _Epoch | None = None

    @property
    def epoch(self) -> int:
        """The newest committed routing epoch (0: none yet)."""
        return self._epochs[-1].routing.epoch if self._epochs else 0

    @property
    def holding(self) -> bool:
        """Between ROUTES and COMMIT: rounds started now wait for the switch round to be known."""
        return self.pending is not None

    def declare(self, chunks: Sequence[tuple[int, ...]]) -> None:
        """Chunks of newly declared tensors as (key, chunk, nbytes, server); keys larger than any before."""
        self._chunks.extend(sorted(chunks))
        self._server_of.update(((c[0], c[1]), c[3] if len(c) > 3 else 0) for c in chunks)

    def knows(self, key: int, chunk: int) -> bool:
        """Whether the chunk was declared here (a process set's tensors go straight to the servers, undeclared)."""
        return (key, chunk) in self._server_of

    def server_of(self, key: int, chunk: int) -> int:
        """The rank of the server that owns the declared chunk."""
        return self._server_of[(key, chunk)]

    def begin(self, routing: Routing, aggregators: set[str]) -> None:
        """ROUTES: the trees to switch to, once COMMIT says from which rounds (WireError if they cannot be). The
        same trees again (a standby scheduler finishing the switch, scheduler/hierarchy/switch.py) are answered
        again."""
        if self.pending is not None and self.pending == routing:
            return
        if self.pending is not None or (self._epochs and routing.epoch <= self._epochs[-1].routing.epoch):
            raise WireError(f"ROUTES for epoch {routing.epoch} while another switch is open or it is not newer")
        strangers = {t.parent(self.name) for t in routing.trees} - aggregators - {SERVERS}
        if strangers:
            raise WireError(f"ROUTES give {self.name} the parent {sorted(strangers)[0]!r:.60}: not an aggregator")
        self.pending, self._announced = routing, None
        _stamp(self.routes_at, routing.epoch)

    def commit(self, epoch: int, rounds: list[tuple[int, int]], keep_from: int = 0) -> list[str]:
        """Take the pending trees from the given switch rounds on, forgetting the epochs before `keep_from`, whose
        rounds are all over (scheduler/hierarchy/switch.py); the aggregators to connect to."""
        if self.pending is None or self.pending.epoch != epoch:
            raise WireError(f"COMMIT for epoch {epoch}, which was not announced")
        routing, self.pending = self.pending, None
        announced, self._announced = self._announced, None
        self._epochs.append(_Epoch(routing, dict(rounds), announced.assignment if announced is not None else None))
        stale = set(stale_epochs((e.routing.epoch for e in self._epochs), min(keep_from, epoch)))
        self._epochs = [e for e in self._epochs if e.routing.epoch not in stale]
        _stamp(self.committed_at, epoch)
        return sorted({t.parent(self.name) for t in routing.trees} - {SERVERS})

    def route(self, key: int, chunk: int, round_: int) -> tuple[int, int, str] | None:
        """(epoch, tree, parent aggregator) for this push, or None: straight to the chunk's server."""
        for epoch in reversed(self._epochs):  # a loop, not _epoch_for: once for every chunk pushed
            if round_ >= epoch.switch.get(key, 0):
                return self._route_in(epoch, key, chunk)
        return None  # before the first epoch: every worker pushed this round straight to the servers

    def moved(self, key: int, chunk: int) -> tuple[int, int, str] | None:
        """route() on the newest trees for a push of a round in flight that the COMMIT moved onto them."""
        _stamp(self.moved_at, self._epochs[-1].routing.epoch)
        return self._route_in(self._epochs[-1], key, chunk)

    def tree_of(self, key: int, chunk: int, round_: int) -> tuple[int, int]:
        """(epoch, tree) the push takes ((0, -1): before the first epoch, straight to the servers)."""
        epoch = self._epoch_for(key, round_)
        return (0, -1) if epoch is None else (epoch.routing.epoch, self._tree(epoch, key, chunk))

    def _epoch_for(self, key: int, round_: int) -> _Epoch | None:
        """The committed epoch whose trees round `round_` of tensor `key` takes (None: before the first)."""
        for epoch in reversed(self._epochs):
            if round_ >= epoch.switch.get(key, 0):
                return epoch
        return None

    def announced_tree(self, key: int, chunk: int) -> int:
        """The tree the chunk takes in the trees announced by ROUTES (call between ROUTES and COMMIT)."""
        if self.pending is None:
            raise ValueError("no trees announced")
        if self._announced is None:
            self._announced = _Epoch(self.pending, {})
        return self._tree(self._announced, key, chunk)

    def _route_in(self, epoch: _Epoch, key: int, chunk: int) -> tuple[int, int, str] | None:
        tree = self._tree(epoch, key, chunk)
        parent = epoch.routing.trees[tree].parent(self.name)
        if parent == SERVERS:
            return None
        self.routed += 1
        return epoch.routing.epoch, tree, parent

    def oldest_in_use(self, rounds: Iterable[tuple[int, int]]) -> int:
        """The oldest routing epoch that these (key, round)s, this worker's rounds in flight, travel (0: none
        travels a tree): ROUTES_ACK's `oldest`, so that no node forgets it while they may still need it."""
        return min((e for key, round_ in rounds if (e := self.epoch_of(key, round_)) > 0), default=0)

    def epoch_of(self, key: int, round_: int) -> int:
        """The routing epoch round `round_` of tensor `key` travels (0: straight to the servers); known for
        certain once the round's pushes have left (a round held through a switch takes the new epoch)."""
        epoch = self._epoch_for(key, round_)
        return 0 if epoch is None else epoch.routing.epoch

    def parent(self, epoch: int, tree: int) -> str | None:
        """This worker's parent in tree `tree` of routing epoch `epoch` (None: not an epoch kept, or the servers)."""
        for kept in self._epochs:
            if kept.routing.epoch == epoch and 0 <= tree < len(kept.routing.trees):
                parent = kept.routing.trees[tree].parent(self.name)
                return None if parent == SERVERS else parent
        return None

    def _tree(self, epoch: _Epoch, key: int, chunk: int) -> int:
        assignment = epoch.assignment
        if assignment is None:
            assignment = epoch.assignment = ChunkAssignment([t.weight for t in epoch.routing.trees], self.servers)
        tree = assignment.trees.get((key, chunk))
        if tree is None:  # a chunk declared since: extend the assignment up to it
            assignment.extend(self._chunks[len(assignment):])
            tree = assignment.trees[(key, chunk)]
        return tree


def _stamp(times: dict[int, float], epoch: int) -> None:
    """Note when `epoch`'s message arrived (the first time), forgetting all but the last KEEP_TIMES epochs."""
    times.setdefault(epoch, time.time())
    for old in sorted(times)[:-KEEP_TIMES]:
        del times[old]
