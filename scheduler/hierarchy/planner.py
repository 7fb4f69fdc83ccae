"""The tree planner: weighted aggregation trees for one job's push_pull rounds, from an LP bound and an ILP.

Aggregators appear only at oversubscribed layers: a rack may aggregate only if it holds workers and
its uplink is below its worker hosts' links (topology.oversubscribed); its candidates are its worker
hosts and its aux hosts. Every other rack is always direct, and with no candidates at all the plan is
the flat one (status "flat"). Bounds and optimality are over plans with these candidates: where the
servers' links are the bottleneck, aggregating in a rack that is not oversubscribed would cut their
load too (fewer streams), and the rule leaves that out on purpose.

Steps (loads are those of loads.py, T = the busiest link's load/rate):
1. T_lp, the LP bound: the best T with per-host fractions y[h] in [0, 1] and A_r <= 1 (milp.lp_bound).
2. Heuristics that fit K slots. `align` turns fractions into trees: per rack its hosts' fractions lie
   end to end on [0, A_r] (largest first, so alike racks break at the same points) and [A_r, 1] is
   direct; the union of all racks' breakpoints cuts [0, 1] into intervals, each one tree (its weight
   the interval's length, each rack's aggregator the host whose segment covers it). That achieves
   the fractions exactly, hence T_lp from the LP's y, but can need up to 1 + sum_r |C_r| trees.
   `reduce` folds the lightest tree into the one that hurts T least until at most K remain (and on
   while that lowers T + penalty). `ranked` makes tree t of every rack's t-th best host (by the LP),
   K - 1 of them and a direct tree, or K: the shape of the optimum when racks are alike. Each start
   gets its weights polished and is improved by local search (`improve`: move one rack's aggregator
   in one tree, re-polish, repeat); the best of them, or flat, is the warm start.
3. The K-slot program (milp.py), seeded with the warm start on highspy, minimising T + penalty *
   T_lp * (trees - 1); the warm start stays the fallback when the time limit leaves nothing better.
4. Every candidate plan gets its weights re-optimised for its trees (milp.polish), weights under
   1e-4 dropped, and T recomputed by loads.bottleneck; the lowest penalised T wins.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence

import numpy as np

from sluice.scheduler.hierarchy.loads import LoadModel, Vector, bottleneck, flat_plan, load_model
from sluice.scheduler.hierarchy.milp import Candidates, Shape, lp_bound, polish, solve_trees
from sluice.scheduler.hierarchy.topology import Plan, PlanError, Topology, TreeSpec, eligible, oversubscribed

Trees = list[tuple[float, Shape]]
SOLVERS = ("highs", "scipy")
MIN_WEIGHT = 1e-4  # lighter trees are dropped: each costs a routing entry for almost no bytes


def candidates(topology: Topology, model: LoadModel) -> Candidates:
    """Racks that may aggregate (oversubscribed, with workers), their candidate hosts, and host classes."""
    column = {name: j for j, name in enumerate(model.hosts)}
    racks, options, classes = [], [], []
    for rack in sorted(topology.racks, key=lambda r: r.name):
        hosts = [h for h in topology.hosts if h.rack == rack.name and eligible(h) and h.name in column]
        has_workers = any(h.workers for h in topology.hosts if h.rack == rack.name)
        if not hosts or not has_workers or not oversubscribed(topology, rack):
            continue
        racks.append(rack.name)
        options.append(tuple(column[h.name] for h in hosts))
        kinds: dict[tuple[int, int, float, bool], list[int]] = {}
        for h in hosts:
            kinds.setdefault((h.workers, h.servers, h.link_mbit, h.aux), []).append(column[h.name])
        classes += [tuple(cls) for cls in kinds.values() if len(cls) > 1]
    return Candidates(tuple(racks), tuple(options), tuple(classes))


def _weights(model: LoadModel, trees: Sequence[tuple[float, Shape]]) -> Vector:
    y = np.zeros(len(model.hosts))
    for weight, shape in trees:
        y[list(shape)] += weight
    return y


def _score(model: LoadModel, trees: Sequence[tuple[float, Shape]], unit: float) -> float:
    return float(np.max(model.times(_weights(model, trees)))) + unit * (len(trees) - 1)


def align(cand: Candidates, y: Vector) -> Trees:
    """Trees realising the fractions `y` exactly: racks' segments laid end to end, cut at every breakpoint."""
    segments = []
    for opts in cand.options:
        laid, at = [], 0.0
        for j in sorted((j for j in opts if y[j] > 1e-9), key=lambda j: (-round(float(y[j]), 9), opts.index(j))):
            laid.append((at, at + y[j], j))
            at += y[j]
        segments.append(laid)
    cuts = sorted({0.0, 1.0, *(round(min(end, 1.0), 9) for laid in segments for _, end, _ in laid)})
    trees: Trees = []
    for low, high in itertools.pairwise(cuts):
        mid = (low + high) / 2
        shape = tuple(sorted(j for laid in segments for start, end, j in laid if start <= mid < end))
        trees.append((high - low, shape))
    return trees


