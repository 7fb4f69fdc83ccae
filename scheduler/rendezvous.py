"""The scheduler's protocol as a state machine: messages and clock ticks in, messages out.

No sockets and no clocks of its own: the executor in scheduler/service.py feeds it (peer, message,
now) and sends what it returns, so every rule here is testable with plain data. Node ids: the
scheduler is 0, servers 1..S, workers S+1..S+W, ranks counted per role from 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sluice.scheduler.bootstrap import node_name
from sluice.scheduler.calibration import Limits, agree
from sluice.scheduler.config import SchedulerConfig
from sluice.scheduler.hierarchy.agent import Report, parse_report
from sluice.scheduler.hierarchy.routes import Route, check_trees
from sluice.scheduler.hierarchy.switch import RouteSwitch, parse_rounds
from sluice.scheduler.partition import TensorPlan, TensorSpec, plan_tensors
from sluice.scheduler.recovery import ServerRecovery
from sluice.transport.config import DEFAULT_CHUNK_BYTES, DEFAULT_INFLIGHT_BYTES
from sluice.transport.wire import DTYPES, Kind, Message, WireError, brief, meta_field

Out = tuple[str, Message]
ROLES = ("server", "worker", "aggregator")
#: dimensions of a declared tensor (the bound keeps error messages and size arithmetic small)
MAX_TENSOR_DIMS = 64
#: chunks one declaration may be cut into: its PLANs (about 17 bytes a chunk) must fit CONTROL_HEADER_BYTES
MAX_PLAN_CHUNKS = 1 << 17


@dataclass
class Node:
    name: str
    role: str
    rank_hint: int
    endpoints: list[str]
    pid: int
    arrival: int
    node_id: int = -1
    rank: int = -1

    def describe(self) -> str:
        return f"{self.role} {self.rank} (node {self.node_id}, pid {self.pid})"


@dataclass
class _Declaration:
    by_rank: dict[int, list[Any]] = field(default_factory=dict)
    proposals: dict[int, Limits] = field(default_factory=dict)
    plans: list[TensorPlan] = field(default_factory=list)
    #: the plan as workers get it: [[key, name, shape, dtype, priority, [[chunk, offset, length, server]]]]
    table: list[Any] = field(default_factory=list)
    acks: set[str] = field(default_factory=set)


def parse_limits(raw: object) -> Limits:
    """[chunk_bytes, inflight_bytes] from a DECLARE or PLAN message, validated."""
    if (
        not isinstance(raw, list) or len(raw) != 2 or not all(type(v) is int for v in raw)
        or not 4096 <= raw[0] <= 1 << 30 or not 1 <= raw[1] <= 1 << 34
    ):
        raise WireError(f"limits must be [chunk bytes 4096..2**30, in-flight bytes 1..2**34], got {brief(raw)}")
    return Limits(raw[0], raw[1])


def parse_tensor_table(raw: object) -> list[tuple[TensorSpec, Any]]:
    """[[name, shape, dtype, optimizer-or-nil], ...] from a DECLARE message, validated."""
    if not isinstance(raw, list):
        raise WireError(f"tensors must be a list, got {brief(raw)}")
    table = []
    for entry in raw:
        if not (isinstance(entry, list) and len(entry) == 4 and isinstance(entry[0], str)):
            raise WireError(f"each tensor entry must be [name, shape, dtype, optimizer], got {brief(entry)}")
        name, shape, dtype, opt = entry
        if (not isinstance(shape, list) or len(shape) > MAX_TENSOR_DIMS
                or not all(type(d) is int and d >= 0 for d in shape)):
            raise WireError(f"tensor {brief(name)}: shape must be a list of at most {MAX_TENSOR_DIMS} "
                            f"non-negative ints, got {brief(shape)}")
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise WireError(f"tensor {brief(name)}: dtype {brief(dtype)} is not one of {sorted(DTYPES)}")
        if opt is not None and not isinstance(opt, dict):
            raise WireError(f"tensor {brief(name)}: optimizer settings must be a map or nil, got {brief(opt)}")
        table.append((TensorSpec(name, tuple(shape), dtype), opt))
    return table


def table_mismatch(reference: Sequence[TensorSpec], other: Sequence[TensorSpec], rank: int) -> str | None:
    """The first difference between worker 0's table and worker `rank`'s, in words; None if equal."""
    mine = {s.name: s for s in reference}
    theirs = {s.name: s for s in other}
    if len(theirs) != len(other):
        return f"worker {rank} declares a tensor name twice"
    for spec in reference:
        got = theirs.get(spec.name)
        if got is None:
            return f"worker {rank} does not declare tensor {brief(spec.name)} that worker 0 declares"
        if (got.shape, got.dtype) != (spec.shape, spec.dtype):
            return (
                f"worker {rank} declares tensor {brief(spec.name)} as {got.dtype}{list(got.shape)} "
                f"but worker 0 as {spec.dtype}{list(spec.shape)}"
            )
    extra = [name for name in theirs if name not in mine]
    if extra:
        return f"worker {rank} declares tensor {brief(extra[0])} that worker 0 does not"
    return None


class Rendezvous:
    def __init__(
        self,
        workers: int,
        servers: int,
        chunk_bytes: int,
        config: SchedulerConfig,
        fingerprint: str,
        now: float,
        inflight_bytes: int = 0,
        bind_names: bool = True,
        aggregators: int = 0,
        recovery: ServerRecovery | None = None,
    ) -> None:
        self.workers, self.servers, self.aggregators, self.config = workers, servers, aggregators, config
        #: server replacement under ps.recover (scheduler/recovery.py)
        self.recovery = recovery or ServerRecovery()
        #: the switch to new aggregation trees between rounds (scheduler/hierarchy/switch.py)
        self.switch = RouteSwitch()
        #: each node's latest network report (scheduler/hierarchy/agent.py), by node name
        self.net_reports: dict[str, Report] = {}
        #: each worker's latest job-priority report (level, bytes pushed, rounds), for the job registry
        self.job_reports: dict[str, tuple[int, int, int]] = {}
        #: as configured; 0: the workers' calibrations decide (at the first declaration)
        self.chunk_bytes, self.inflight_bytes = chunk_bytes, inflight_bytes
        self.limits: Limits | None = None
        #: lines worth logging (the limits chosen); the service drains it
        self.notes: list[str] = []
        self.fingerprint = fingerprint
        #: a node registering as role R, rank K must come from the connection named node_name(R, K)
        #: (with CURVE, the name its key proves); off only in tests of other rules with short names
        self.bind_names = bind_names
        self.started = now
        self.nodes: dict[str, Node] = {}
        self.last_seen: dict[str, float] = {}
        self.phase = "registering"
        self.exit_code: int | None = None
        self.error = ""
        self.byes: set[str] = set()
        #: the node declared lost (no heartbeat), once the job failed for that reason
        self.lost: Node | None = None
        self._declarations: dict[int, _Declaration] = {}
        self._planned: dict[str, TensorPlan] = {}
        self._loads = [0] * servers
        self._barriers: dict[str, set[int]] = {}

    # ------------------------------------------------------------------ helpers
    def _msg(self, kind: Kind, **meta: Any) -> Message:
        return Message(kind, sender=0, meta=meta)

    def _of_role(self, role: str) -> list[Node]:
        return sorted((n for n in self.nodes.values() if n.role == role), key=lambda n: n.rank)

    def _fail(self, error: str, lost: Node | None = None) -> list[Out]:
        self.phase, self.exit_code, self.error = "failed", 1, error
        self.lost = lost
        kind = Kind.NODE_LOST if lost else Kind.ERROR
        extra = {"node_id": lost.node_id, "role": lost.role, "rank": lost.rank} if lost else {}
        return [(n.name, self._msg(kind, error=error, **extra)) for n in self.nodes.values() if n is not lost]

    # ------------------------------------------------------------------ inputs
    def on_message(self, peer: str, msg: Message, now: float) -> list[Out]:
        if self.phase in ("done", "failed"):
            return []
        if msg.kind == Kind.REGISTER:
            return self._on_register(peer, msg, now)
        node = self.nodes.get(peer)
        if node is None or self.phase != "running":
            raise WireError(f"{msg.kind.name} from unregistered peer {peer!r}")
        self.last_seen[peer] = now
        if msg.kind == Kind.HEARTBEAT:
            if msg.meta and "net" in msg.meta:  # the node's network agent: the manager reads the latest of each
                report = parse_report(msg.meta["net"])
                if report is None:
                    raise WireError(f"a heartbeat's net report must be four rates in Mbit/s and the number of "
                                    f"its period, got {brief(msg.meta['net'])}")
                self.net_reports[peer] = report
            if msg.meta and "job" in msg.meta:
                self.job_reports[peer] = parse_job_report(msg.meta["job"])
            return [(peer, self._msg(Kind.HEARTBEAT_ACK))]
        if msg.kind == Kind.DECLARE and node.role == "worker":
            return self._on_declare(node, msg)
        if msg.kind == Kind.PLAN_ACK and node.role in ("server", "aggregator"):
            return self._on_plan_ack(node, msg)
        if msg.kind == Kind.ROUTES_ACK and node.role in ("worker", "aggregator"):
            rounds = parse_rounds((msg.meta or {}).get("rounds", []))
            return self.switch.on_ack(node.name, node.role, meta_field(msg, "epoch", int), rounds)
        if msg.kind == Kind.BARRIER and node.role == "worker":
            return self._on_barrier(node, msg)
        if msg.kind == Kind.BYE:
            return self._on_bye(node)
        raise WireError(f"unexpected {msg.kind.name} from {node.describe()}")

    def on_tick(self, now: float) -> list[Out]:
        if self.phase == "registering" and now - self.started > self.config.rendezvous_timeout:
            counts = {r: len([n for n in self.nodes.values() if n.role == r]) for r in ROLES}
            aggregators = f", {counts['aggregator']} of {self.aggregators} aggregators" if self.aggregators else ""
            return self._fail(
                f"rendezvous timed out after {self.config.rendezvous_timeout:.0f} s: "
                f"{counts['worker']} of {self.workers} workers and {counts['server']} of "
                f"{self.servers} servers{aggregators} registered"
            )
        if self.phase == "running":
            for name, seen in self.last_seen.items():
                if name in self.byes or now - seen <= self.config.heartbeat_timeout:
                    continue
                node = self.nodes[name]
                patience = self.recovery.patience(node.role)
                if now - seen > self.config.heartbeat_timeout + patience:
                    waited = f" (nor was it replaced within ps.recover_timeout = {patience:g} s)" if patience else ""
                    return self._fail(
                        f"{node.describe()} sent no heartbeat for {now - seen:.1f} s: it is lost{waited}", node
                    )
                if name not in self.recovery.silent:
                    self.recovery.silent.add(name)
                    self.notes.append(f"{node.describe()} is silent; waiting up to {patience:g} s for its replacement")
        return []

    def _on_register(self, peer: str, msg: Message, now: float) -> list[Out]:
        role = meta_field(msg, "role", str)
        if role not in ROLES:
            raise WireError(f"REGISTER with unknown role {brief(role)}")
        rank_hint = meta_field(msg, "rank", int)
        if self.bind_names and rank_hint >= 0 and peer != node_name(role, rank_hint):
            # with CURVE the connection's name is the member's authenticated name: this is not that member
            raise WireError(f"REGISTER as {role} {rank_hint} from a connection named {peer!r:.60}")
        returning = self.nodes.get(peer)
        if self.phase == "running" and returning is not None and returning.role == role == "server" \
                and self.recovery.enabled:
            return self._server_returns(returning, msg, now)
        if self.phase != "registering" or peer in self.nodes:
            return [(peer, self._msg(Kind.ERROR, error="the job has already formed; registration refused"))]
        if meta_field(msg, "fingerprint", str) != self.fingerprint:
            error = f"{role} at {peer} was started with a different configuration than the scheduler"
            return [(peer, self._msg(Kind.ERROR, error=error))]
        endpoints = meta_field(msg, "endpoints", list)
        if not all(isinstance(e, str) for e in endpoints) or (role == "server" and not endpoints):
            raise WireError("REGISTER endpoints must be a list of strings (non-empty for a server)")
        wanted = {"worker": self.workers, "server": self.servers, "aggregator": self.aggregators}[role]
        if len(self._of_role(role)) >= wanted:
            return [(peer, self._msg(Kind.ERROR, error=f"the job already has {wanted} {role}s"))]
        self.nodes[peer] = Node(
            peer, role, rank_hint, endpoints, meta_field(msg, "pid", int), len(self.nodes)
        )
        if len(self.nodes) < self.workers + self.servers + self.aggregators:
            return []
        return self._assign(now)

    def _server_returns(self, node: Node, msg: Message, now: float) -> list[Out]:
        """A replaced server registered again (ps.recover): welcome it as before, then re-plan it."""
        if meta_field(msg, "fingerprint", str) != self.fingerprint:
            return [(node.name, self._msg(Kind.ERROR, error="the replacement of "
                                          f"{node.describe()} was started with a different configuration"))]
        endpoints = meta_field(msg, "endpoints", list)
        if not endpoints or not all(isinstance(e, str) for e in endpoints):
            raise WireError("REGISTER endpoints must be a non-empty list of strings for a server")
        node.endpoints, node.pid = endpoints, meta_field(msg, "pid", int)
        self.last_seen[node.name] = now
        book = [[n.node_id, n.role, n.rank, n.name, n.endpoints] for n in self.nodes.values()]
        outs = [(node.name, self._msg(Kind.WELCOME, node_id=node.node_id, rank=node.rank, role=node.role,
                                      nodes=book))]
        plans = self.recovery.replaced(node.name)
        self.notes.append(f"{node.describe()} registered again (replacement {self.recovery.incarnations[node.name]});"
                          f" re-sending its {len(plans)} plans")
        outs += [(node.name, plan) for plan in plans]
        if not plans:
            self.recovery.pending.pop(node.name, None)
            outs += self._server_back(node)
        return outs

    def _server_back(self, node: Node) -> list[Out]:
        self.notes.append(f"{node.describe()} is back: telling the workers its endpoints")
        back = self.recovery.back(node.node_id, node.rank, node.name, node.endpoints)
        return [(n.name, back) for n in self._of_role("worker") + self._of_role("aggregator")]

    def _assign(self, now: float) -> list[Out]:
        next_id = 1
        for role in ("server", "worker", "aggregator"):
            members = [n for n in self.nodes.values() if n.role == role]
            hinted = sorted(n.rank_hint for n in members if n.rank_hint >= 0)
            if len(set(hinted)) != len(hinted) or any(r >= len(members) for r in hinted):
                return self._fail(f"{role} ranks {hinted} are duplicated or out of range 0..{len(members) - 1}")
            free = iter(r for r in range(len(members)) if r not in hinted)
            for node in sorted(members, key=lambda n: n.arrival):
                node.rank = node.rank_hint if node.rank_hint >= 0 else next(free)
            for node in sorted(members, key=lambda n: n.rank):
                node.node_id, next_id = next_id, next_id + 1
        self.phase = "running"
        self.last_seen = dict.fromkeys(self.nodes, now)
        book = [[n.node_id, n.role, n.rank, n.name, n.endpoints] for n in self.nodes.values()]
        welcomes = [
            (n.name, self._msg(Kind.WELCOME, node_id=n.node_id, rank=n.rank, role=n.role, nodes=book))
            for n in self.nodes.values()
        ]
        names = {role: [n.name for n in self._of_role(role)] for role in ROLES}
        return welcomes + self.switch.start(names["worker"], names["aggregator"])

    def propose_routes(self, trees: list[Route]) -> list[Out]:
        """Switch the job to new aggregation trees between rounds (ValueError if they do not fit the job)."""
        check_trees(trees, [node_name("worker", r) for r in range(self.workers)],
                    [node_name("aggregator", r) for r in range(self.aggregators)])
        return self.switch.propose(trees) if self.phase in ("registering", "running") else []

    def _on_declare(self, node: Node, msg: Message) -> list[Out]:
        seq = meta_field(msg, "seq", int)
        table = parse_tensor_table(meta_field(msg, "tensors", list))
        proposal = (msg.meta or {}).get("limits")
        limits_proposed = parse_limits(proposal) if proposal is not None else None  # all checked before any change
        decl = self._declarations.setdefault(seq, _Declaration())
        decl.by_rank[node.rank] = table
        if limits_proposed is not None:
            decl.proposals[node.rank] = limits_proposed
        if len(decl.by_rank) < self.workers:
            return []
        limits = self.limits or self._settle_limits(decl)
        reference = [spec for spec, _ in decl.by_rank[0]]
        if len({spec.name for spec in reference}) != len(reference):  # the others are compared with it
            return self._fail(f"tensor declaration {seq} rejected: worker 0 declares a tensor name twice")
        for rank in range(1, self.workers):
            problem = table_mismatch(reference, [spec for spec, _ in decl.by_rank[rank]], rank)
            if problem:
                return self._fail(f"tensor declaration {seq} rejected: {problem}")
        for spec in reference:
            old = self._planned.get(spec.name)
            if old is not None and old.spec != spec:
                return self._fail(
                    f"tensor {brief(spec.name)} was declared before as {old.spec.dtype}{list(old.spec.shape)}, "
                    f"now as {spec.dtype}{list(spec.shape)}"
                )
        new = [spec for spec in reference if spec.name not in self._planned]
        pieces = sum(max(1, -(-spec.nbytes // limits.chunk_bytes)) for spec in new)
        if pieces > MAX_PLAN_CHUNKS:
            return self._fail(
                f"tensor declaration {seq} rejected: its tensors need {pieces} chunks of {limits.chunk_bytes} bytes, "
                f"more than the {MAX_PLAN_CHUNKS} one declaration may have (declare them in several parts)"
            )
        plans, self._loads = plan_tensors(
            new, len(self._planned), self.servers, limits.chunk_bytes, self._loads
        )
        self._planned.update((p.spec.name, p) for p in plans)
        decl.plans = [self._planned[spec.name] for spec in reference]
        options = {spec.name: opt for spec, opt in decl.by_rank[0]}
        outs = []
        for server in self._of_role("server"):
            shard = [
                [p.key, p.spec.name, p.spec.dtype, options[p.spec.name],
                 [[c.chunk, c.length] for c in p.chunks if c.server == server.rank]]
                for p in plans
            ]
            plan = self._msg(Kind.PLAN, seq=seq, tensors=shard, limits=limits.as_list())
            self.recovery.sent(server.name, plan)
            outs.append((server.name, plan))
        decl.table = [
            [p.key, p.spec.name, list(p.spec.shape), p.spec.dtype, p.priority,
             [[c.chunk, c.offset, c.length, c.server] for c in p.chunks]]
            for p in decl.plans
        ]
        # aggregators learn every chunk (its size and server) before any worker may push one to them
        outs += [(a.name, self._msg(Kind.PLAN, seq=seq, tensors=decl.table, limits=limits.as_list()))
                 for a in self._of_role("aggregator")]
        return outs

    def _settle_limits(self, decl: _Declaration) -> Limits:
        """Fix the job's chunk size and in-flight bound: as configured, else from the calibrations."""
        proposed = agree(list(decl.proposals.values())) if decl.proposals else None
        chunk = self.chunk_bytes or (proposed.chunk_bytes if proposed else DEFAULT_CHUNK_BYTES)
        inflight = self.inflight_bytes or (proposed.inflight_bytes if proposed else DEFAULT_INFLIGHT_BYTES)
        self.limits = Limits(chunk, inflight)
        how = {True: "configured", False: "calibrated" if proposed else "default"}
        self.notes.append(
            f"chunk size {chunk >> 10} KiB ({how[bool(self.chunk_bytes)]}), in-flight bound {inflight >> 10} KiB "
            f"({how[bool(self.inflight_bytes)]})"
            + (f"; workers proposed {', '.join(f'{r}: {p.describe()}' for r, p in sorted(decl.proposals.items()))}"
               if decl.proposals else "")
        )
        return self.limits

    def _on_plan_ack(self, node: Node, msg: Message) -> list[Out]:
        seq = meta_field(msg, "seq", int)
        if self.recovery.recovering(node.name):  # a replacement acknowledging a plan sent again
            outs = self._server_back(node) if self.recovery.acked(node.name, seq) else []
            return outs + (self._on_plan_ack_of(node, seq) if seq in self._declarations else [])
        return self._on_plan_ack_of(node, seq)

    def _on_plan_ack_of(self, node: Node, seq: int) -> list[Out]:
        decl = self._declarations.get(seq)
        if decl is None or len(decl.by_rank) < self.workers:  # not yet planned: no server has been sent it
            raise WireError(f"PLAN_ACK for unknown declaration {seq}")
        decl.acks.add(node.name)
        if len(decl.acks) < self.servers + self.aggregators:
            return []
        table = decl.table
        del self._declarations[seq]
        limits = (self.limits or Limits(DEFAULT_CHUNK_BYTES, DEFAULT_INFLIGHT_BYTES)).as_list()
        return [
            (w.name, self._msg(Kind.PLAN, seq=seq, tensors=table, limits=limits)) for w in self._of_role("worker")
        ]

    def _on_barrier(self, node: Node, msg: Message) -> list[Out]:
        name = meta_field(msg, "name", str)
        arrived = self._barriers.setdefault(name, set())
        arrived.add(node.rank)
        if len(arrived) < self.workers:
            return []
        del self._barriers[name]
        return [(w.name, self._msg(Kind.RELEASE, name=name)) for w in self._of_role("worker")]

    def _on_bye(self, node: Node) -> list[Out]:
        self.byes.add(node.name)
        serving = self._of_role("server") + self._of_role("aggregator")
        if not all(w.name in self.byes for w in self._of_role("worker")):
            if node.role != "worker":
                return []
            # servers and aggregators fail at once any round that now waits for this worker, instead of stalling
            return [(s.name, self._msg(Kind.BYE, rank=node.rank)) for s in serving] + self.switch.gone(node.name)
        self.phase, self.exit_code = "done", 0
        return [(s.name, self._msg(Kind.SHUTDOWN)) for s in serving]


def parse_job_report(raw: object) -> tuple[int, int, int]:
    """A heartbeat's `job` field: [level, bytes pushed, rounds], each an int in [0, 2**53)."""
    if type(raw) is not list or len(raw) != 3 or not all(type(v) is int and 0 <= v < 1 << 53 for v in raw):
        raise WireError(f"a heartbeat's job report must be [level, bytes pushed, rounds], got {brief(raw)}")
    return raw[0], raw[1], raw[2]
