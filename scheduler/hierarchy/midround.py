"""Which workers may send a chunk of a round in flight on the new trees at a switch: a pure planner.

A switch (scheduler/hierarchy/switch.py) takes effect between rounds: the round in flight ends on the
trees it started on, and after a rack's uplink is cut that round is the slow one. What is left of it
at ROUTES is mostly pushes still in the send queues of the cut rack's workers (docs/aggregation.md, "Why
between rounds"); those could take the new trees instead, but only where every aggregator of either
tree still sees a chunk's round as exactly the ranks its tree gives it, one tree at a time:

- Under the servers, each tree splits the workers into groups: those whose pushes reach the servers
  through the same node (an aggregator's subtree, or a worker alone that sends straight to them).
  Workers joined by a group of either tree form a component; a component moves whole or not at all,
  and only when every worker in it still holds its push (none has left its send queue).
- An aggregator takes one tree's round of a chunk at a time (ps/relay.py): no aggregator on a moving
  worker's new path may be on the old path of a worker that stays. A component that would share one
  stays too, which can make others share one; the rule is applied until nothing changes.
- A component whose workers' paths are the same in both trees gains nothing, and stays.

`movers` gives, for one chunk of one round, the workers that move; `plan_moves` runs it for every chunk
the workers said they hold (ROUTES_ACK's `held`), and the COMMIT lists the result (`moved`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set

from sluice.scheduler.hierarchy.routes import SERVERS, Route, Routing
from sluice.transport.wire import WireError, brief

#: a push held back at ROUTES: (key, round, chunk, its epoch, its tree there (-1: epoch 0), its tree announced)
Held = tuple[int, int, int, int, int, int]
#: a chunk of a round in flight moved onto the new trees, and the workers whose pushes of it move
Moved = tuple[int, int, int, tuple[str, ...]]
#: pushes one ROUTES_ACK may list as held, and chunks one COMMIT may list as moved: with the byte budget below,
#: well inside a control message's header bound (wire.CONTROL_HEADER_BYTES, 4 MiB)
MAX_HELD = 1 << 15
#: what a COMMIT's `moved` may take, about (names and numbers); the chunks past it stay where they were going
MOVED_BYTES = 1 << 20
#: bounds of a held entry's fields, [low, high): key, round, chunk, epoch, tree (-1: epoch 0), announced tree
_LIMITS = ((0, 1 << 31), (0, 1 << 62), (0, 1 << 31), (0, 1 << 62), (-1, 1 << 16), (0, 1 << 16))


def parse_held(raw: object) -> list[Held]:
    """A worker's ROUTES_ACK `held`: [[key, round, chunk, epoch, tree, announced tree], ...], checked (WireError)."""
    if type(raw) is not list or len(raw) > MAX_HELD:
        raise WireError(f"held must be a list of at most {MAX_HELD} entries, got {brief(raw)}")
    held = []
    for item in raw:
        if (type(item) is not list or len(item) != 6 or not all(type(v) is int for v in item)
                or not all(low <= v < high for v, (low, high) in zip(item, _LIMITS, strict=True))):
            raise WireError(f"a held entry must be [key, round, chunk, epoch, tree, announced tree], got {brief(item)}")
        held.append((item[0], item[1], item[2], item[3], item[4], item[5]))
    return held


def parse_moved(raw: object) -> list[Moved]:
    """A COMMIT's `moved`: [[key, round, chunk, [worker, ...]], ...], checked (WireError)."""
    if type(raw) is not list or len(raw) > MAX_HELD:
        raise WireError(f"moved must be a list of at most {MAX_HELD} entries, got {brief(raw)}")
    moved = []
    for item in raw:
        if (type(item) is not list or len(item) != 4 or not all(type(v) is int and v >= 0 for v in item[:3])
                or type(item[3]) is not list or not all(type(w) is str and len(w) <= 64 for w in item[3])):
            raise WireError(f"a moved entry must be [key, round, chunk, [worker, ...]], got {brief(item)}")
        moved.append((item[0], item[1], item[2], tuple(item[3])))
    return moved