def reduce(model: LoadModel, trees: Trees, slots: int, unit: float) -> Trees:
    """Fold the lightest tree into the one whose shape costs least, while more than `slots` are left or
    folding lowers T + unit * (trees - 1)."""
    trees = sorted(trees, key=lambda t: -t[0])
    while len(trees) > 1:
        weight = trees[-1][0]
        rest = trees[:-1]
        y = _weights(model, rest)
        ind = np.zeros((len(model.hosts), len(rest)))
        for t, (_, other) in enumerate(rest):
            ind[list(other), t] = weight
        times = np.max((model.const[:, None] + model.coef @ (y[:, None] + ind)) / model.rates[:, None], axis=0)
        best = int(np.argmin(times))
        if len(trees) <= slots and float(times[best]) + unit * (len(rest) - 1) >= _score(model, trees, unit):
            break
        rest[best] = (rest[best][0] + weight, rest[best][1])
        trees = sorted(rest, key=lambda t: -t[0])
    return trees


def finish(model: LoadModel, trees: Sequence[tuple[float, Shape]]) -> Trees:
    """Merge trees of one shape, re-optimise the weights, drop those under MIN_WEIGHT; heaviest first."""
    shapes = sorted({shape for weight, shape in trees if weight > 0})
    while True:
        weights, _ = polish(model, shapes)
        kept = [s for w, s in zip(weights, shapes, strict=True) if w >= MIN_WEIGHT]
        if len(kept) == len(shapes) or not kept:
            break
        shapes = kept
    out = [(float(w), s) for w, s in zip(weights, shapes, strict=True) if w >= MIN_WEIGHT]
    total = sum(w for w, _ in out)
    return sorted(((w / total, s) for w, s in out), key=lambda t: (-t[0], t[1]))


def _moves(model: LoadModel, cand: Candidates, trees: Trees) -> Trees:
    """Best-improvement moves with the weights fixed: one rack takes another aggregator (or none) in one
    tree. A move must lower the busiest link's time or, at equal peak, the time summed over links
    above 0.9 of the peak (so that alike racks, tied at the peak, can improve one at a time)."""
    n_hosts = len(model.hosts)
    per_unit = np.hstack([model.coef, np.zeros((len(model.links), 1))]) / model.rates[:, None]  # last: direct
    rack_of = {j: i for i, opts in enumerate(cand.options) for j in opts}
    weights = np.array([w for w, _ in trees])
    assign = np.full((len(trees), len(cand.options)), n_hosts)
    for t, (_, shape) in enumerate(trees):
        for j in shape:
            assign[t, rack_of[j]] = j
    moves = np.array([(t, i, c) for t in range(len(trees)) for i, opts in enumerate(cand.options)
                      for c in (*opts, n_hosts)]).reshape(-1, 3)
    times = model.times(_weights(model, trees))
    for _ in range(min(4 * moves.shape[0], 1000)):
        peak = float(times.max())
        current = float(np.maximum(times - 0.9 * peak, 0).sum())
        delta = per_unit[:, moves[:, 2]] - per_unit[:, assign[moves[:, 0], moves[:, 1]]]
        after = times[:, None] + delta * weights[moves[:, 0]]
        tops = after.max(axis=0)
        excess = np.maximum(after - 0.9 * peak, 0).sum(axis=0)
        better = (tops < peak * (1 - 1e-12)) | ((tops <= peak * (1 + 1e-12)) & (excess < current * (1 - 1e-9)))
        if not better.any():
            break
        best = int(np.flatnonzero(better)[np.lexsort((excess[better], tops[better]))[0]])
        t, i, c = moves[best]
        assign[t, i], times = c, after[:, best]
    return [(float(weights[t]), tuple(sorted(int(j) for j in assign[t] if j < n_hosts))) for t in range(len(trees))]


def improve(model: LoadModel, cand: Candidates, trees: Trees, unit: float, rounds: int = 10) -> Trees:
    """Alternate aggregator moves (weights fixed) and weight polish while T + penalty keeps dropping."""
    best, score = trees, _score(model, trees, unit)
    for _ in range(rounds):
        tried = finish(model, _moves(model, cand, best))
        if _score(model, tried, unit) >= score - 1e-12 * score:
            break
        best, score = tried, _score(model, tried, unit)
    return best


def ranked(cand: Candidates, y: Vector, count: int, direct: bool) -> Trees:
    """`count` trees, tree t made of each rack's t-th host by `y` (so alike racks share the cuts), and
    with `direct` one more where every rack is direct; equal weights, for polish to set."""
    order = [sorted(opts, key=lambda j: (-y[j], opts.index(j))) for opts in cand.options]
    shapes = [tuple(sorted(o[t] for o in order if t < len(o))) for t in range(count)] + ([()] if direct else [])
    return [(1.0 / len(shapes), shape) for shape in shapes]


