"""The tree planner and its load model: literal loads, bounds and plans worked out by hand from the model."""

from __future__ import annotations

import math
import sys
from dataclasses import replace

import pytest

from sluice.scheduler.hierarchy.loads import bottleneck, flat_plan, link_loads, round_seconds
from sluice.scheduler.hierarchy.planner import plan_trees
from sluice.scheduler.hierarchy.topology import (
    Host,
    Plan,
    PlanError,
    Rack,
    Topology,
    TreeSpec,
    oversubscribed,
    validate,
)


def four_racks(uplink: float = 40.0, aux_mbit: float | None = None) -> Topology:
    """4 racks of 4 one-worker hosts (40 Mbit/s each), and 4 one-server hosts of 40 Mbit/s in a 5th rack
    whose uplink (160) carries all their links; with `aux_mbit` one aux host per worker rack."""
    hosts = [Host(f"w{r}{i}", f"r{r}", 40.0, workers=1) for r in range(4) for i in range(4)]
    if aux_mbit is not None:
        hosts += [Host(f"a{r}", f"r{r}", aux_mbit, aux=True) for r in range(4)]
    hosts += [Host(f"s{i}", "rs", 40.0, servers=1) for i in range(4)]
    racks = [Rack(f"r{r}", uplink) for r in range(4)] + [Rack("rs", 160.0)]
    return Topology(tuple(hosts), tuple(racks))


def shares(plan: Plan) -> dict[str, float]:
    """Host -> the total weight of the trees in which it aggregates."""
    out: dict[str, float] = {}
    for tree in plan.trees:
        for _, host in tree.aggregators:
            if host is not None:
                out[host] = out.get(host, 0.0) + tree.weight
    return out


# ---------------------------------------------------------------------------- the load model
TWO_RACKS = Topology(
    hosts=(Host("a0", "ra", 10.0, workers=1), Host("a1", "ra", 10.0, workers=1), Host("b0", "rb", 10.0, workers=1),
           Host("b1", "rb", 10.0, workers=1), Host("s0", "rs", 20.0, servers=1), Host("s1", "rs", 20.0, servers=1)),
    racks=(Rack("ra", 10.0), Rack("rb", 8.0), Rack("rs", 100.0)),
)
# tree 1 (0.75): ra aggregates at a0, rb direct; tree 2 (0.25): ra at a1, rb at b0
TWO_TREES = (TreeSpec(0.75, (("ra", "a0"), ("rb", None), ("rs", None))),
             TreeSpec(0.25, (("ra", "a1"), ("rb", "b0"), ("rs", None))))
# y: a0 .75, a1 .25, b0 .25; host m + (1 + n - 2m) y; s_ra = 2 - A = 1, s_rb = 2 - .25 = 1.75, F = 2.75,
# each server host F/2, the servers' uplink (sigma 1) F
TWO_TREE_LOADS = {"host:a0": 1.75, "host:a1": 1.25, "host:b0": 1.25, "host:b1": 1.0, "host:s0": 1.375,
                  "host:s1": 1.375, "uplink:ra": 1.0, "uplink:rb": 1.75, "uplink:rs": 2.75}
FLAT_LOADS = {"host:a0": 1.0, "host:a1": 1.0, "host:b0": 1.0, "host:b1": 1.0, "host:s0": 2.0, "host:s1": 2.0,
              "uplink:ra": 2.0, "uplink:rb": 2.0, "uplink:rs": 4.0}


def test_link_loads_of_a_hand_written_two_tree_plan() -> None:
    assert link_loads(TWO_RACKS, TWO_TREES) == pytest.approx(TWO_TREE_LOADS, abs=1e-12)
    assert bottleneck(TWO_RACKS, TWO_TREES) == pytest.approx((1.75 / 8.0, "uplink:rb"))
    assert link_loads(TWO_RACKS, flat_plan()) == pytest.approx(FLAT_LOADS, abs=1e-12)
    assert link_loads(TWO_RACKS, flat_plan(TWO_RACKS)) == link_loads(TWO_RACKS, flat_plan())
    assert bottleneck(TWO_RACKS, flat_plan()) == pytest.approx((0.25, "uplink:rb"))
    assert round_seconds(0.25, 1 << 20) == pytest.approx(0.25 * 8 * (1 << 20) / 1e6)


