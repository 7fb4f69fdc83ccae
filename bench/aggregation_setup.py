"""The aggregation benchmark's racks, its four configurations, and the round time the model predicts for each."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sluice.scheduler.hierarchy.config import AggregationConfig
from sluice.scheduler.hierarchy.loads import bottleneck, flat_plan
from sluice.scheduler.hierarchy.planner import plan_trees
from sluice.scheduler.hierarchy.topology import Host, Rack, Topology, TreeSpec, round_seconds
from testbed.netbed import Netbed

FLAT, ONE_PER_RACK, PLANNED, AUX = "flat PS", "one per rack", "planned", "planned+aux"
#: TCP payload per byte on the wire with 1500-byte frames (headers count against the shaper's rate)
PAYLOAD_EFFICIENCY = 0.957
#: the server rack's uplink is not shaped: model it as this wide
UNSHAPED_MBIT = 100_000.0
#: the planner's limits in the benchmark (the defaults of [aggregation])
MAX_TREES, TREE_PENALTY, TIME_LIMIT = 8, 0.02, 5.0


@dataclass(frozen=True)
class Layout:
    racks: int
    per_rack: int
    servers: int
    link_mbit: float
    ratio: int
    #: the servers' links: by default as wide as a rack's hosts together (4 x 20), so that flat PS is
    #: paced by the rack uplinks where they are oversubscribed, not by the servers
    server_mbit: float = 0.0
    #: aggregation.fanout_share the scheduler plans with
    fanout_share: float = AggregationConfig.fanout_share

    @property
    def server_link(self) -> float:
        return self.server_mbit or self.per_rack * self.link_mbit

    @property
    def uplink_mbit(self) -> float:
        return self.per_rack * self.link_mbit / self.ratio

    def rack_hosts(self, rack: int) -> list[str]:
        return [f"w{rack}x{i}" for i in range(self.per_rack)]

    @property
    def worker_hosts(self) -> list[str]:
        return [h for r in range(self.racks) for h in self.rack_hosts(r)]

    @property
    def server_hosts(self) -> list[str]:
        return [f"s{i}" for i in range(self.servers)]

    @property
    def aux_hosts(self) -> list[str]:
        return [f"a{r}" for r in range(self.racks)]

    def aggregator_hosts(self, case: str) -> list[str]:
        """Where the case runs aggregator processes, by aggregator rank."""
        if case == ONE_PER_RACK:
            return [self.rack_hosts(r)[0] for r in range(self.racks)]
        if case == PLANNED:
            return self.worker_hosts
        if case == AUX:
            return self.worker_hosts + self.aux_hosts
        return []


def build_testbed(bed: Netbed, layout: Layout, tos_classes: tuple[int, ...] = ()) -> None:
    """Worker racks behind shaped uplinks, the servers' rack unshaped, the scheduler on the core; `tos_classes`:
    DSCP classes served in that order on every shaped link (Netbed's), as data centre switches do."""
    for r in range(layout.racks):
        bed.rack(f"r{r}", uplink_mbit=layout.uplink_mbit, tos_classes=tos_classes)
        for host in [*layout.rack_hosts(r), layout.aux_hosts[r]]:
            bed.host(host, layout.link_mbit, rack=f"r{r}", tos_classes=tos_classes)
    bed.rack("srv")
    for host in layout.server_hosts:
        bed.host(host, layout.server_link, rack="srv", tos_classes=tos_classes)
    bed.host("sched")
    for host in bed.hosts:
        bed.sysctl(host, "net.ipv4.tcp_slow_start_after_idle", "0")


def job_config(layout: Layout, case: str, chunk_kib: int, bed: Netbed) -> dict[str, dict[str, Any]]:
    transport = {"chunk_bytes": chunk_kib << 10, "inflight_bytes": chunk_kib << 10}
    if case == FLAT:
        return {"transport": transport}
    if case == ONE_PER_RACK:
        edges = " ".join(f"worker-{r * layout.per_rack + i}>aggregator-{r}"
                         for r in range(layout.racks) for i in range(layout.per_rack))
        return {"transport": transport, "aggregation": {"mode": "static", "trees": [f"1: {edges}"]}}
    address = {name: host.address for name, host in bed.hosts.items()}
    hosts = layout.worker_hosts + (layout.aux_hosts if case == AUX else [])
    racks = [f"r{r}: " + " ".join(address[h] for h in hosts if h in layout.rack_hosts(r) or h == f"a{r}")
             for r in range(layout.racks)]
    racks.append("srv: " + " ".join(address[h] for h in layout.server_hosts))
    return {"transport": transport, "aggregation": {
        "mode": "plan", "racks": racks, "link_mbit": layout.link_mbit, "uplink_mbit": layout.uplink_mbit,
        "links": [f"{address[h]}: {layout.server_link}" for h in layout.server_hosts],
        "uplinks": [f"srv: {UNSHAPED_MBIT}"], "max_trees": MAX_TREES, "tree_penalty": TREE_PENALTY,
        "time_limit": TIME_LIMIT, "fanout_share": layout.fanout_share}}


def topology(layout: Layout, aux: bool, fanout_share: float = 1.0) -> Topology:
    hosts = [Host(h, f"r{r}", layout.link_mbit, workers=1) for r in range(layout.racks) for h in layout.rack_hosts(r)]
    if aux:
        hosts += [Host(a, f"r{r}", layout.link_mbit, aux=True) for r, a in enumerate(layout.aux_hosts)]
    hosts += [Host(s, "srv", layout.server_link, servers=1) for s in layout.server_hosts]
    racks = [Rack(f"r{r}", layout.uplink_mbit) for r in range(layout.racks)] + [Rack("srv", UNSHAPED_MBIT)]
    return Topology(tuple(hosts), tuple(racks), fanout_share)


def trees_of(layout: Layout, case: str) -> tuple[Topology, tuple[TreeSpec, ...]]:
    """The case's topology (its links at their full rates) and trees, as the scheduler plans them."""
    top = topology(layout, case == AUX)
    if case == FLAT:
        return top, flat_plan(top)
    if case == ONE_PER_RACK:
        return top, (TreeSpec(1.0, tuple((f"r{r}", layout.rack_hosts(r)[0]) for r in range(layout.racks))),)
    planned = topology(layout, case == AUX, layout.fanout_share)
    return top, plan_trees(planned, max_trees=MAX_TREES, tree_penalty=TREE_PENALTY, time_limit=TIME_LIMIT).trees


def aggregates(layout: Layout, case: str) -> bool:
    """Whether the case's trees aggregate anywhere (a plan for racks that are not oversubscribed is flat)."""
    return any(host for tree in trees_of(layout, case)[1] for _, host in tree.aggregators)


def predicted_seconds(layout: Layout, case: str, nbytes: int) -> float:
    """The model's round time: the busiest link's bytes at its rate, less TCP/IP headers (the bare overlapped
    bound: every link, fan-outs too, busy the whole round)."""
    top, trees = trees_of(layout, case)
    bound, _ = bottleneck(top, trees)
    return round_seconds(bound, nbytes) / PAYLOAD_EFFICIENCY
