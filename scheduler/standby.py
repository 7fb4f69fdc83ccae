"""A standby scheduler's takeover (pure): the nodes' REJOINs checked and gathered until the job can be rebuilt.

When the scheduler falls silent, every node sends the standby a REJOIN (scheduler/rejoin.py). The
standby waits for each member of the job, but the workers some node was told had left, and at most
`wait` seconds after the first REJOIN; then the rendezvous (scheduler/rendezvous.py) rebuilds
itself from them: the members with the ids and ranks they had, the declarations replayed in the order
the scheduler planned them (the partition is deterministic, so the plans, loads and keys come out
the same), the limits, the workers gone, the barriers released, and the aggregation trees' routing
epoch, finishing a switch the scheduler left open (scheduler/hierarchy/switch.py `RouteSwitch.resume`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sluice.scheduler.bootstrap import node_name
from sluice.scheduler.calibration import Limits
from sluice.scheduler.declaration import parse_limits
from sluice.scheduler.hierarchy.switch import Told, parse_told
from sluice.scheduler.members import Node, address_book
from sluice.transport.wire import Kind, Message, WireError, brief, meta_field

if TYPE_CHECKING:
    from sluice.scheduler.rendezvous import Out, Rendezvous

#: declarations one REJOIN may name (a job declares a few per model; a PLAN bounds each one's size)
MAX_DECLARATIONS = 4096
#: the longest job name a REJOIN may carry (what the job registries take: scheduler/jobs_registry.py)
MAX_JOB_NAME = 200


@dataclass(frozen=True)
class Rejoin:
    role: str
    rank: int
    node_id: int
    endpoints: list[str]
    pid: int
    #: (order, key, seq, ranks or None, tensors as declared), for a worker
    declarations: list[tuple[int, int, int, list[int] | None, list[Any]]]
    limits: Limits | None
    gone: frozenset[int]
    released: frozenset[str]
    #: what it was told of the last switch of aggregation trees
    told: Told
    #: the endpoint of the scheduler it registered with: the job's name in the registries
    job: str
    #: a server's mirror links now (ps.replicas): {"holders": ranks, first the one that takes over; "holds": ranks}
    mirror: dict[str, list[int]] | None = None


def _ints(raw: object, what: str, bound: int) -> list[int]:
    if type(raw) is not list or len(raw) > bound or not all(type(v) is int and 0 <= v < bound for v in raw):
        raise WireError(f"a REJOIN's {what} must be a list of ints in 0..{bound - 1}, got {brief(raw)}")
    return list(raw)


def parse_rejoin(peer: str, msg: Message, fingerprint: str, workers: int, nodes: int, servers: int = 0,
                 generation: int = 0) -> Rejoin:
    """A REJOIN from `peer`, every field checked (WireError): the same job and `generation`, its name, an id in
    1..`nodes`."""
    role, rank, node_id = meta_field(msg, "role", str), meta_field(msg, "rank", int), meta_field(msg, "node_id", int)
    if peer != node_name(role, rank):
        raise WireError(f"REJOIN as {brief(role)} {rank} from a connection named {peer!r:.60}")
    if meta_field(msg, "fingerprint", str) != fingerprint:
        raise WireError(f"{peer} rejoins with a different configuration than the standby's")
    if (theirs := meta_field(msg, "generation", int)) != generation:
        raise WireError(f"{peer} rejoins from generation {theirs} of the job; this standby serves generation "
                        f"{generation} (a connection from before the job re-formed)")
    if not 1 <= node_id <= nodes:
        raise WireError(f"REJOIN with node id {node_id}, not in 1..{nodes}")
    endpoints = meta_field(msg, "endpoints", list)
    if not all(type(e) is str for e in endpoints) or (role == "server" and not endpoints):
        raise WireError("REJOIN endpoints must be a list of strings (non-empty for a server)")
    raw = meta_field(msg, "declarations", list)
    if len(raw) > MAX_DECLARATIONS or (raw and role != "worker"):
        raise WireError(f"a {role}'s REJOIN names {len(raw)} declarations")
    declarations = []
    for entry in raw:
        if type(entry) is not list or len(entry) != 5 or not all(type(v) is int for v in entry[:3]) \
                or type(entry[4]) is not list or entry[0] < 0:
            raise WireError(f"a REJOIN's declaration must be [order, key, seq, ranks, tensors], got {brief(entry)}")
        ranks = None if entry[3] is None else _ints(entry[3], "ranks", workers)
        declarations.append((entry[0], entry[1], entry[2], ranks, entry[4]))
    job = meta_field(msg, "job", str)
    if not 0 < len(job) <= MAX_JOB_NAME:
        raise WireError(f"a REJOIN's job must name the scheduler's endpoint (1..{MAX_JOB_NAME} characters)")
    limits_raw = (msg.meta or {}).get("limits")
    released = meta_field(msg, "released", list)
    if len(released) > 1024 or not all(type(n) is str and len(n) <= 1024 for n in released):
        raise WireError(f"a REJOIN's released barriers must be names, got {brief(released)}")
    mirror_raw = (msg.meta or {}).get("mirror")
    if mirror_raw is not None and (role != "server" or type(mirror_raw) is not dict
                                   or set(mirror_raw) != {"holders", "holds"}):
        raise WireError(f"a {role}'s REJOIN names mirror links {brief(mirror_raw)}")
    mirror = None if mirror_raw is None else {name: _ints(mirror_raw[name], f"mirror {name}", servers)
                                               for name in ("holders", "holds")}
    return Rejoin(role, rank, node_id, list(endpoints), meta_field(msg, "pid", int), declarations,
                  parse_limits(limits_raw) if limits_raw is not None else None,
                  frozenset(_ints(meta_field(msg, "gone", list), "gone workers", workers)), frozenset(released),
                  parse_told((msg.meta or {}).get("routing")), job, mirror)


class Takeover:
    """The REJOINs so far, and whether the standby may rebuild the job from them."""

    def __init__(self, workers: int, servers: int, aggregators: int, wait: float) -> None:
        self.members = [node_name(role, rank) for role, count in (("server", servers), ("worker", workers),
                                                                  ("aggregator", aggregators)) for rank in range(count)]
        self.wait = wait
        self.rejoins: dict[str, Rejoin] = {}
        self.first: float | None = None

    def add(self, peer: str, rejoin: Rejoin, now: float) -> None:
        if peer not in self.members:
            raise WireError(f"REJOIN from {peer!r:.60}, not a member of this job")
        taken = {r.node_id for name, r in self.rejoins.items() if name != peer}
        if rejoin.node_id in taken:
            raise WireError(f"{peer} rejoins with node id {rejoin.node_id}, which another node has")
        if (job := self.job()) and rejoin.job != job:
            raise WireError(f"{peer} rejoins from the job of the scheduler at {rejoin.job!r:.60}, the others from "
                            f"{job!r:.60}")
        self.rejoins[peer] = rejoin
        self.first = now if self.first is None else self.first

    def job(self) -> str:
        """The job's name in the registries (the silent scheduler's endpoint, as every node rejoined with it)."""
        return next((r.job for r in self.rejoins.values()), "")

    def gone(self) -> set[int]:
        return {rank for r in self.rejoins.values() for rank in r.gone}

    def missing(self) -> list[str]:
        """Members that have not rejoined and that no node was told had left."""
        gone = {node_name("worker", rank) for rank in self.gone()}
        return [name for name in self.members if name not in self.rejoins and name not in gone]

    def ready(self, now: float) -> bool:
        """Every member is in, or `wait` seconds passed since the first REJOIN."""
        return self.first is not None and (not self.missing() or now - self.first > self.wait)

    def declarations(self) -> Iterator[tuple[int, int, list[int] | None, dict[int, list[Any]]]]:
        """(key, seq, ranks, each member's tensors) of every declaration, in the order they were planned."""
        found: dict[int, tuple[int, int, list[int] | None, dict[int, list[Any]]]] = {}
        for rejoin in self.rejoins.values():
            for order, key, seq, ranks, tensors in rejoin.declarations:
                entry = found.setdefault(key, (order, seq, ranks, {}))
                if (entry[0], entry[1], entry[2]) != (order, seq, ranks):
                    raise WireError(f"workers disagree on declaration {key}: {entry[:3]} and {(order, seq, ranks)}")
                entry[3][rejoin.rank] = tensors
        # Keys are given in planning order (rendezvous.py), so a replay rebuilds them only from every declaration up
        # to the last one seen. One planned before it that no worker saw (its PLAN lost with the scheduler while a
        # later one's arrived, or its set's workers all gone) would have its keys, which the servers hold, given to
        # the next: their pushes would be refused, and their workers wait until op_timeout.
        orders = sorted(entry[0] for entry in found.values())
        if len(set(orders)) < len(orders):
            raise WireError(f"workers report two declarations at one place in the planning order ({brief(orders)})")
        if orders != list(range(len(orders))):
            lost = next(i for i, order in enumerate(orders) if order != i)  # the first gap (sorted, distinct)
            raise WireError(f"no worker saw declaration {lost} (in planning order) planned, but later ones were: "
                            "planned again without it, they would take its keys, which the servers hold for it")
        for key, (_order, seq, ranks, tables) in sorted(found.items(), key=lambda item: item[1][0]):
            yield key, seq, ranks, tables

    def limits(self) -> Limits | None:
        return next((r.limits for r in self.rejoins.values() if r.limits is not None), None)

    def released(self) -> dict[str, set[int]]:
        """The barriers released before the takeover, each with the workers that missed its release (to answer)."""
        workers = [r for r in self.rejoins.values() if r.role == "worker"]
        return {name: {r.rank for r in workers if name not in r.released} for r in workers for name in r.released}


def take_over(machine: Rendezvous, now: float) -> list[Out]:
    """Rebuild the job from the REJOINs (scheduler/standby.py) and welcome every node back."""
    assert machine.takeover is not None
    takeover = machine.takeover
    for name, r in takeover.rejoins.items():
        machine.nodes[name] = Node(name, r.role, r.rank, r.endpoints, r.pid, r.node_id, r.node_id, r.rank)
    machine.phase, machine.limits = "running", takeover.limits() or machine.limits
    machine.last_seen = dict.fromkeys(machine.nodes, now)
    machine.byes = {f"worker-{rank}" for rank in takeover.gone()}
    machine._released_before = takeover.released()
    if missing := takeover.missing():
        return machine._fail(f"{', '.join(missing)} did not rejoin the standby scheduler within {takeover.wait:g} s "
                             "of the first node: lost with the scheduler")
    # ps.replicas: the copies as the servers keep them now (some may have moved since the placement), before the
    # replay plans: each holder gets its primaries' part of a PLAN
    machine.recovery.rebuild({r.rank: r.mirror["holders"] for r in takeover.rejoins.values() if r.mirror is not None})
    try:
        replayed = _replay(machine, takeover)
    except WireError as exc:
        return machine._fail(f"the standby scheduler cannot rebuild the job from the nodes: {exc}")
    machine.notes.append(f"took over from the silent scheduler: {len(machine.nodes)} nodes rejoined, {replayed} "
                         f"declarations replayed, workers gone before: {sorted(takeover.gone()) or 'none'}")
    book = address_book(sorted(machine.nodes.values(), key=lambda n: n.node_id))
    welcomes: list[Out] = [(n.name, machine._msg(Kind.WELCOME, node_id=n.node_id, rank=n.rank, role=n.role,
                                                 nodes=book, rejoined=True)) for n in machine.nodes.values()]
    try:
        switching = machine.switch.resume(
            {name: r.told for name, r in takeover.rejoins.items()},
            [n.name for n in machine._of_role("worker")], [n.name for n in machine._of_role("aggregator")],
            [node_name("worker", rank) for rank in takeover.gone()])
    except WireError as exc:
        return machine._fail(f"the standby scheduler cannot rebuild the aggregation trees from the nodes: {exc}")
    if machine.switch.epoch:
        machine.notes.append(f"aggregation trees at routing epoch {machine.switch.epoch}"
                             f"{'; finishing the switch to it' if switching else ''}")
    # a worker's goodbye that the scheduler told some nodes only before it died: the others too, or their rounds
    # and collectives waiting for that worker would wait until their timeouts
    gone = takeover.gone()
    late = [(name, machine._msg(Kind.BYE, rank=rank)) for name, r in takeover.rejoins.items()
            for rank in sorted(gone - r.gone)]
    return welcomes + late + switching


def _replay(machine: Rendezvous, takeover: Takeover) -> int:
    """Plan again, in the scheduler's order, every declaration some worker saw planned; what it would send
    is not sent (the nodes have it), but the workers' PLAN is kept for a worker that asks again."""
    servers, count = machine._of_role("server") + machine._of_role("aggregator"), 0  # each PLAN's acknowledgers
    for key, seq, ranks, tables in takeover.declarations():
        members = list(range(machine.workers)) if ranks is None else ranks
        if ranks is not None:
            machine._set_seqs[(tuple(ranks), seq)] = key
        for rank in members:
            meta = {"seq": seq, "tensors": tables.get(rank, tables[min(tables)])}
            worker = Node(f"worker-{rank}", "worker", rank, [], 0, 0, rank=rank)
            machine._on_declare(worker, Message(Kind.DECLARE, meta=meta | ({"ranks": ranks} if ranks else {})))
        outs = [out for server in servers for out in machine._on_plan_ack_of(server, key)]
        if machine.phase == "failed" or not outs:
            raise WireError(f"declaration {key} did not plan again: {machine.error or 'no server acknowledged it'}")
        machine._replayed[key] = outs[0][1]
        count += 1
    return count