def test_four_racks_flat_loads_and_oversubscription() -> None:
    topo = four_racks()
    loads = link_loads(topo, flat_plan())
    assert {loads[f"host:w{r}{i}"] for r in range(4) for i in range(4)} == {1.0}
    assert [loads[f"host:s{i}"] for i in range(4)] == [4.0] * 4  # F = 16 streams over 4 servers
    assert [loads[f"uplink:r{r}"] for r in range(4)] == [4.0] * 4 and loads["uplink:rs"] == 16.0
    assert [oversubscribed(topo, rack) for rack in topo.racks] == [True] * 4 + [False]
    assert not any(oversubscribed(four_racks(160.0), rack) for rack in four_racks(160.0).racks)


BAD_TOPOLOGIES = [
    (Topology((Host("s", "r", 10.0, servers=1),), (Rack("r", 10.0),)), "no host runs a worker"),
    (Topology((Host("w", "r", 10.0, workers=1),), (Rack("r", 10.0),)), "no host runs a server"),
    (Topology((Host("w", "r", 0.0, workers=1, servers=1),), (Rack("r", 10.0),)), "link_mbit must be a finite rate"),
    (Topology((Host("w", "r", 10.0, workers=1, servers=1),), (Rack("r", math.inf),)), "uplink_mbit must be a finite"),
    (Topology((Host("w", "r", math.nan, workers=1, servers=1),), (Rack("r", 10.0),)), "finite rate > 0"),
    (Topology((Host("w", "x", 10.0, workers=1, servers=1),), (Rack("r", 10.0),)), "names rack 'x', which is not"),
    (Topology((Host("w", "r", 10.0, workers=1), Host("w", "r", 10.0, servers=1)), (Rack("r", 10.0),)),
     "duplicate host name 'w'"),
    (Topology((Host("w", "r", 10.0, workers=1, servers=1),), (Rack("r", 10.0), Rack("r", 5.0))),
     "duplicate rack name 'r'"),
    (Topology((Host("w", "r", 10.0, workers=1, servers=1), Host("a", "r", 10.0, workers=2, aux=True)),
              (Rack("r", 10.0),)), "is aux and runs 2 workers"),
    (Topology((Host("w", "r", 10.0, workers=1, servers=-1),), (Rack("r", 10.0),)), "has a negative count"),
    (Topology((Host("w", "r", 10.0, workers=1, servers=1),), (Rack("r", 10.0),), 0.0), "fanout_share must be a"),
    (Topology((Host("w", "r", 10.0, workers=1, servers=1),), (Rack("r", 10.0),), 1.5), "fanout_share must be a"),
]


