"""Where a job's nodes sit: the planner's topology, and a host-level plan turned into node-level routes.

The topology comes from the configured racks and the address book.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from sluice.scheduler.hierarchy.config import AggregationConfig
from sluice.scheduler.hierarchy.routes import SERVERS, Route
from sluice.scheduler.hierarchy.topology import Host, Plan, PlanError, Rack, Topology


@dataclass(frozen=True)
class NodeAt:
    """One node of the job and the host it runs on (its address as it registered)."""

    name: str  # worker-3, server-0, aggregator-1
    role: str
    address: str


def _rates(entries: Sequence[str], what: str) -> dict[str, float]:
    """Config entries "NAME: MBIT" -> {NAME: MBIT}."""
    rates = {}
    for entry in entries:
        name, colon, value = entry.partition(":")
        try:
            rate = float(value)
        except ValueError:
            rate = -1.0
        if not colon or not name.strip() or not rate > 0:
            raise PlanError(f"aggregation.{what} entry {entry!r} must be \"NAME: MBIT\" with a positive rate")
        rates[name.strip()] = rate
    return rates


@dataclass(frozen=True)
class Placement:
    """A formed job in its racks, worked out once: each node's host, each host's rack, the topology at
    the configured rates, and the aggregator node that serves each host that has one."""

    nodes: tuple[NodeAt, ...]
    host: dict[str, str]  # node name -> host
    rack: dict[str, str]  # host -> rack
    configured: Topology
    aggregator_at: dict[str, str]

    def topology(self, spare: Mapping[str, float]) -> Topology:
        """The topology with measured spare rates (by host and "uplink:RACK") in place of configured ones."""
        if not spare:
            return self.configured
        hosts = tuple(replace(h, link_mbit=spare.get(h.name, h.link_mbit)) for h in self.configured.hosts)
        racks = tuple(replace(r, uplink_mbit=spare.get(f"uplink:{r.name}", r.uplink_mbit))
                      for r in self.configured.racks)
        return replace(self.configured, hosts=hosts, racks=racks)

    def routes(self, plan: Plan) -> list[Route]:
        """Node-level trees: in each tree a rack's workers send to the aggregator node on the host the
        plan chose for the rack (the workers on that host too, locally), and it sends to the servers."""
        routes = []
        for tree in plan.trees:
            chosen = dict(tree.aggregators)
            parents: dict[str, str] = {}
            for node in self.nodes:
                host = chosen.get(self.rack[self.host[node.name]]) if node.role == "worker" else None
                if host is None:
                    continue
                aggregator = self.aggregator_at.get(host)
                if aggregator is None:
                    raise PlanError(f"the plan aggregates at host {host!r}, which runs no aggregator")
                parents[node.name] = aggregator
                parents[aggregator] = SERVERS
            routes.append(Route(tree.weight, parents))
        return routes


def place(config: AggregationConfig, nodes: Sequence[NodeAt]) -> Placement:
    """The job's placement from aggregation.racks, which lists hosts per rack: each an address, or node
    names joined by "+" (a host of their own, as on one machine standing in for several).

    Host links run at aggregation.link_mbit or their `links` entry; a rack's uplink at its `uplinks`
    entry, else aggregation.uplink_mbit, else (0) the sum of its hosts' links: not oversubscribed.
    A host with an aggregator and no worker is an auxiliary node; only hosts with an aggregator may
    aggregate.
    """
    rack_of_host: dict[str, str] = {}
    for entry in config.racks:
        rack, colon, listed = entry.partition(":")
        rack = rack.strip()
        if not colon or not rack or not listed.split():
            raise PlanError(f"aggregation.racks entry {entry!r} must be \"RACK: HOST HOST ...\"")
        for host in listed.split():
            if host in rack_of_host:
                raise PlanError(f"host {host!r} is listed in racks {rack_of_host[host]!r} and {rack!r}")
            rack_of_host[host] = rack
    by_name = {name: host for host in rack_of_host for name in host.split("+")}
    placed = {}
    for node in nodes:
        found = by_name.get(node.name) or (node.address if node.address in rack_of_host else None)
        if found is None:
            raise PlanError(f"{node.name} (at {node.address}) is in no rack of aggregation.racks: list its address "
                            f"or its name in the rack it sits in")
        placed[node.name] = found
    links, uplinks = _rates(config.links, "links"), _rates(config.uplinks, "uplinks")
    counts: dict[str, dict[str, int]] = {host: {"worker": 0, "server": 0, "aggregator": 0} for host in rack_of_host}
    aggregator_at: dict[str, str] = {}
    for node in sorted(nodes, key=lambda n: (n.role, int(n.name.rpartition("-")[2]))):
        host = placed[node.name]
        counts[host][node.role] += 1
        if node.role == "aggregator":
            aggregator_at.setdefault(host, node.name)  # the lowest-ranked one serves its host
    hosts = []
    for host, rack in rack_of_host.items():
        count = counts[host]
        if not any(count.values()):
            continue
        hosts.append(Host(host, rack, links.get(host, config.link_mbit), count["worker"], count["server"],
                          aux=count["aggregator"] > 0 and count["worker"] == 0,
                          can_aggregate=count["aggregator"] > 0))
    racks = []
    for rack in dict.fromkeys(rack_of_host.values()):
        default = config.uplink_mbit or sum(h.link_mbit for h in hosts if h.rack == rack) or config.link_mbit
        racks.append(Rack(rack, uplinks.get(rack, default)))
    return Placement(tuple(nodes), placed, rack_of_host, Topology(tuple(hosts), tuple(racks), config.fanout_share),
                     aggregator_at)
