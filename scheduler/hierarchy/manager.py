"""Where a job's aggregation trees come from: the configured static sets, or the network manager's plans.

The network manager lives in the scheduler: it holds the job's topology (racks and rates from
[aggregation], nodes placed by the address book) and plans weighted trees with the ILP planner once
the job has formed, again every `replan_s` seconds, and whenever `observe` is told that a link's
spare bandwidth moved by more than `change`. Planning runs on a thread of its own, so the
scheduler's loop keeps answering heartbeats while HiGHS searches (up to `time_limit` seconds); rates
that an earlier plan was made for (within `change`) take that plan again at once.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from sluice.errors import require
from sluice.scheduler.hierarchy.agent import Report, spare_mbit
from sluice.scheduler.hierarchy.config import AggregationConfig
from sluice.scheduler.hierarchy.placement import NodeAt, Placement, place
from sluice.scheduler.hierarchy.routes import Route, parse_static_trees
from sluice.scheduler.hierarchy.topology import Plan, PlanError
from sluice.scheduler.hierarchy.uplinks import UplinkWatch

log = logging.getLogger("sluice.manager")


class StaticTrees:
    """The trees of `aggregation.trees`; with several sets and `replan_s`, the next set every replan_s
    seconds (an operator's fixed rotation, and the way tests switch trees mid-run on purpose)."""

    def __init__(self, config: AggregationConfig, now: float) -> None:
        self.sets = parse_static_trees(config.trees)
        self.period = config.replan_s
        self._current = 0
        self._next_at = now + self.period
        self._started = False

    def observe_reports(self, reports: Mapping[str, Sequence[Report]], nodes: Sequence[NodeAt]) -> None:
        """Static trees do not follow the network."""

    @property
    def planning(self) -> bool:
        """Static trees take no time to make."""
        return False

    def due(self, now: float, nodes: Sequence[NodeAt] = ()) -> list[Route] | None:
        """Trees to switch to now, or None."""
        del nodes
        if not self._started:
            self._started = True
            return self.sets[0]
        if self.period <= 0 or len(self.sets) < 2 or now < self._next_at:
            return None
        self._next_at = now + self.period
        self._current = (self._current + 1) % len(self.sets)
        return self.sets[self._current]

    def close(self) -> None:
        """Nothing runs in the background."""


#: plans kept with the rates they were made for: a re-plan for rates each within `change` of a kept plan's takes
#: that plan instead of searching again. An uplink counted slow and then mended brings back the rates of the
#: job's first plan, whose search can take the planner's whole `time_limit` (5 s in bench/replan.py)
KEPT_PLANS = 8

#: a plan's first periods, in which no uplink it assumes slowed is taken for mended: its trees come into force
#: after the round in flight (3.3-6.2 s in bench/replan.py), and until then a cut uplink whose part of that round
#: is done sits idle (periods at ease: taken for mended in one run of three, with no wait)
SETTLE_PERIODS = 8

#: periods after new trees go out in which no uplink counts as holding the job back: the switch moves the pushes of
#: rounds in flight between trees (worker/midround.py), and while the racks sum what moved, pushes still queued
#: for peers across an uplink wait on it as if it were slow (measured: a fresh job's first switch read a 2.5
#: Mbit/s uplink at 0.9 in the period after it and re-planned; bench/replan.py)
MOVING_PERIODS = 2

#: a host's spare bandwidth is the median of its last this many periods: one period can be off by what
#: the link's queue took in or let out in it (the agent counts our bytes as they enter the queue, the
#: interface as they leave it), while another job's traffic lasts
SMOOTHING = 3


class NetworkManager:
    """Plans the job's trees from its topology and the measured spare bandwidth; re-plans on change."""

    def __init__(self, config: AggregationConfig, now: float) -> None:
        self.config = config
        self.spare: dict[str, float] = {}  # host -> measured spare Mbit/s (from the agents)
        self.plan: Plan | None = None
        self.plans = 0
        self._planned_spare: dict[str, float] = {}
        #: each host's spare bandwidth in its last periods, by period: the median of SMOOTHING of them counts
        self._recent: dict[str, dict[int, float]] = {}
        self._uplinks = UplinkWatch(config.uplink_periods)
        self._configured: dict[str, float] = {}  # host -> configured rate, known once the job has formed
        self._placement: Placement | None = None
        self._routes: list[Route] | None = None
        self._next_at = now
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sluice-planner")
        self._running: Future[tuple[Plan, list[Route], int]] | None = None
        #: the plans made (the last KEPT_PLANS), each with the rates it was made for and its number
        self._kept: list[tuple[dict[str, float], Plan, list[Route], int]] = []
        #: the newest period reported, and the first in which the plan in force is watched for mended uplinks
        self._latest_period = self._settled = 0
        #: the last period in which the trees' traffic may still be moving (None: trees went out before any report)
        self._moving: int | None = 0

    @property
    def planning(self) -> bool:
        """A plan is being made on the planner's thread."""
        return self._running is not None

    def due(self, now: float, nodes: Sequence[NodeAt] = ()) -> list[Route] | None:
        """Once the job has formed (`nodes` known): trees of a finished plan, or None; starts the next
        plan when it is time."""
        if not nodes:
            return None
        self._place(nodes)
        running = self._running
        if running is not None:
            if not running.done():
                return None
            self._running = None
            try:
                self.plan, routes, again = running.result()
            except PlanError as exc:  # the topology does not fit the job: say so and keep the trees in use
                log.error("cannot plan aggregation trees: %s", exc)
                self._next_at = float("inf") if not self.config.replan_s else now + self.config.replan_s
                return None
            self.plans += 1
            if again:
                log.info("aggregation plan %d: plan %d again (every rate within %.0f%% of those it was made for)",
                         self.plans, again, self.config.change * 100)
            else:
                log.info("aggregation plan %d: %s", self.plans, describe(self.plan))
                made_for = self._rates(self._planned_spare)
                self._kept = [*self._kept[1 - KEPT_PLANS:], (made_for, self.plan, routes, self.plans)]
            if routes == self._routes:
                return None  # the same trees: nothing to switch
            self._routes = routes
            self._moving = self._latest_period + MOVING_PERIODS if self._latest_period else None
            return routes
        if now >= self._next_at or self._changed():
            self._next_at = now + self.config.replan_s if self.config.replan_s else float("inf")
            self._planned_spare = dict(self.spare)
            self._settled = self._latest_period + SETTLE_PERIODS
            kept = self._kept_for(self._rates(self._planned_spare))
            if kept is None:
                self._running = self._pool.submit(self._solve, nodes, dict(self.spare))
            else:  # a plan for these rates was made: no need to search again
                self._running = Future()
                self._running.set_result(kept)
        return None

    def _rates(self, spare: Mapping[str, float]) -> dict[str, float]:
        """Every configured link's rate as a plan for `spare` takes it: measured where measured."""
        return {link: spare.get(link, rate) for link, rate in self._configured.items()}

    def _kept_for(self, rates: Mapping[str, float]) -> tuple[Plan, list[Route], int] | None:
        """The latest kept plan made for rates each within `change` of `rates`: (plan, routes, its number)."""
        def near(kept: Mapping[str, float]) -> bool:
            return kept.keys() == rates.keys() and all(
                abs(rates[link] - rate) <= self.config.change * max(rate, 1e-9) for link, rate in kept.items())

        return next(((plan, routes, number) for made, plan, routes, number in reversed(self._kept) if near(made)),
                    None)

    def _place(self, nodes: Sequence[NodeAt]) -> Placement | None:
        """The job's placement, worked out once (the nodes of a formed job do not change); None if the
        racks do not fit the job, which planning then says."""
        if self._placement is None:
            with contextlib.suppress(PlanError):
                self._placement = place(self.config, nodes)
                configured = self._placement.configured
                self._configured = {h.name: h.link_mbit for h in configured.hosts}
                self._configured.update({f"uplink:{r.name}": r.uplink_mbit for r in configured.racks})
        return self._placement

    def observe(self, spare: dict[str, float]) -> None:
        """Spare bandwidth measured by host or rack uplink ("uplink:RACK"), Mbit/s."""
        self.spare.update(spare)

    def observe_reports(self, reports: Mapping[str, Sequence[Report]], nodes: Sequence[NodeAt]) -> None:
        """The agents' latest reports by node, oldest first: each host's spare bandwidth is its configured rate
        less the traffic its interface carries beyond the job's own (agent.spare_mbit)."""
        placement = self._place(nodes) if reports else None
        if placement is None:
            return
        by_host: dict[str, list[Report]] = {}
        for name, latest in reports.items():
            if name in placement.host and latest:
                by_host.setdefault(placement.host[name], []).append(latest[-1])
        for host in placement.configured.hosts:
            mine = by_host.get(host.name)
            rate = spare_mbit(host.link_mbit, mine) if mine else None
            if mine is None or rate is None:
                continue
            recent = self._recent.setdefault(host.name, {})
            recent[mine[0].period] = rate
            for old in sorted(recent)[:-SMOOTHING]:
                del recent[old]
            if len(recent) == SMOOTHING:
                self.observe({host.name: statistics.median(recent.values())})
        self._observe_uplinks(reports, placement)

    def _observe_uplinks(self, reports: Mapping[str, Sequence[Report]], placement: Placement) -> None:
        """The uplinks that held the job back, period by period once each period's reports are in, at their
        measured rates (uplinks.py); an uplink counts once it held the job back `uplink_periods` running, or at
        once below half the rate in the plan. One planned below its configured rate counts at that rate again once
        its traffic crossed it `uplink_periods` + 1 periods running without keeping a sender waiting, or at once
        when its flows' acknowledgements came back several times sooner."""
        known = [name for name in reports if name in placement.host]
        self._latest_period = max([self._latest_period, *(r[-1].period for r in reports.values() if r)])
        if self._moving is None and self._latest_period:  # the trees went out before the first report
            self._moving = self._latest_period + MOVING_PERIODS - 1
        rates = {h.name: h.link_mbit for h in placement.configured.hosts}
        configured = {link.partition(":")[2]: rate for link, rate in self._configured.items()
                      if link.startswith("uplink:")}
        planned = {rack: self._planned_spare.get(f"uplink:{rack}", rate) for rack, rate in configured.items()}
        found = self._uplinks.observe({n: reports[n] for n in known},
                                      {n: placement.rack[placement.host[n]] for n in known},
                                      {n: rates[placement.host[n]] for n in known}, planned, configured,
                                      self._settled, self._moving or 0)
        for period, rack, mbit, counted, mended, sooner, through in found:
            acked = "" if through is None else f"; {through:.1f} Mbit/s acknowledged across it"
            if counted:
                why = "it held the job back"
                if mended and sooner is not None:
                    why = (f"mended: its flows were acknowledged {sooner:.1f} times sooner, against the other racks', "
                           f"than in its periods before, with no sender waiting long; the plan assumed "
                           f"{planned[rack]:.1f}")
                elif mended:
                    why = (f"mended: its traffic crossed {self.config.uplink_periods + 1} periods running without "
                           f"keeping a sender waiting; the plan assumed {planned[rack]:.1f}")
                log.info("uplink of rack %s measured at %.1f Mbit/s in period %d (%s%s)", rack, mbit, period, why,
                         acked)
                self.observe({f"uplink:{rack}": mbit})
            elif mended:  # one period at ease can fall between a slow uplink's busy ones: a false alarm would re-plan
                log.info("uplink of rack %s got through at %.1f Mbit/s in period %d (no sender waited long; the plan "
                         "assumes %.1f%s)", rack, mbit, period, planned[rack], acked)
            else:
                log.info("uplink of rack %s held the job back in period %d (%.1f Mbit/s%s)", rack, period, mbit, acked)

    def _changed(self) -> bool:
        for link, rate in self.spare.items():
            planned = self._planned_spare.get(link, self._configured.get(link))
            if planned is None or abs(rate - planned) > self.config.change * max(planned, 1e-9):
                log.info("re-planning: the spare bandwidth of %s moved from %s to %.1f Mbit/s", link,
                         "unknown" if planned is None else f"{planned:.1f}", rate)
                return True
        return False

    def _solve(self, nodes: Sequence[NodeAt], spare: dict[str, float]) -> tuple[Plan, list[Route], int]:
        placement = self._placement or place(self.config, nodes)  # (raises PlanError, said by due())
        config = self.config
        from sluice.scheduler.hierarchy.planner import plan_trees

        plan = plan_trees(placement.topology(spare), max_trees=config.max_trees, tree_penalty=config.tree_penalty,
                          time_limit=config.time_limit)
        return plan, placement.routes(plan), 0

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def describe(plan: Plan) -> str:
    trees = "; ".join(f"{t.weight:.3f}: " + " ".join(f"{rack}>{host or 'direct'}" for rack, host in t.aggregators)
                      for t in plan.trees)
    return (f"{len(plan.trees)} trees, bottleneck {plan.bottleneck_link}, {plan.round_seconds(1 << 20) * 1e3:.1f} "
            f"ms per MiB (LP bound {plan.bound / plan.objective:.0%} of it, flat PS {plan.flat / plan.objective:.2f}x "
            f"it), {plan.status} by {plan.solver} in {plan.solve_seconds:.2f} s: {trees}")


def tree_source(config: AggregationConfig, now: float) -> StaticTrees | NetworkManager | None:
    """The job's source of trees; None when aggregation is off."""
    if config.mode == "static":
        return StaticTrees(config, now)
    if config.mode == "plan":
        # the planner's solvers are an extra: a job without planned trees runs without them
        require("scipy", "planner", "aggregation.mode = \"plan\" (the aggregation trees' planner)")
        return NetworkManager(config, now)
    return None