def plan_moves(held: Mapping[str, Sequence[Held]], workers: Sequence[str], epochs: Sequence[Routing],
               announced: Routing) -> list[Moved]:
    """The chunks of rounds in flight that move onto `announced`, and whose pushes: from what each live worker
    said it holds (`held`, by worker), the job's `workers` (one gone holds nothing, and its groups stay), and
    the epochs committed before (`epochs`, whose trees the rounds in flight took). A chunk whose holders
    disagree on its trees, or whose trees are not known here, moves nowhere, and so do rounds before the job's
    first trees (epoch 0): every rack's pushes would move at once at the job's start, and pushes still queued
    across an uplink then wait while the racks sum what moved, which reads as the uplink being slow (measured:
    bench/replan.py's job planned for a cut uplink read it at 0.9-1.1 Mbit/s of 2.5 after its first switch, and
    re-planned for that)."""
    trees = {r.epoch: r.trees for r in epochs}
    reports: dict[tuple[int, int, int], dict[str, tuple[int, int, int]]] = {}
    for worker, entries in held.items():
        if worker in workers:
            for key, round_, chunk, epoch, tree, new in entries:
                reports.setdefault((key, round_, chunk), {})[worker] = (epoch, tree, new)
    moves: list[Moved] = []
    budget = MOVED_BYTES
    # chunks on the same trees held by the same workers move alike: their groups are worked out once
    decided: dict[tuple[int, int, int, frozenset[str]], frozenset[str]] = {}
    for (key, round_, chunk), said in sorted(reports.items()):
        if len(moves) == MAX_HELD:
            break
        if len(set(said.values())) != 1:
            continue
        epoch, tree, new = next(iter(said.values()))
        known = trees.get(epoch, ())
        if not 0 <= new < len(announced.trees) or not 0 <= tree < len(known):
            continue
        holders = frozenset(said)
        moving = decided.get((epoch, tree, new, holders))
        if moving is None:
            moving = decided[(epoch, tree, new, holders)] = movers(workers, holders, known[tree], announced.trees[new])
        if moving:
            budget -= 32 + sum(len(w) + 2 for w in moving)
            if budget < 0:
                break
            moves.append((key, round_, chunk, tuple(sorted(moving))))
    return moves


def path_up(tree: Route | None, worker: str) -> tuple[str, ...]:
    """The aggregators `worker`'s pushes pass on their way to the servers in `tree` (None or not named in
    it: none, straight to them), nearest first."""
    if tree is None:
        return ()
    path: list[str] = []
    node = worker
    # trees reach here checked for cycles (routes.check_trees, the aggregators' install); the bound is a backstop
    for _ in range(len(tree.parents)):
        parent = tree.parent(node)
        if parent == SERVERS:
            break
        path.append(parent)
        node = parent
    return tuple(path)


def movers(workers: Sequence[str], holders: Set[str], old: Route | None, new: Route | None) -> frozenset[str]:
    """The workers whose push of one chunk of a round in flight takes `new` instead of `old` (None: straight
    to the servers), given the workers that still hold theirs (`holders`): whole components, held by all
    of their workers, sharing no aggregator with the workers that stay, with some path that changes."""
    old_paths = {w: path_up(old, w) for w in workers}
    new_paths = {w: path_up(new, w) for w in workers}
    components = _components(workers, [{w: (p[-1] if p else w) for w, p in paths.items()}
                                       for paths in (old_paths, new_paths)])
    moving = [c for c in components
              if c <= holders and any(old_paths[w] != new_paths[w] for w in c)]
    while True:
        staying = set(workers).difference(*moving)
        busy = {a for w in staying for a in old_paths[w]}
        kept = [c for c in moving if not any(busy.intersection(new_paths[w]) for w in c)]
        if len(kept) == len(moving):
            return frozenset().union(*moving)
        moving = kept


def _components(workers: Sequence[str], tops: Sequence[dict[str, str]]) -> list[frozenset[str]]:
    """The workers joined by sharing a top (the node under the servers) in any of `tops`, in first-seen order."""
    leader = {w: w for w in workers}

    def find(w: str) -> str:
        while leader[w] != w:
            leader[w] = leader[leader[w]]
            w = leader[w]
        return w

    for top_of in tops:
        first: dict[str, str] = {}
        for w in workers:
            other = first.setdefault(top_of[w], w)
            leader[find(w)] = find(other)
    groups: dict[str, set[str]] = {}
    for w in workers:
        groups.setdefault(find(w), set()).add(w)
    return [frozenset(g) for g in groups.values()]