def warm_start(model: LoadModel, cand: Candidates, y_lp: Vector, slots: int, unit: float) -> Trees:
    """The best of: flat; the LP's fractions aligned, then reduced to K trees; each rack's K - 1 or K best
    hosts ranked into trees, with and without a direct tree; each locally improved."""
    pool: list[Trees] = [[(1.0, ())], reduce(model, align(cand, y_lp), slots, unit)]
    pool += [ranked(cand, y_lp, count, count < slots) for count in {max(slots - 1, 1), slots}]
    return min((improve(model, cand, finish(model, trees), unit) for trees in pool),
               key=lambda trees: _score(model, trees, unit))


def canonical(cand: Candidates, trees: Trees) -> Trees:
    """The same plan, heaviest tree first, with interchangeable hosts renamed so that each class's hosts
    first aggregate in class order (the form milp.py's symmetry rows admit)."""
    trees = sorted(trees, key=lambda t: -t[0])
    first: dict[int, int] = {}
    for t, (_, shape) in enumerate(trees):
        for j in shape:
            first.setdefault(j, t)
    rename: dict[int, int] = {}
    for cls in cand.classes:
        ordered = sorted(cls, key=lambda j: (first.get(j, len(trees)), cls.index(j)))
        rename.update(zip(ordered, cls, strict=True))
    return [(w, tuple(sorted(rename.get(j, j) for j in shape))) for w, shape in trees]


def _specs(topology: Topology, model: LoadModel, trees: Trees) -> tuple[TreeSpec, ...]:
    racks = sorted(rack.name for rack in topology.racks)
    specs = []
    for weight, shape in trees:
        chosen = {model.host_rack[j]: model.hosts[j] for j in shape}
        specs.append(TreeSpec(weight, tuple((rack, chosen.get(rack)) for rack in racks)))
    return tuple(specs)


def _check(max_trees: int, tree_penalty: float, time_limit: float, solver: str) -> None:
    if isinstance(max_trees, bool) or not isinstance(max_trees, int) or max_trees < 1:
        raise PlanError(f"max_trees must be an integer >= 1 (got {max_trees!r}): 1 gives a single tree")
    if not (math.isfinite(tree_penalty) and tree_penalty >= 0):
        raise PlanError(f"tree_penalty must be a finite fraction >= 0 (got {tree_penalty!r}): 0 counts trees free")
    if not (math.isfinite(time_limit) and time_limit > 0):
        raise PlanError(f"time_limit must be a finite number of seconds > 0 (got {time_limit!r})")
    if solver not in SOLVERS:
        raise PlanError(f"solver must be one of {', '.join(SOLVERS)} (got {solver!r})")


def plan_trees(topology: Topology, *, max_trees: int = 8, tree_penalty: float = 0.02, time_limit: float = 5.0,
               solver: str = "highs") -> Plan:
    """The plan of at most `max_trees` weighted trees with the least T + tree_penalty * T_lp * (trees - 1),
    found within about `time_limit` seconds (the best found when the limit hits); see the module docstring."""
    started = time.perf_counter()
    _check(max_trees, tree_penalty, time_limit, solver)
    model = load_model(topology)
    flat_t, flat_link = bottleneck(topology, flat_plan(topology))
    cand = candidates(topology, model)
    if not cand.racks:
        return Plan(flat_plan(topology), flat_t, flat_t, flat_t, "flat", "none", time.perf_counter() - started,
                    flat_link)
    if solver == "highs":
        try:
            import highspy  # noqa: F401 -- only whether it is there
        except ImportError:
            solver = "scipy"
    t_lp, y_lp = lp_bound(model, cand)
    # the aligned construction realises any fractions with 1 + sum |C_r| trees: more slots never help
    slots = min(max_trees, 1 + sum(len(opts) for opts in cand.options))
    unit = tree_penalty * t_lp
    heuristic = warm_start(model, cand, y_lp, slots, unit)
    left = time_limit - (time.perf_counter() - started)
    result = solve_trees(model, cand, slots=slots, t_lp=t_lp, penalty_unit=unit, time_limit=left, solver=solver,
                         warm=canonical(cand, heuristic) if solver == "highs" else None)
    found = finish(model, result.trees) if result.trees else None
    best_heuristic = _score(model, heuristic, unit)
    if found is not None and _score(model, found, unit) < best_heuristic - 1e-9 * best_heuristic:
        trees, status = found, "optimal" if result.proven else "time_limit"
    else:  # the solver found nothing better than its start (proven optimal, or out of time)
        trees, status = heuristic, "optimal" if result.proven else "heuristic"
    specs = _specs(topology, model, trees)
    objective, link = bottleneck(topology, specs)
    return Plan(specs, objective, t_lp, flat_t, status, solver, time.perf_counter() - started, link)
