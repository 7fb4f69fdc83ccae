"""Per-link load of a plan, in units of D per round, as an affine function of where racks aggregate.

Notation: N workers and S servers in all; rack r holds n_r workers and S_r servers (sigma_r = S_r/S,
the share of every stream's keys owned by servers in r); host h runs m_h workers and k_h servers.
y[h] is the total weight of the trees in which h aggregates its rack, A_r = sum of y[h] over r's hosts
(the share of the bytes aggregated inside r); the rest, 1 - A_r, goes direct.

- Host link. Where h aggregates (weight y[h]) it sends one stream up and takes the pushes of the
  n_r - m_h workers on other hosts; elsewhere its own m_h workers push: m_h (1 - y[h]) +
  y[h] (1 + n_r - m_h) = m_h + (1 + n_r - 2 m_h) y[h]. An auxiliary host has m_h = 0.
- Streams leaving rack r for the servers: one where r aggregates, n_r where it is direct:
  s_r = A_r + (1 - A_r) n_r = n_r - (n_r - 1) A_r. In all F = sum_r s_r = N - sum_h (n_r(h) - 1) y[h].
- Server host h: its k_h/S of the keys of every stream, F k_h / S, on top of its workers' load
  (conservatively: a worker's share for a server on its own host is counted although it stays local).
- Rack r's uplink: its streams' keys owned outside, s_r (1 - sigma_r), plus the other racks' streams'
  keys owned inside, (F - s_r) sigma_r: u_r = s_r (1 - 2 sigma_r) + F sigma_r.

- Fan-out of host h (topology.fanout_share < 1): the sums h sends back to the workers on the rack's
  other hosts, (n_r - m_h) y[h], over share x its link's rate. That traffic waits for the first sums to
  come back from the servers, so it cannot fill the link for the whole round: an auxiliary host, which
  carries nothing else, idled for the first half of each round on the 4:1 testbed while its fan-out
  ran on after every other link was done (bench/aggregation.py). These rows ("fanout:NAME") are not
  links; `link_loads` leaves them out.

Each is c + b.y for constants c and b, so a link's load over its rate is affine in y; the LP bound and
the tree program (milp.py) use exactly these rows, and `link_loads` evaluates them for any trees.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from sluice.scheduler.hierarchy.topology import (
    PlanError,
    Topology,
    TreeSpec,
    eligible,
    rack_workers,
    round_seconds,
    validate,
)

__all__ = ["LoadModel", "bottleneck", "flat_plan", "host_weights", "link_loads", "load_model", "round_seconds"]

Vector = npt.NDArray[np.float64]

#: weights of a plan may miss 1 by this much (rounding in solvers and in JSON)
WEIGHT_TOLERANCE = 1e-6


@dataclass(frozen=True)
class LoadModel:
    """Link loads as const + coef @ y, y over `hosts` (every host that may aggregate its rack)."""

    links: tuple[str, ...]  # "host:NAME" for every host, then "uplink:RACK" for every rack
    rates: Vector  # Mbit/s of each link
    const: Vector  # load of each link in the flat plan (y = 0), units of D
    coef: Vector  # links x hosts: d load / d y[h]
    hosts: tuple[str, ...]
    host_rack: tuple[str, ...]  # the rack of each of `hosts`
    racks: tuple[str, ...]  # every rack of the topology

    def loads(self, y: Vector) -> Vector:
        return self.const + self.coef @ y

    def times(self, y: Vector) -> Vector:
        """Load over rate of every link: the round time each link alone would allow, per unit of D in Mbit."""
        return self.loads(y) / self.rates


def load_model(topology: Topology) -> LoadModel:
    """The affine load rows of `topology` (validated first); see the module docstring for the derivation."""
    validate(topology)
    n = rack_workers(topology)
    total_workers = sum(n.values())
    total_servers = sum(h.servers for h in topology.hosts)
    sigma = {rack.name: 0.0 for rack in topology.racks}
    for host in topology.hosts:
        sigma[host.rack] += host.servers / total_servers
    # hosts in racks without workers have nothing to aggregate, so they get no column
    agg = [h for h in topology.hosts if eligible(h) and n[h.rack] > 0]
    column = {h.name: j for j, h in enumerate(agg)}
    # dF/dy[h]: an aggregating host turns n_r streams into one
    d_flow = np.array([-(n[h.rack] - 1.0) for h in agg])
    links, rates, const, rows = [], [], [], []
    for host in topology.hosts:
        row = d_flow * (host.servers / total_servers)
        if host.name in column:
            row[column[host.name]] += 1 + n[host.rack] - 2 * host.workers
        links.append(f"host:{host.name}")
        rates.append(host.link_mbit)
        const.append(host.workers + total_workers * host.servers / total_servers)
        rows.append(row)
    for rack in topology.racks:
        s = sigma[rack.name]
        row = d_flow * s
        for h in agg:
            if h.rack == rack.name:
                row[column[h.name]] += -(n[rack.name] - 1.0) * (1 - 2 * s)
        links.append(f"uplink:{rack.name}")
        rates.append(rack.uplink_mbit)
        const.append(n[rack.name] * (1 - 2 * s) + total_workers * s)
        rows.append(row)
    if topology.fanout_share < 1:
        for host in agg:
            row = np.zeros(len(agg))
            row[column[host.name]] = n[host.rack] - host.workers
            links.append(f"fanout:{host.name}")
            rates.append(host.link_mbit * topology.fanout_share)
            const.append(0.0)
            rows.append(row)
    return LoadModel(
        links=tuple(links), rates=np.array(rates, dtype=np.float64), const=np.array(const, dtype=np.float64),
        coef=np.array(rows, dtype=np.float64).reshape(len(links), len(agg)),
        hosts=tuple(h.name for h in agg), host_rack=tuple(h.rack for h in agg),
        racks=tuple(rack.name for rack in topology.racks),
    )


def host_weights(model: LoadModel, trees: Sequence[TreeSpec]) -> Vector:
    """y over `model.hosts`: the total weight of the trees in which each aggregates; PlanError for bad trees."""
    if not trees:
        raise PlanError("a plan needs at least one tree: use flat_plan() for no aggregation")
    weights = [t.weight for t in trees]
    if any(not (w >= 0 and np.isfinite(w)) for w in weights) or abs(sum(weights) - 1) > WEIGHT_TOLERANCE:
        raise PlanError(f"tree weights must be finite, >= 0 and sum to 1 (got {weights}): renormalise them")
    column = {name: j for j, name in enumerate(model.hosts)}
    racks = set(model.racks)
    y = np.zeros(len(model.hosts))
    for index, tree in enumerate(trees):
        named: set[str] = set()
        for rack, host in tree.aggregators:
            if rack not in racks:
                raise PlanError(f"tree {index} names rack {rack!r}, which is not in the topology")
            if rack in named:
                raise PlanError(f"tree {index} names rack {rack!r} twice: give each rack one aggregator or None")
            named.add(rack)
            if host is None:
                continue
            j = column.get(host)
            if j is None or model.host_rack[j] != rack:
                raise PlanError(f"tree {index} makes {host!r} aggregate rack {rack!r}: an aggregator must be a "
                                "host of that rack with workers of this job, or an aux host of a rack with workers")
            y[j] += tree.weight
    return y


def link_loads(topology: Topology, trees: Sequence[TreeSpec]) -> dict[str, float]:
    """Every link ("host:NAME", "uplink:RACK") -> its load per round under `trees`, in units of D."""
    model = load_model(topology)
    loads = model.loads(host_weights(model, trees))
    return {link: float(load) for link, load in zip(model.links, loads, strict=True) if not link.startswith("fanout:")}


def bottleneck(topology: Topology, trees: Sequence[TreeSpec]) -> tuple[float, str]:
    """(T, the busiest link): T = max of load/rate over the links, round seconds = T * D * 8 / 1e6."""
    model = load_model(topology)
    times = model.times(host_weights(model, trees))
    worst = int(np.argmax(times))
    return float(times[worst]), model.links[worst]


def flat_plan(topology: Topology | None = None) -> tuple[TreeSpec, ...]:
    """One tree, every rack direct (racks listed when `topology` is given; a rack left out is direct anyway)."""
    racks = () if topology is None else tuple(sorted((rack.name, None) for rack in topology.racks))
    return (TreeSpec(1.0, racks),)
