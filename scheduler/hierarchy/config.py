"""Settings of hierarchical aggregation: where trees come from, the topology, and the planner's limits."""

from __future__ import annotations

from dataclasses import dataclass, field

MODES = ("off", "static", "plan")


@dataclass(frozen=True)
class AggregationConfig:
    #: "off": every worker pushes straight to the servers; "static": the trees of `trees`;
    #: "plan": the scheduler's network manager plans weighted trees from `racks` and the rates below
    #: and the agents' measurements (docs/aggregation.md), and re-plans when they change
    mode: str = "off"
    #: with mode "static", one tree per entry: "[@SET] WEIGHT: CHILD>PARENT CHILD>PARENT ...", nodes by
    #: name (worker-0, aggregator-1), PARENT "server" for the servers; a node not named sends straight
    #: to the servers; with several sets (@0, @1, ...) and replan_s > 0 the trees rotate through them
    trees: tuple[str, ...] = field(default_factory=tuple)
    #: with mode "plan", one rack per entry: "NAME: HOST HOST ...", a HOST being a node's address or
    #: node names joined by "+" that share one host (worker-0+aggregator-0)
    racks: tuple[str, ...] = field(default_factory=tuple)
    #: each host's link rate, Mbit/s each way (refined by the agents' measurements)
    link_mbit: float = 1000.0
    #: rates of single hosts' links that differ: "HOST: MBIT"
    links: tuple[str, ...] = field(default_factory=tuple)
    #: each rack's uplink rate, Mbit/s each way (0: not oversubscribed, the sum of its hosts' links)
    uplink_mbit: float = 0.0
    #: rates of single racks' uplinks that differ: "RACK: MBIT"
    uplinks: tuple[str, ...] = field(default_factory=tuple)
    #: the planner's tree slots: at most this many trees
    max_trees: int = 8
    #: each tree beyond the first costs this fraction of the best possible round time
    tree_penalty: float = 0.02
    #: seconds the planner may search; it keeps the best plan found
    time_limit: float = 5.0
    #: re-plan every this many seconds (0: only when the measured bandwidth changes)
    replan_s: float = 0.0
    #: agents report their links' use every this many seconds (with a heartbeat: at least
    #: scheduler.heartbeat_interval apart)
    report_s: float = 1.0
    #: re-plan when a link's measured spare bandwidth moves by more than this fraction
    change: float = 0.25
    #: a rack uplink counts as measured once it held the job back this many periods running: one
    #: period's evidence could be a burst of a round's phases, and a false alarm re-plans around a link
    #: that is not slow (docs/aggregation.md, "Rack uplinks, measured"); one counted slow counts at its
    #: configured rate again after one period more than this at ease (mended)
    uplink_periods: int = 2
    #: the share of an aggregating host's link that the sums it sends back to its rack may fill: they
    #: wait for the first sums from the servers, so they cannot fill a whole round (1: plan as if they
    #: could; docs/aggregation.md, "Fan-out")
    fanout_share: float = 0.5

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"aggregation.mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.link_mbit <= 0 or self.uplink_mbit < 0:
            raise ValueError("aggregation.link_mbit must be positive and aggregation.uplink_mbit 0 or positive")
        if self.max_trees < 1:
            raise ValueError(f"aggregation.max_trees must be at least 1, got {self.max_trees}")
        if self.tree_penalty < 0 or self.time_limit <= 0 or self.replan_s < 0 or self.report_s <= 0:
            raise ValueError("aggregation.tree_penalty and replan_s must be >= 0, time_limit and report_s > 0")
        if not 0 < self.change < 1:
            raise ValueError(f"aggregation.change must be a fraction in (0, 1), got {self.change}")
        if not 1 <= self.uplink_periods <= 10:
            raise ValueError(f"aggregation.uplink_periods must be 1..10, got {self.uplink_periods}")
        if not 0 < self.fanout_share <= 1:
            raise ValueError(f"aggregation.fanout_share must be a fraction in (0, 1], got {self.fanout_share}")
        if self.mode == "static" and not self.trees:
            raise ValueError("aggregation.mode = \"static\" needs aggregation.trees")
        if self.mode == "plan" and not self.racks:
            raise ValueError("aggregation.mode = \"plan\" needs aggregation.racks")
