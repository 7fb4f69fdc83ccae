"""The scheduler's protocol as a state machine: messages and clock ticks in, messages out.

No sockets and no clocks of its own: the executor in scheduler/service.py feeds it (peer, message,
now) and sends what it returns, so every rule here is testable with plain data. The members, their
ranks and ids are scheduler/members.py's; a tensor declaration's rules scheduler/declaration.py's.
"""

from __future__ import annotations

from typing import Any

from sluice.scheduler.bootstrap import node_name
from sluice.scheduler.calibration import Limits
from sluice.scheduler.config import SchedulerConfig
from sluice.scheduler.declaration import (
    Declaration,
    declaration_problem,
    parse_limits,
    parse_members,
    parse_tensor_table,
    server_shard,
    settle_limits,
    worker_table,
)
from sluice.scheduler.hierarchy.agent import Report, parse_report
from sluice.scheduler.hierarchy.midround import parse_held
from sluice.scheduler.hierarchy.routes import Route, check_trees, epoch_field
from sluice.scheduler.hierarchy.switch import RouteSwitch, parse_rounds
from sluice.scheduler.leaving import left, parse_error
from sluice.scheduler.members import ROLES, Node, address_book, assign
from sluice.scheduler.partition import TensorPlan, plan_tensors
from sluice.scheduler.recovery import ServerRecovery
from sluice.scheduler.returning import aggregator_returns, node_back, server_returns
from sluice.scheduler.standby import Takeover, parse_rejoin, take_over
from sluice.transport.config import DEFAULT_CHUNK_BYTES, DEFAULT_INFLIGHT_BYTES
from sluice.transport.wire import Kind, Message, WireError, brief, meta_field

