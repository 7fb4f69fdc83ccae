"""Light ranks: forked processes that run only a bare transport and a Coordinator (no torch), for tests and benchmarks.

`run(plan)` forks plan.ranks processes. Each opens a transport (`worker-R`, one channel, no CURVE, no
shared memory), listens, sends its endpoints to the parent, gets the address book, dials the neighbours
that `collective.tree.dials` gives it, runs a Coordinator and submits `plan.ops` allreduce requests per
step (in its own random order, or in one order spread over `spread_ms` like a backward pass), waiting for
the step's decisions before the next step. Each reports what it saw (decisions in order, times, errors,
its coordinator's counters), then waits until every rank has reported before it closes, so no rank goes
away while another may still need it to forward. Every wait has a deadline; children are always reaped.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import queue
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from sluice.transport.base import open_transport
from sluice.transport.config import TransportConfig
from sluice.worker.collective.config import CollectiveConfig
from sluice.worker.collective.coordinator import Coordinator
from sluice.worker.collective.mailbox import Mailbox
from sluice.worker.collective.negotiation import Decision, Request
from sluice.worker.collective.tree import build_tree, dials
from testbed.children import Children

_ctx = mp.get_context("fork")


@dataclass(frozen=True)
class Plan:
    ranks: int
    arity: int = 4
    steps: int = 3
    ops: int = 200
    ranks_per_host: int = 0  # 0: every rank on one host
    hosts: tuple[str, ...] = ()  # each rank's host, instead of ranks_per_host
    cycle_ms: float = 1.0
    # longer than any test's deadline: on a starved 2-core machine a step can take 30 s, and a stall
    # alert's census (names on the way up) would then show in a test that measures the steady state
    stall_timeout: float = 300.0
    shuffle: bool = True  # each rank submits a step's ops in its own random order (else all in one order)
    spread_ms: float = 0.0  # submit a step's ops evenly over this long (0: all at once)
    seed: int = 0
    skip: tuple[tuple[int, str], ...] = ()  # (rank, op name): that rank never submits it
    reshape: tuple[tuple[int, int, str], ...] = ()  # (rank, step, op name): submitted with another shape
    join_after: tuple[tuple[int, int], ...] = ()  # (rank, steps): that rank joins after this many steps
    join_at_end: bool = False  # every rank joins after its last step
    timeout: float = 60.0  # for any one wait of a rank
    lanes: bool = False  # the coordinator's messages between ranks of one host over direct lanes


@dataclass
class Report:
    rank: int
    decisions: list[tuple[str, int, tuple[int, ...]]] = field(default_factory=list)  # (name, index, joined)
    steps_done: int = 0
    submitted: list[dict[str, float]] = field(default_factory=list)  # per step: op name -> monotonic time
    decided: list[dict[str, float]] = field(default_factory=list)
    error: str | None = None
    #: the errors of ops decided as failed (their ranks disagreed), in decision order
    failed: list[str] = field(default_factory=list)
    join_last: int = -1
    cpu: float = 0.0  # seconds of CPU this process used (all its threads)
    first: dict[str, int] = field(default_factory=dict)  # coordinator counters during step 1
    steady: dict[str, int] = field(default_factory=dict)  # and over the later steps


def op_names(count: int) -> list[str]:
    return [f"grad.{i}" for i in range(count)]


def request(name: str, columns: int = 0) -> Request:
    index = int(name.rsplit(".", 1)[1])
    return Request(name, "allreduce", "float32", ((4, columns or 1 + index % 7),))


class _Seen:
    """Decisions and errors as the coordinator thread hands them over; the waiting thread is woken only
    when what it waits for has come (not once per decision: with 64 ranks on two cores that shows)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.decisions: list[tuple[Decision, float]] = []
        self.error: str | None = None
        self._until = 0  # wake the waiter once this many decisions (or a join) are in
        self._joined = False

    def on_decided(self, decision: Decision) -> None:
        with self.cond:
            self.decisions.append((decision, time.monotonic()))
            self._joined |= decision.request.kind == "join"
            if len(self.decisions) >= self._until or self._joined:
                self.cond.notify_all()

    def on_error(self, text: str) -> None:
        with self.cond:
            self.error = text
            self.cond.notify_all()

    def wait_for(self, count: int, timeout: float) -> None:
        """Until `count` decisions in all (0: until the join is decided), or an error."""
        with self.cond:
            self._until = count or 1 << 62

            def done() -> bool:
                return self.error is not None or (len(self.decisions) >= count if count else self._joined)

            if not self.cond.wait_for(done, timeout):
                raise TimeoutError(f"no decision or error after {timeout:.0f} s ({len(self.decisions)} decided)")


def _step_ops(plan: Plan, rank: int, step: int, rng: random.Random) -> list[Request]:
    skipped = {name for r, name in plan.skip if r == rank}
    reshaped = {name for r, s, name in plan.reshape if r == rank and s == step}
    ops = [request(name, 9 if name in reshaped else 0) for name in op_names(plan.ops) if name not in skipped]
    if plan.shuffle:
        rng.shuffle(ops)
    return ops


