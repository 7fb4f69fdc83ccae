"""The tree program: the LP bound, the K-slot integer program over aggregators and weights, and weight polish.

Columns of the integer program, for K tree slots t and each rack r that may aggregate, with options
c in C_r (its candidate hosts) plus "direct":
  T >= T_lp (the round bound; the LP bound is valid for every plan), w_t in [0, 1/(t+1)] (slot weights:
  sorted w_1 >= w_2 >= ... summing to 1 give w_t <= 1/t), u_t binary (slot used; u_1 = 1),
  x[t,r,c] binary (c aggregates r in t), y[t,r,c] in [0, 1/(t+1)] (= w_t x[t,r,c]),
  Y[h] = sum_t y[t,r,h] (h's total weight, the y of loads.py).
Rows: sum_t w_t = 1; w_t <= u_t/(t+1); w_t >= w_t+1 and u_t >= u_t+1 (slot symmetry);
  sum_c x[t,r,c] = 1; sum_c y[t,r,c] = w_t with y[t,r,c] <= x[t,r,c]/(t+1), so a chosen option carries
  the whole slot weight (the disaggregated form of y = w x, tighter than y >= w - (1 - x));
  x[t,r,direct] >= 1 - u_t (an unused slot is all direct, so it has a single form);
  every link: const/rate + (coef/rate) @ Y <= T (loads.py).
Interchangeable hosts (same rack, counts, rate and kind) form classes in a fixed order, and a class's
  hosts first aggregate in that order: x[t,r,h_i] <= sum_{s<t} x[s,r,h_i-1] and x[t,r,h_i] = 0 for t < i
  (any plan can be relabelled so: the partitioning orbitope's column order). Hence only the first K
  of a class ever aggregate. Ordering the hosts' total weights instead (Y[h_1] >= Y[h_2] >= ...) is
  valid too, but with it HiGHS took over 20 s to prove 64 workers in 8 racks optimal, against 2-3 s
  with no host symmetry rows (its own symmetry detection) and 0.35 s with these.
Objective: T + penalty_unit * sum_{t>1} u_t. The LP relaxation keeps the bound's value, so branching
closes the gap; symmetry breaking keeps the tree of equivalent branches small.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, linprog, milp
from scipy.sparse import coo_array, csc_array

from sluice.scheduler.hierarchy.loads import LoadModel, Vector

Shape = tuple[int, ...]  # the model columns (loads.LoadModel.hosts) that aggregate in one tree, sorted
INF = float("inf")


@dataclass(frozen=True)
class Candidates:
    racks: tuple[str, ...]  # racks that may aggregate
    options: tuple[tuple[int, ...], ...]  # per rack: its candidate hosts as model columns
    classes: tuple[tuple[int, ...], ...]  # interchangeable hosts, in the order their totals are sorted


@dataclass(frozen=True)
class MilpResult:
    trees: tuple[tuple[float, Shape], ...]  # the solver's slots with weight > 0 (not yet polished)
    proven: bool  # optimal within the gap
    status: str  # the solver's own word, for messages


def _link_rows(model: LoadModel, columns: Sequence[int], scale: float) -> tuple[Vector, Vector]:
    """(coef, const) over rate * scale, coef restricted to `columns`: link l holds const[l] + coef[l] @ y <= T/scale.

    T is some 1e-4 when rates are in Mbit/s; solvers see T/scale with scale near T, so that their
    absolute tolerances (1e-6 and up) stay far below what separates two plans.
    """
    over = model.rates * scale
    return model.coef[:, list(columns)] / over[:, None], model.const / over


def _scale(model: LoadModel) -> float:
    """T of the flat plan: the unit the LPs measure T in."""
    return float(np.max(model.const / model.rates))


def lp_bound(model: LoadModel, cand: Candidates) -> tuple[float, Vector]:
    """(T_lp, y over model.hosts): the best T when any fractions y in [0, 1] with A_r <= 1 are allowed.

    Any such y is realised by enough trees (planner.align), so over plans with these candidates no
    plan beats T_lp, and this LP is the relaxation of the tree program with K unbounded.
    """
    cols = [j for opts in cand.options for j in opts]
    scale = _scale(model)
    coef, const = _link_rows(model, cols, scale)
    n = len(cols)
    racks = np.zeros((len(cand.options), n + 1))
    at = 0
    for i, opts in enumerate(cand.options):
        racks[i, at:at + len(opts)] = 1.0
        at += len(opts)
    a_ub = np.vstack([np.hstack([coef, -np.ones((len(const), 1))]), racks])
    b_ub = np.concatenate([-const, np.ones(len(cand.options))])
    cost = np.zeros(n + 1)
    cost[n] = 1.0
    res = linprog(cost, A_ub=a_ub, b_ub=b_ub, bounds=[(0.0, 1.0)] * n + [(0.0, None)], method="highs")
    if res.status != 0:
        raise RuntimeError(f"the LP bound did not solve: {res.message}")
    y = np.zeros(len(model.hosts))
    y[cols] = np.clip(res.x[:n], 0.0, 1.0)
    return float(res.x[n]) * scale, y


def polish(model: LoadModel, shapes: Sequence[Shape]) -> tuple[Vector, float]:
    """(weights, T): the best weights for trees of these shapes, by an LP over the weights alone."""
    scale = _scale(model)
    coef, const = _link_rows(model, range(len(model.hosts)), scale)
    ind = np.zeros((len(model.hosts), len(shapes)))
    for t, shape in enumerate(shapes):
        ind[list(shape), t] = 1.0
    k = len(shapes)
    a_ub = np.hstack([coef @ ind, -np.ones((len(const), 1))])
    a_eq = np.hstack([np.ones((1, k)), np.zeros((1, 1))])
    cost = np.zeros(k + 1)
    cost[k] = 1.0
    res = linprog(cost, A_ub=a_ub, b_ub=-const, A_eq=a_eq, b_eq=[1.0], bounds=[(0.0, None)] * (k + 1),
                  method="highs")
    if res.status != 0:
        raise RuntimeError(f"the weight LP did not solve: {res.message}")
    weights = np.clip(res.x[:k], 0.0, None)
    return weights / weights.sum(), float(res.x[k]) * scale


class _Program:
    """The integer program's columns and rows (see the module docstring), in arrays both solvers take."""

    def __init__(self, model: LoadModel, cand: Candidates, slots: int, t_lp: float, penalty_unit: float) -> None:
        self.slots, self.cand, self.scale = slots, cand, t_lp  # T/T_lp is the column: see _link_rows
        beyond = {j for cls in cand.classes for j in cls[slots:]}  # past the K-th of a class: always 0
        self.options = [tuple(j for j in opts if j not in beyond) for opts in cand.options]
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.cost: list[float] = []
        self.integer: list[int] = []
        self.entries: list[tuple[int, int, float]] = []
        self.row_lower: list[float] = []
        self.row_upper: list[float] = []
        self.T = self._col(1.0, INF, 1.0)
        self.w = [self._col(0.0, 1.0 / (t + 1), 0.0) for t in range(slots)]
        cost = penalty_unit / t_lp
        self.u = [self._col(1.0 if t == 0 else 0.0, 1.0, 0.0 if t == 0 else cost, True) for t in range(slots)]
        self.x: dict[tuple[int, int, int], int] = {}  # (t, rack index, host column or -1) -> column
        self.y: dict[tuple[int, int, int], int] = {}
        for t in range(slots):
            for i, opts in enumerate(self.options):
                for c in (*opts, -1):
                    self.x[t, i, c] = self._col(0.0, 1.0, 0.0, True)
                    self.y[t, i, c] = self._col(0.0, 1.0 / (t + 1), 0.0)
        hosts = [j for opts in self.options for j in opts]
        self.Y = {j: self._col(0.0, 1.0, 0.0) for j in hosts}
        self._rows(model)

    def _col(self, lower: float, upper: float, cost: float, integer: bool = False) -> int:
        self.lower.append(lower)
        self.upper.append(upper)
        self.cost.append(cost)
        self.integer.append(int(integer))
        return len(self.lower) - 1

    def _row(self, terms: Sequence[tuple[int, float]], lower: float, upper: float) -> None:
        row = len(self.row_lower)
        self.entries += [(row, col, value) for col, value in terms]
        self.row_lower.append(lower)
        self.row_upper.append(upper)

    def _rows(self, model: LoadModel) -> None:
        K = self.slots
        self._row([(w, 1.0) for w in self.w], 1.0, 1.0)
        for t in range(K):
            self._row([(self.w[t], 1.0), (self.u[t], -1.0 / (t + 1))], -INF, 0.0)
            if t + 1 < K:
                self._row([(self.w[t], 1.0), (self.w[t + 1], -1.0)], 0.0, INF)
                self._row([(self.u[t], 1.0), (self.u[t + 1], -1.0)], 0.0, INF)
            for i, opts in enumerate(self.options):
                self._row([(self.x[t, i, c], 1.0) for c in (*opts, -1)], 1.0, 1.0)
                self._row([(self.y[t, i, c], 1.0) for c in (*opts, -1)] + [(self.w[t], -1.0)], 0.0, 0.0)
                for c in (*opts, -1):
                    self._row([(self.y[t, i, c], 1.0), (self.x[t, i, c], -1.0 / (t + 1))], -INF, 0.0)
                self._row([(self.x[t, i, -1], 1.0), (self.u[t], 1.0)], 1.0, INF)
        for i, opts in enumerate(self.options):
            for j in opts:
                self._row([(self.Y[j], 1.0)] + [(self.y[t, i, j], -1.0) for t in range(K)], 0.0, 0.0)
        rack_of = {j: i for i, opts in enumerate(self.options) for j in opts}
        for cls in self.cand.classes:
            kept = [j for j in cls if j in self.Y]
            for rank, j in enumerate(kept):
                i = rack_of[j]
                for t in range(min(rank, K)):  # the class's (rank+1)-th host cannot appear before slot rank+1
                    self.upper[self.x[t, i, j]] = self.upper[self.y[t, i, j]] = 0.0
                if rank > 0:
                    earlier = kept[rank - 1]
                    for t in range(rank, K):
                        self._row([(self.x[t, i, j], 1.0)] + [(self.x[s, i, earlier], -1.0) for s in range(t)],
                                  -INF, 0.0)
        coef, const = _link_rows(model, range(len(model.hosts)), self.scale)
        for link in range(len(const)):
            terms = [(self.Y[j], float(coef[link, j])) for j in self.Y if coef[link, j] != 0.0]
            if terms:
                self._row([*terms, (self.T, -1.0)], -INF, -float(const[link]))

    def matrix(self) -> csc_array:
        rows, cols, values = zip(*self.entries, strict=True)
        return csc_array(coo_array((values, (rows, cols)), shape=(len(self.row_lower), len(self.lower))))

    def point(self, model: LoadModel, trees: Sequence[tuple[float, Shape]]) -> Vector:
        """The column values of a plan of at most K trees, heaviest first, whose classes are sorted."""
        v = np.zeros(len(self.lower))
        total = np.zeros(len(model.hosts))
        for t in range(self.slots):
            weight, shape = trees[t] if t < len(trees) else (0.0, ())
            v[self.w[t]], v[self.u[t]] = weight, float(t < len(trees))
            for i, opts in enumerate(self.options):
                c = next((j for j in shape if j in opts), -1)
                v[self.x[t, i, c]], v[self.y[t, i, c]] = 1.0, weight
                if c >= 0:
                    total[c] += weight
        for j, col in self.Y.items():
            v[col] = total[j]
        coef, const = _link_rows(model, range(len(model.hosts)), self.scale)
        v[self.T] = max(float(np.max(const + coef @ total)), self.lower[self.T])
        return v

    def trees(self, v: Vector) -> tuple[tuple[float, Shape], ...]:
        out = []
        for t in range(self.slots):
            if v[self.w[t]] > 1e-9:
                shape = []
                for i, opts in enumerate(self.options):
                    chosen = [c for c in (*opts, -1) if v[self.x[t, i, c]] > 0.5]  # binaries, up to tolerance
                    if chosen and chosen[0] >= 0:
                        shape.append(chosen[0])
                out.append((float(v[self.w[t]]), tuple(sorted(shape))))
        return tuple(out)