Out = tuple[str, Message]
#: network reports kept per node (the manager takes each period's once all are in)
NET_REPORTS_KEPT = 4
#: the workers' PLANs kept for a worker that asks again (the latest declarations': a worker waits for one at a time)
KEPT_PLANS = 64


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
        standby: bool = False,
        generation: int = 0,
    ) -> None:
        self.workers, self.servers, self.aggregators, self.config = workers, servers, aggregators, config
        #: the job's generation (sluice launch --elastic): told in each WELCOME, and a REJOIN of another refused (a
        #: survivor's connection from before the job re-formed in place finds the standby on the same port)
        self.generation = generation
        #: server replacement under ps.recover (scheduler/recovery.py)
        self.recovery = recovery or ServerRecovery()
        #: the switch to new aggregation trees between rounds (scheduler/hierarchy/switch.py)
        self.switch = RouteSwitch()
        #: (role, rank) of the nodes that fell silent since the caller last looked (it tells the launcher, and
        #: clears it)
        self.silent_nodes: list[tuple[str, int]] = []
        #: each node's latest network reports (scheduler/hierarchy/agent.py), oldest first, by node name: the
        #: last few, as reports that queued behind data arrive together, and the manager needs every period
        self.net_reports: dict[str, list[Report]] = {}
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
        self.phase = "standby" if standby else "registering"
        #: a standby scheduler's (scheduler.standby): the nodes' REJOINs until it takes over (scheduler/standby.py)
        self.takeover = Takeover(workers, servers, aggregators, config.heartbeat_timeout) if standby else None
        #: the workers' PLAN of each declaration (by key) that went out, here or before a standby took over, for a
        #: worker asking again (the last KEPT_PLANS)
        self._replayed: dict[int, Message] = {}
        self._released_before: dict[str, set[int]] = {}
        self._plan_count = 0
        self.exit_code: int | None = None
        self.error = ""
        self.byes: set[str] = set()
        #: worker rank -> the exception that ended its process, as its goodbye said (scheduler/leaving.py), in the
        #: order they left
        self.left_with_error: dict[int, str] = {}
        #: the node declared lost (no heartbeat), once the job failed for that reason
        self.lost: Node | None = None
        self._declarations: dict[int, Declaration] = {}
        #: (a process set's ranks, its declaration's seq) -> the negative seq it is known by here and on the servers
        self._set_seqs: dict[tuple[tuple[int, ...], int], int] = {}
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
        if self.phase == "standby":
            return self._on_standby(peer, msg, now)
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
                recent = self.net_reports.setdefault(peer, [])
                recent.append(report)
                del recent[:-NET_REPORTS_KEPT]
            if msg.meta and "job" in msg.meta:
                self.job_reports[peer] = parse_job_report(msg.meta["job"])
            return [(peer, self._msg(Kind.HEARTBEAT_ACK))]
        if msg.kind == Kind.DECLARE and node.role == "worker":
            return self._on_declare(node, msg)
        if msg.kind == Kind.PLAN_ACK and node.role in ("server", "aggregator"):
            return self._on_plan_ack(node, msg)
        if msg.kind == Kind.ROUTES_ACK and node.role in ("worker", "aggregator"):
            rounds = parse_rounds((msg.meta or {}).get("rounds", []))
            held = parse_held((msg.meta or {}).get("held", []))
            oldest = epoch_field(msg.meta, "oldest")
            return self.switch.on_ack(node.name, node.role, meta_field(msg, "epoch", int), rounds, held, oldest)
        if msg.kind == Kind.BARRIER and node.role == "worker":
            return self._on_barrier(node, msg)
        if msg.kind == Kind.BYE:
            return self._on_bye(node, parse_error(msg.meta))
        raise WireError(f"unexpected {msg.kind.name} from {node.describe()}")

    def on_tick(self, now: float) -> list[Out]:
        if self.phase == "standby" and self.takeover is not None and self.takeover.ready(now):
            return take_over(self, now)
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
                    # waited for (ps.recover): the launcher may find its host lost sooner (scheduler/recovery.py);
                    # a node not waited for has failed the job already, which the launcher hears at once
                    self.silent_nodes.append((node.role, node.rank))
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
        if self.phase == "running" and returning is not None and returning.role == role and self.recovery.enabled:
            if role == "server":
                return server_returns(self, returning, msg, now)
            if role == "aggregator":
                return aggregator_returns(self, returning, msg, now)
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

    def _assign(self, now: float) -> list[Out]:
        error = assign(self.nodes.values())
        if error is not None:
            return self._fail(error)
        self.phase = "running"
        self.last_seen = dict.fromkeys(self.nodes, now)
        book = address_book(self.nodes.values())
        welcomes = [(n.name, self.welcome(n, book)) for n in self.nodes.values()]
        names = {role: [n.name for n in self._of_role(role)] for role in ROLES}
        return welcomes + self.switch.start(names["worker"], names["aggregator"])

    def welcome(self, node: Node, book: list[Any]) -> Message:
        """`node`'s WELCOME: its id and rank, the address book, and a server's mirror links (ps.replicas)."""
        servers = [n.endpoints for n in self._of_role("server")]
        mirror = self.recovery.links(node.rank, servers) if node.role == "server" else {}
        return self._msg(Kind.WELCOME, node_id=node.node_id, rank=node.rank, role=node.role, nodes=book,
                         generation=self.generation, **({"mirror": mirror} if mirror else {}))

    def propose_routes(self, trees: list[Route]) -> list[Out]:
        """Switch the job to new aggregation trees between rounds (ValueError if they do not fit the job)."""
        check_trees(trees, [node_name("worker", r) for r in range(self.workers)],
                    [node_name("aggregator", r) for r in range(self.aggregators)])
        return self.switch.propose(trees) if self.phase in ("registering", "running") else []

    def _on_declare(self, node: Node, msg: Message) -> list[Out]:
        """A worker's DECLARE: planned once every worker (or every one of a process set's `ranks`) declared it.
        A process set's declarations are numbered apart and keyed, here and on the servers, by a negative seq."""
        seq = meta_field(msg, "seq", int)
        table = parse_tensor_table(meta_field(msg, "tensors", list))
        proposal = (msg.meta or {}).get("limits")
        limits_proposed = parse_limits(proposal) if proposal is not None else None  # all checked before any change
        raw_ranks = (msg.meta or {}).get("ranks")
        members = list(range(self.workers)) if raw_ranks is None else parse_members(raw_ranks, self.workers, node.rank)
        if raw_ranks is not None:
            if self.aggregators:
                raise WireError("a process set's tensors cannot go through aggregators: its workers use allreduce")
            # below every key in use: a standby knows only the keys some worker saw planned, not one a set took
            # at its first declaration before the scheduler died (counting them would give a planned one again)
            seq = self._set_seqs.setdefault((tuple(members), seq), min(self._set_seqs.values(), default=0) - 1)
        if seq in self._replayed:  # its PLAN went out (or before this standby took over): a worker asking again
            return [(node.name, self._replayed[seq])]
        decl = self._declarations.setdefault(seq, Declaration(members=members, reply_seq=meta_field(msg, "seq", int)))
        if decl.members != members:
            raise WireError(f"worker {node.rank} declares set {members}'s tensors under declaration {seq} of "
                            f"workers {decl.members}")
        if decl.order >= 0:  # asked again while the servers acknowledge its plan: the PLAN comes after them
            return []
        decl.by_rank[node.rank] = table
        if limits_proposed is not None:
            decl.proposals[node.rank] = limits_proposed
        if len(decl.by_rank) < len(members):
            return []
        if self.limits is None:  # at the first declaration
            self.limits, note = settle_limits(self.chunk_bytes, self.inflight_bytes, decl.proposals)
            self.notes.append(note)
        limits = self.limits
        problem = declaration_problem(seq, decl, self._planned, limits.chunk_bytes)
        if problem is not None:
            return self._fail(problem)
        reference = [spec for spec, _ in decl.by_rank[members[0]]]
        new = [spec for spec in reference if spec.name not in self._planned]
        plans, self._loads = plan_tensors(
            new, len(self._planned), self.servers, limits.chunk_bytes, self._loads
        )
        self._planned.update((p.spec.name, p) for p in plans)
        decl.order, self._plan_count = self._plan_count, self._plan_count + 1
        decl.plans = [self._planned[spec.name] for spec in reference]
        options = {spec.name: opt for spec, opt in decl.by_rank[members[0]]}
        outs = []
        shared = members if raw_ranks is not None else None
        servers = self._of_role("server")
        mirrored_by = self.recovery.mirrored_by([s.endpoints for s in servers])
        for server in servers:
            # ps.replicas: a holder checks its primaries' MIRRORs against their plans
            mirrors = {str(r): server_shard(plans, r, options, shared) for r in mirrored_by.get(server.rank, ())}
            plan = self._msg(Kind.PLAN, seq=seq, tensors=server_shard(plans, server.rank, options, shared),
                             limits=limits.as_list(), **({"mirrors": mirrors} if mirrors else {}))
            self.recovery.sent(server.name, plan)
            outs.append((server.name, plan))
        decl.table = worker_table(decl.plans)
        # aggregators learn every chunk (its size and server) before any worker may push one to them
        for aggregator in self._of_role("aggregator"):
            plan = self._msg(Kind.PLAN, seq=seq, tensors=decl.table, limits=limits.as_list())
            self.recovery.sent(aggregator.name, plan)
            outs.append((aggregator.name, plan))
        return outs

    def _on_plan_ack(self, node: Node, msg: Message) -> list[Out]:
        seq = meta_field(msg, "seq", int)
        if self.recovery.recovering(node.name):  # a replacement acknowledging a plan sent again
            outs = node_back(self, node) if self.recovery.acked(node.name, seq) else []
            return outs + (self._on_plan_ack_of(node, seq) if seq in self._declarations else [])
        return self._on_plan_ack_of(node, seq)

    def _on_plan_ack_of(self, node: Node, seq: int) -> list[Out]:
        decl = self._declarations.get(seq)
        if decl is None or len(decl.by_rank) < len(decl.members):  # not yet planned: no server has been sent it
            raise WireError(f"PLAN_ACK for unknown declaration {seq}")
        decl.acks.add(node.name)
        if len(decl.acks) < self.servers + self.aggregators:
            return []
        table = decl.table
        del self._declarations[seq]
        limits = (self.limits or Limits(DEFAULT_CHUNK_BYTES, DEFAULT_INFLIGHT_BYTES)).as_list()
        # order and key: what a standby replays it by, should the workers rejoin one (scheduler/standby.py)
        if seq >= 0:
            plan = self._msg(Kind.PLAN, seq=seq, tensors=table, limits=limits, order=decl.order, key=seq)
        else:
            plan = self._msg(Kind.PLAN, seq=decl.reply_seq, tensors=table, limits=limits, ranks=decl.members,
                             order=decl.order, key=seq)
        self._replayed[seq] = plan  # for a worker that asks again: one dropped in a brief disconnect
        while len(self._replayed) > KEPT_PLANS:
            del self._replayed[next(iter(self._replayed))]
        return [(w.name, plan) for w in self._of_role("worker") if w.rank in decl.members]

    def _on_barrier(self, node: Node, msg: Message) -> list[Out]:
        name = meta_field(msg, "name", str)
        missed = self._released_before.get(name)
        if missed is not None and node.rank in missed:  # released before a standby took over; this worker missed it
            missed.discard(node.rank)
            if not missed:  # each told: the name may be used again
                del self._released_before[name]
            return [(node.name, self._msg(Kind.RELEASE, name=name))]
        arrived = self._barriers.setdefault(name, set())
        arrived.add(node.rank)
        if len(arrived) < self.workers:
            return []
        del self._barriers[name]
        return [(w.name, self._msg(Kind.RELEASE, name=name)) for w in self._of_role("worker")]

    # ------------------------------------------------------------------ a standby's takeover
    def _on_standby(self, peer: str, msg: Message, now: float) -> list[Out]:
        """A standby takes REJOINs (and acknowledges their heartbeats) until it takes over."""
        assert self.takeover is not None
        if msg.kind == Kind.REJOIN:
            total = self.workers + self.servers + self.aggregators
            self.takeover.add(peer, parse_rejoin(peer, msg, self.fingerprint, self.workers, total, self.servers,
                                                 self.generation), now)
            if self.takeover.first == now and len(self.takeover.rejoins) == 1:
                self.notes.append(f"{peer} rejoined this standby: the scheduler fell silent; waiting up to "
                                  f"{self.takeover.wait:g} s for the other nodes")
            return [(peer, self._msg(Kind.HEARTBEAT_ACK)), *(take_over(self, now) if self.takeover.ready(now) else [])]
        if msg.kind == Kind.HEARTBEAT:  # one sent as the node turned to this standby may overtake its REJOIN
            return [(peer, self._msg(Kind.HEARTBEAT_ACK))] if peer in self.takeover.rejoins else []
        raise WireError(f"{msg.kind.name} to the standby scheduler, which takes only REJOINs until it takes over")

    def _on_bye(self, node: Node, error: str) -> list[Out]:
        self.byes.add(node.name)
        if error and node.role == "worker":
            self.left_with_error[node.rank] = error
            self.notes.append(left(node.describe(), error))
        # a worker with a standby scheduler waits for this word before it leaves (scheduler/node.py)
        told = [(node.name, self._msg(Kind.SHUTDOWN))] if node.role == "worker" else []
        return told + self._bye_effects(node)

    def _bye_effects(self, node: Node) -> list[Out]:
        serving = self._of_role("server") + self._of_role("aggregator")
        if not all(w.name in self.byes for w in self._of_role("worker")):
            if node.role != "worker":
                return []
            # servers and aggregators fail at once any round that now waits for this worker, instead of
            # stalling, and so do the other workers' collectives (worker/collective/engine.py)
            staying = [w for w in self._of_role("worker") if w.name not in self.byes]
            said = {"error": self.left_with_error[node.rank]} if node.rank in self.left_with_error else {}
            told = [(s.name, self._msg(Kind.BYE, rank=node.rank, **said)) for s in serving + staying]
            return told + self.switch.gone(node.name)
        self.phase, self.exit_code = "done", 0
        return [(s.name, self._msg(Kind.SHUTDOWN)) for s in serving]


def parse_job_report(raw: object) -> tuple[int, int, int]:
    """A heartbeat's `job` field: [level, bytes pushed, rounds], each an int in [0, 2**53)."""
    if type(raw) is not list or len(raw) != 3 or not all(type(v) is int and 0 <= v < 1 << 53 for v in raw):
        raise WireError(f"a heartbeat's job report must be [level, bytes pushed, rounds], got {brief(raw)}")
    return raw[0], raw[1], raw[2]