def _rank_main(plan: Plan, rank: int, endpoints: Any, book: Any, reports: Any, done: Any) -> None:
    names = [f"worker-{r}" for r in range(plan.ranks)]
    hosts = plan.hosts or [f"host-{r // plan.ranks_per_host}" if plan.ranks_per_host else "host-0"
                           for r in range(plan.ranks)]
    tree = build_tree(hosts, plan.arity)
    box = Mailbox(1 << 20, lambda peer, text: None)  # a test harness: keep whatever comes early
    config = TransportConfig(channels=1, curve=False, shm=False, marks=False, chunk_bytes=64 << 10,
                             inflight_bytes=1 << 20)
    transport = open_transport(names[rank], config, lambda peer, _channel, msg: box.deliver(peer, msg), members=names)
    seen, report = _Seen(), Report(rank)
    try:
        endpoints.put((rank, transport.listen()))
        addresses = book.get(timeout=plan.timeout)
        for other in tree.neighbours(rank):
            if dials(rank, other):
                transport.connect(names[other], addresses[other])
        settings = CollectiveConfig(arity=plan.arity, cycle_ms=plan.cycle_ms, stall_timeout=plan.stall_timeout)
        local = [r for r, host in enumerate(hosts) if host == hosts[rank]] if plan.lanes else []
        coordinator = Coordinator(transport, rank, tree, names, settings, seen.on_decided, seen.on_error, local=local)
        box.attach(coordinator.on_message)
        try:
            _run_steps(plan, rank, coordinator, seen, report)
        finally:
            report.steady = coordinator.stats()
            report.cpu = time.process_time()
            report.error = seen.error
            report.decisions = [(d.request.name, d.index, tuple(sorted(d.joined))) for d, _ in seen.decisions]
            report.failed = [d.error for d, _ in seen.decisions if d.error is not None]
            reports.put(report)
            done.wait(plan.timeout * 3)  # neighbours may still need this rank (forwarding), until all reported
            coordinator.close()
    finally:
        transport.close(0.5)


def _run_steps(plan: Plan, rank: int, coordinator: Coordinator, seen: _Seen, report: Report) -> None:
    rng = random.Random(plan.seed * 1_000_003 + rank)
    stop = dict(plan.join_after).get(rank, plan.steps)
    for step in range(stop):
        ops = _step_ops(plan, rank, step, rng)
        with seen.cond:
            before = len(seen.decisions)
        submitted: dict[str, float] = {}
        started = time.monotonic()
        for k, op in enumerate(ops):
            if plan.spread_ms:
                time.sleep(max(started + plan.spread_ms / 1e3 * k / len(ops) - time.monotonic(), 0.0))
            submitted[op.name] = time.monotonic()
            coordinator.submit(op)
        report.submitted.append(submitted)
        seen.wait_for(before + plan.ops, plan.timeout)
        if seen.error is not None:
            return
        with seen.cond:
            report.decided.append({d.request.name: t for d, t in seen.decisions[before:]})
        report.steps_done = step + 1
        if step == 0:
            report.first = coordinator.stats(reset=True)
    if stop < plan.steps or plan.join_at_end or plan.join_after:
        coordinator.submit(Request("join", "join"))
        seen.wait_for(0, plan.timeout)
        report.join_last = next((d.request.root for d, _ in seen.decisions if d.request.kind == "join"), -1)


def run(plan: Plan) -> list[Report]:
    """Every rank's report, by rank; raises if a rank fails or anything takes longer than its deadline."""
    keys = [f"rank {r}" for r in range(plan.ranks)]
    with Children() as children:
        endpoints, reports, done = children.queue(), children.queue(), _ctx.Event()
        books = [children.queue() for _ in range(plan.ranks)]
        for rank in range(plan.ranks):
            children.start(keys[rank], _rank_main, plan, rank, endpoints, books[rank], reports, done)
        addresses: dict[int, list[str]] = {}
        deadline = time.monotonic() + plan.timeout
        while len(addresses) < plan.ranks:
            rank, listening = _next(endpoints, deadline, children, keys)
            addresses[rank] = listening
        for book in books:
            book.put(addresses)
        got: dict[int, Report] = {}
        deadline = time.monotonic() + plan.timeout * (plan.steps + 2)
        while len(got) < plan.ranks:
            report = _next(reports, deadline, children, keys)
            got[report.rank] = report
        done.set()
        children.collect(keys, timeout=plan.timeout)
    return [got[r] for r in range(plan.ranks)]


def _next(source: Any, deadline: float, children: Children, keys: list[str]) -> Any:
    """The next item of `source`; raises at the deadline, or as soon as a rank has failed or died."""
    while True:
        try:
            return source.get(timeout=1.0)
        except queue.Empty:
            if time.monotonic() > deadline:
                raise TimeoutError("light ranks: no progress before the deadline") from None
        with contextlib.suppress(TimeoutError):  # it raises RuntimeError for a rank that failed or died
            children.collect(keys, timeout=0.05)


def latencies(reports: list[Report], first_step: int = 1) -> list[float]:
    """Seconds from the moment the last rank submitted an op to its decision at each rank (steps from
    `first_step` on, so the table is built): one value per op, step and rank."""
    out = []
    steps = min(len(r.decided) for r in reports)
    for step in range(first_step, steps):
        for name in reports[0].submitted[step]:
            last = max(r.submitted[step][name] for r in reports)
            out += [r.decided[step][name] - last for r in reports]
    return out
