"""The network a job's push_pull rounds cross: hosts in racks, spare link rates, and the plans laid over them.

The model. A synchronous push_pull round moves D bytes per worker process each way: every worker
pushes its whole gradient (D bytes, keys spread evenly over the job's S server processes) and
receives the sum (D bytes) back. Links are full duplex and every link carries the same load in both
directions (a push going up is matched by its reply coming down), so one direction is enough.

Two layers of links matter: each host's link to its top-of-rack switch (`Host.link_mbit`) and each
rack's uplink to the core (`Rack.uplink_mbit`), both the spare capacity left to this job, each
direction. Traffic between two hosts of one rack crosses their host links only.

A plan is a set of trees whose weights sum to 1: every tensor's bytes are split across the trees by
weight. In each tree each rack either has one aggregator host (a host of that rack with workers, or
an auxiliary host) or none ("direct": its workers push straight to the servers). An aggregator sums
the pushes of all the rack's workers (those on its own host locally, for free), sends one stream up
to the servers and fans the reply back out. What each plan costs is derived in loads.py; the
planner that chooses one is planner.py.

Round time. With every load in units of D, a link of R Mbit/s carrying load L needs L*D*8/(R*1e6)
seconds. Gather and broadcast overlap (chunks are pipelined), so a round takes as long as its busiest
link: T = max over links of L/R, and `round_seconds(T, D) = T * D * 8 / 1e6`. An aggregator's fan-out
cannot start before the first sums are back from the servers, so with `fanout_share` < 1 the
planner also keeps that traffic within that share of the aggregator's link (loads.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class PlanError(ValueError):
    """A topology, a plan or a planner option that the model cannot use; the message says what to change."""


@dataclass(frozen=True)
class Host:
    name: str
    rack: str
    link_mbit: float  # spare capacity of the host's link left to this job, each direction
    workers: int = 0  # this job's worker processes on the host
    servers: int = 0  # this job's server processes on the host
    aux: bool = False  # runs no worker of this job but may aggregate for it
    can_aggregate: bool = True  # an aggregator process can run here (the job started one on the host)


@dataclass(frozen=True)
class Rack:
    name: str
    uplink_mbit: float  # spare capacity of the rack's uplink to the core left to this job, each direction


@dataclass(frozen=True)
class Topology:
    hosts: tuple[Host, ...]
    racks: tuple[Rack, ...]
    #: the share of an aggregating host's link that its fan-out (the sums it sends back to the rack's
    #: other hosts) may fill in a round; 1: the whole link, the bare overlapped model (see loads.py)
    fanout_share: float = 1.0


@dataclass(frozen=True)
class TreeSpec:
    weight: float
    # (rack name, aggregating host or None for direct); the planner lists every rack, sorted by name,
    # and loads.py reads a rack left out as direct
    aggregators: tuple[tuple[str, str | None], ...]


def round_seconds(bound: float, nbytes: int) -> float:
    """Seconds of a round that moves `nbytes` per worker when the busiest link's load/rate is `bound`."""
    return bound * nbytes * 8 / 1e6


@dataclass(frozen=True)
class Plan:
    trees: tuple[TreeSpec, ...]  # weights sum to 1, heaviest first
    objective: float  # T of this plan, recomputed by loads.bottleneck
    bound: float  # T of the LP relaxation: no plan over the same candidates does better
    flat: float  # T of the flat plan (every rack direct), for comparison
    status: str  # "optimal" | "time_limit" | "heuristic" | "flat"
    solver: str
    solve_seconds: float
    bottleneck_link: str

    def round_seconds(self, nbytes: int) -> float:
        """The bound on one push_pull round of `nbytes` per worker under this plan."""
        return round_seconds(self.objective, nbytes)

    def aggregators(self) -> dict[str, set[str]]:
        """Every rack -> the hosts that aggregate it in some tree (empty where the rack is always direct)."""
        out: dict[str, set[str]] = {}
        for tree in self.trees:
            for rack, host in tree.aggregators:
                out.setdefault(rack, set())
                if host is not None:
                    out[rack].add(host)
        return out


def eligible(host: Host) -> bool:
    """Whether `host` may aggregate its rack: it runs a worker of this job or is an auxiliary node, and
    it can run an aggregator."""
    return (host.workers > 0 or host.aux) and host.can_aggregate


def rack_workers(topology: Topology) -> dict[str, int]:
    """Rack name -> this job's worker processes in it (every rack, 0 where none)."""
    counts = {rack.name: 0 for rack in topology.racks}
    for host in topology.hosts:
        counts[host.rack] += host.workers
    return counts


def oversubscribed(topology: Topology, rack: Rack) -> bool:
    """Whether `rack`'s uplink is below what its worker hosts' links could offer it at once.

    Aggregation pays only where the uplink, not the hosts, limits the rack: with an uplink at least
    the sum of its worker hosts' links, n_r direct streams cross it as fast as the hosts can send them.
    """
    demand = sum(h.link_mbit for h in topology.hosts if h.rack == rack.name and h.workers > 0)
    return rack.uplink_mbit < demand


def _check_rate(what: str, rate: float) -> None:
    if not (math.isfinite(rate) and rate > 0):
        raise PlanError(f"{what} must be a finite rate > 0 Mbit/s (got {rate!r}): give the spare bandwidth "
                        "left to this job, or leave out a link it cannot use")


def validate(topology: Topology) -> None:
    """Raise PlanError naming the first thing in `topology` that the model cannot use."""
    rack_names = [rack.name for rack in topology.racks]
    for names, kind in ((rack_names, "rack"), ([h.name for h in topology.hosts], "host")):
        seen: set[str] = set()
        for name in names:
            if name in seen:
                raise PlanError(f"duplicate {kind} name {name!r}: every {kind} needs its own name")
            seen.add(name)
    for rack in topology.racks:
        _check_rate(f"rack {rack.name!r}: uplink_mbit", rack.uplink_mbit)
    if not (math.isfinite(topology.fanout_share) and 0 < topology.fanout_share <= 1):
        raise PlanError(f"fanout_share must be a fraction in (0, 1] (got {topology.fanout_share!r}): the share of "
                        "an aggregator's link its fan-out may fill, 1 for the whole link")
    known = set(rack_names)
    for host in topology.hosts:
        if host.rack not in known:
            raise PlanError(f"host {host.name!r} names rack {host.rack!r}, which is not in topology.racks: "
                            f"add Rack({host.rack!r}, ...) or fix the host's rack")
        _check_rate(f"host {host.name!r}: link_mbit", host.link_mbit)
        if host.workers < 0 or host.servers < 0:
            raise PlanError(f"host {host.name!r} has a negative count (workers {host.workers}, servers "
                            f"{host.servers}): count this job's processes on it, 0 for none")
        if host.aux and host.workers > 0:
            raise PlanError(f"host {host.name!r} is aux and runs {host.workers} workers: an auxiliary node runs "
                            "no worker of this job; set aux=False or workers=0")
    if not any(h.workers > 0 for h in topology.hosts):
        raise PlanError("no host runs a worker of this job: give at least one Host workers >= 1")
    if not any(h.servers > 0 for h in topology.hosts):
        raise PlanError("no host runs a server of this job: give at least one Host servers >= 1")