@pytest.mark.parametrize(("topology", "message"), BAD_TOPOLOGIES)
def test_invalid_topologies_raise_plan_error(topology: Topology, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        validate(topology)
    with pytest.raises(PlanError, match=message):
        plan_trees(topology)


BAD_TREES = [
    ((TreeSpec(0.5, (("ra", "a0"),)),), "sum to 1"),
    ((TreeSpec(1.0, (("rx", None),)),), "names rack 'rx'"),
    ((TreeSpec(1.0, (("ra", "a0"), ("ra", None))),), "names rack 'ra' twice"),
    ((TreeSpec(1.0, (("ra", "b0"),)),), "makes 'b0' aggregate rack 'ra'"),
    ((TreeSpec(1.0, (("rs", "s0"),)),), "makes 's0' aggregate rack 'rs'"),
    ((), "at least one tree"),
]


@pytest.mark.parametrize(("trees", "message"), BAD_TREES)
def test_invalid_trees_raise_plan_error(trees: tuple[TreeSpec, ...], message: str) -> None:
    with pytest.raises(PlanError, match=message):
        link_loads(TWO_RACKS, trees)


@pytest.mark.parametrize(("options", "message"), [
    ({"max_trees": 0}, "max_trees must be an integer >= 1"), ({"tree_penalty": -0.1}, "tree_penalty must be"),
    ({"time_limit": 0.0}, "time_limit must be"), ({"solver": "cplex"}, "solver must be one of highs, scipy"),
])
def test_invalid_options_raise_plan_error(options: dict[str, object], message: str) -> None:
    with pytest.raises(PlanError, match=message):
        plan_trees(four_racks(), **options)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- plans
def test_one_rack_is_flat() -> None:
    hosts = [Host(f"w{i}", "r", 40.0, workers=1) for i in range(4)] + [Host("s", "r", 40.0, servers=1)]
    topo = Topology(tuple(hosts), (Rack("r", 1000.0),))
    plan = plan_trees(topo)
    assert plan.status == "flat" and plan.trees == flat_plan(topo)
    assert plan.objective == plan.bound == plan.flat == pytest.approx(4 / 40)  # the server host takes 4 streams
    assert plan.bottleneck_link == "host:s" and plan.aggregators() == {"r": set()}


def test_one_to_one_uplinks_stay_flat() -> None:
    plan = plan_trees(four_racks(uplink=160.0))
    assert plan.status == "flat" and plan.objective == plan.bound == plan.flat == pytest.approx(0.1)
    assert plan.bottleneck_link == "host:s0"  # 16 streams over 4 server hosts; the uplinks carry 4/160


def test_four_to_one_uplinks_aggregate_every_rack_at_every_host() -> None:
    # LP: host 1 + 3y, uplink 4 - 12y, servers F/4 = the same: y = 1/5, T = 1.6/40 (2.5x better than flat)
    plan = plan_trees(four_racks(), tree_penalty=0.0)
    assert plan.status == "optimal" and plan.solver == "highs"
    assert plan.flat == pytest.approx(0.1) and plan.bound == pytest.approx(0.04)
    assert plan.objective == pytest.approx(0.04, abs=1e-6)
    assert shares(plan) == pytest.approx({f"w{r}{i}": 0.2 for r in range(4) for i in range(4)}, abs=1e-6)
    assert plan.round_seconds(1 << 20) == pytest.approx(0.04 * 8 * (1 << 20) / 1e6, rel=1e-6)
    # with the default penalty: exactly five trees (four hosts and direct in every rack) of 0.2 each
    plan = plan_trees(four_racks())
    assert [t.weight for t in plan.trees] == pytest.approx([0.2] * 5, abs=1e-6)
    assert plan.aggregators() == {**{f"r{r}": {f"w{r}{i}" for i in range(4)} for r in range(4)}, "rs": set()}
    assert all(tree.aggregators[-1] == ("rs", None) for tree in plan.trees)


# trees k = 1..5 allow T = 4, 2.5, 2, 1.75, 1.6 (/40); a tree more pays when the gain beats penalty * 1.6
PENALTIES = [(0.05, 5, 1.6), (0.1, 4, 1.75), (0.2, 3, 2.0), (0.5, 2, 2.5), (1.0, 1, 4.0)]


@pytest.mark.parametrize(("penalty", "trees", "units"), PENALTIES)
def test_tree_penalty_trades_trees_for_time(penalty: float, trees: int, units: float) -> None:
    plan = plan_trees(four_racks(), tree_penalty=penalty)
    assert len(plan.trees) == trees and plan.objective == pytest.approx(units / 40, abs=1e-7)


def test_trees_fall_with_the_penalty_and_one_slot_gives_one_tree() -> None:
    counts = [len(plan_trees(four_racks(), tree_penalty=p).trees) for p in (0.0, 0.05, 0.1, 0.2, 0.5, 1.0)]
    assert counts[0] >= 5 and counts == sorted(counts, reverse=True)
    single = plan_trees(four_racks(), max_trees=1)
    assert len(single.trees) == 1 and single.objective == pytest.approx(0.1)


def test_a_full_rate_aux_host_takes_the_largest_share() -> None:
    # aux 5 y_a, worker 1 + 3 y_w, uplink 4 - 3 (y_a + 4 y_w), all equal: T = 8/5.6 units = 1/28
    plan = plan_trees(four_racks(aux_mbit=40.0))
    assert plan.bound == pytest.approx(1 / 28) and plan.objective == pytest.approx(1 / 28, abs=1e-6)
    assert len(plan.trees) == 6 and plan.status == "optimal"
    got = shares(plan)
    assert [got[f"a{r}"] for r in range(4)] == pytest.approx([2 / 7] * 4, abs=1e-6)
    assert [got[f"w{r}{i}"] for r in range(4) for i in range(4)] == pytest.approx([1 / 7] * 16, abs=1e-6)


def test_a_fanout_share_keeps_an_aux_hosts_fanout_to_that_share_of_its_link() -> None:
    # fan-out 4 y_a <= 0.5 * 40 T binds: y_a = 5 T; worker 1 + 3 y_w = 40 T; uplink 4 - 3 (y_a + 4 y_w) = 40 T:
    # 8 - 175 T = 40 T, T = 8/215 (0.0372 against 1/28 = 0.0357 with the whole link), y_w = 35/215
    topology = replace(four_racks(aux_mbit=40.0), fanout_share=0.5)
    plan = plan_trees(topology)
    assert plan.objective == pytest.approx(8 / 215, abs=1e-6) and plan.bound == pytest.approx(8 / 215)
    got = shares(plan)
    assert [got[f"a{r}"] for r in range(4)] == pytest.approx([40 / 215] * 4, abs=1e-6)
    assert [got[f"w{r}{i}"] for r in range(4) for i in range(4)] == pytest.approx([35 / 215] * 16, abs=1e-6)
    # the fan-out rows constrain the plan; they are no links: loads and the bare bound are the links' own
    assert not any(link.startswith("fanout:") for link in link_loads(topology, plan.trees))
    assert link_loads(topology, plan.trees) == pytest.approx(link_loads(four_racks(aux_mbit=40.0), plan.trees))
    assert bottleneck(four_racks(aux_mbit=40.0), plan.trees)[0] == pytest.approx(8 / 215, abs=1e-6)


def test_a_thin_aux_host_is_not_worth_a_tree() -> None:
    # at 2 Mbit/s the aux takes y_a = 0.4 T: T = 8/201.2 = 0.03976, 0.6% below 0.04, worth less than a tree
    free = plan_trees(four_racks(aux_mbit=2.0), tree_penalty=0.0)
    assert free.objective == pytest.approx(8 / 201.2, abs=1e-7) and free.bound == pytest.approx(8 / 201.2)
    assert [shares(free)[f"a{r}"] for r in range(4)] == pytest.approx([0.4 * 8 / 201.2] * 4, abs=1e-6)
    priced = plan_trees(four_racks(aux_mbit=2.0))
    assert priced.objective == pytest.approx(plan_trees(four_racks()).objective) == pytest.approx(0.04)
    assert not set(shares(priced)) & {f"a{r}" for r in range(4)} and len(priced.trees) == 5


def test_both_backends_agree() -> None:
    highs = plan_trees(four_racks(), tree_penalty=0.0, solver="highs")
    scipy = plan_trees(four_racks(), tree_penalty=0.0, solver="scipy")
    assert scipy.solver == "scipy" and scipy.status == highs.status == "optimal"
    assert scipy.objective == pytest.approx(highs.objective, abs=1e-7) == pytest.approx(0.04, abs=1e-6)


def test_without_highspy_the_planner_uses_scipy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "highspy", None)  # makes `import highspy` raise ImportError
    plan = plan_trees(four_racks(), max_trees=4)
    assert plan.solver == "scipy" and plan.objective == pytest.approx(1.75 / 40, abs=1e-7)