def solve_trees(model: LoadModel, cand: Candidates, *, slots: int, t_lp: float, penalty_unit: float,
                time_limit: float, solver: str, warm: Sequence[tuple[float, Shape]] | None = None,
                gap: float = 1e-4) -> MilpResult:
    """Solve the K-slot program with `solver` ("highs": highspy, with `warm` as the first incumbent;
    "scipy": scipy.optimize.milp); the best solution found within `time_limit` seconds, if any."""
    prog = _Program(model, cand, slots, t_lp, penalty_unit)
    a = prog.matrix()
    if solver == "highs":
        return _solve_highspy(prog, a, model, time_limit, gap, warm)
    res = milp(np.array(prog.cost), integrality=np.array(prog.integer), bounds=Bounds(prog.lower, prog.upper),
               constraints=LinearConstraint(a, prog.row_lower, prog.row_upper),
               options={"time_limit": max(time_limit, 0.01), "mip_rel_gap": gap, "disp": False})
    if res.x is None:
        return MilpResult((), False, str(res.message))
    return MilpResult(prog.trees(res.x), res.status == 0, str(res.message))


def _solve_highspy(prog: _Program, a: csc_array, model: LoadModel, time_limit: float, gap: float,
                   warm: Sequence[tuple[float, Shape]] | None) -> MilpResult:
    import highspy

    # highspy.Highs announces itself on stdout when built; the bare binding stays quiet once output_flag
    # is off, and library code must not print
    h = getattr(highspy, "_Highs", highspy.Highs)()
    for name, value in (("output_flag", False), ("threads", 1), ("time_limit", max(time_limit, 0.01)),
                        ("mip_rel_gap", gap)):
        h.setOptionValue(name, value)
    inf = highspy.kHighsInf
    h.passModel(len(prog.lower), len(prog.row_lower), a.nnz, 1, 1, 0.0, np.array(prog.cost),
                np.clip(prog.lower, -inf, inf), np.clip(prog.upper, -inf, inf),
                np.clip(prog.row_lower, -inf, inf), np.clip(prog.row_upper, -inf, inf),
                a.indptr.astype(np.int32), a.indices.astype(np.int32), a.data.astype(np.float64),
                np.array(prog.integer, dtype=np.int32))
    if warm:
        start = highspy.HighsSolution()
        start.col_value = list(prog.point(model, warm))
        h.setSolution(start)
    h.run()
    status = h.getModelStatus()
    if h.getInfo().primal_solution_status != highspy.kSolutionStatusFeasible:
        return MilpResult((), False, h.modelStatusToString(status))
    v = np.array(h.getSolution().col_value)
    return MilpResult(prog.trees(v), status == highspy.HighsModelStatus.kOptimal, h.modelStatusToString(status))