def test_a_time_limit_too_short_for_the_solver_still_gives_a_plan() -> None:
    plan = plan_trees(four_racks(aux_mbit=40.0), time_limit=1e-6)
    assert plan.status in ("heuristic", "time_limit", "optimal")
    assert plan.bound <= plan.objective <= plan.flat
    assert sum(t.weight for t in plan.trees) == pytest.approx(1.0) and len(plan.trees) <= 8
    assert (plan.objective, plan.bottleneck_link) == bottleneck(four_racks(aux_mbit=40.0), plan.trees)


def test_a_plan_is_recomputed_by_the_load_model() -> None:
    topo = four_racks(aux_mbit=10.0)
    plan = plan_trees(topo, tree_penalty=0.01)
    assert (plan.objective, plan.bottleneck_link) == bottleneck(topo, plan.trees)
    assert [t.weight for t in plan.trees] == sorted((t.weight for t in plan.trees), reverse=True)
    assert min(t.weight for t in plan.trees) >= 1e-4 and sum(t.weight for t in plan.trees) == pytest.approx(1.0)
    assert all([rack for rack, _ in t.aggregators] == ["r0", "r1", "r2", "r3", "rs"] for t in plan.trees)
    assert plan.bound <= plan.objective + 1e-12 and plan.solve_seconds > 0


@pytest.mark.parametrize("share", [0.0, -0.5, 1.01])
def test_the_config_refuses_a_fanout_share_outside_0_to_1(share: float) -> None:
    from sluice.scheduler.hierarchy.config import AggregationConfig

    with pytest.raises(ValueError, match=r"aggregation\.fanout_share must be a fraction"):
        AggregationConfig(fanout_share=share)
    assert AggregationConfig().fanout_share == 0.5
