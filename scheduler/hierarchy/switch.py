"""Switching a job to new aggregation trees between rounds, with no update lost or counted twice; no sockets.

Every round of a chunk must travel one tree on every worker: an aggregator waits for exactly the
ranks its tree sends it. Workers reach a round at different moments, so the switch point is agreed,
not assumed:
  1. ROUTES(epoch, trees) to every aggregator; each installs the trees (keeping older epochs, whose
     rounds may still be in flight) and answers ROUTES_ACK.
  2. Then ROUTES to every worker. A worker answers ROUTES_ACK with the last round it has started of
     every tensor, and from then on holds (queues, without blocking its caller) every round it starts.
  3. With every worker's answer, COMMIT(epoch, [[key, round], ...]) gives each tensor its switch
     round: one past the last round any worker had started. Rounds before it keep the old trees,
     rounds from it on take the new ones (a tensor not listed switches at once); the workers then
     send what they held.
Inside the round in flight too: at ROUTES a worker also takes back its pushes of that round still in
its send queue and lists them (`held`), and the COMMIT's `moved` names the chunks whose pushes take the
new trees after all, and whose (scheduler/hierarchy/midround.py: whole groups of both trees, held by
all of them); the rest go where they were going.
A round started before a worker's answer is below the switch round, so it keeps the trees every
other worker used for it; a round at or above the switch round was held until COMMIT, so no worker
sent it on the old trees. A round may outlast several switches (a long one behind a slow uplink, while
the trees are re-planned), so every node keeps the epochs its rounds may still travel: each worker's
answer names the oldest epoch of its rounds in flight (`oldest`); none older can come into use again (a
round a worker has yet to start of those below the switch round is in flight at another worker, which
named its epoch), so the COMMIT tells the workers, and the next ROUTES the aggregators, to forget the
epochs before the oldest named (`keep_from`; never one of the last three, and never more than
routes.MAX_EPOCHS kept). A worker that leaves during a switch counts as having answered with nothing.

A standby scheduler that takes over (scheduler/standby.py) rebuilds this from what each node was told
of the last switch (`Told`: its ROUTES, a worker's answer, the COMMIT; scheduler/rejoin.py) and goes
on from the newest epoch E (`resume`): when some worker has E's COMMIT, every worker had answered, and
the others get the same COMMIT; when an aggregator lacks E, no worker was told of it, and the
aggregators that lack it are told again; else the workers' answers are kept, the workers without one
are told E (again: a worker told the same trees again answers again, worker/routing.py), and the
COMMIT follows. A proposal the standby made before taking over is dropped: the job runs on trees
already, and a re-plan proposes anew.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sluice.scheduler.hierarchy.midround import Held, Moved, parse_moved, plan_moves
from sluice.scheduler.hierarchy.routes import Route, Routing, parse_routing, stale_epochs
from sluice.transport.wire import Kind, Message, WireError, brief

Out = tuple[str, Message]
#: tensors one ROUTES_ACK may list
MAX_ACK_KEYS = 1 << 17
#: the newest epochs always kept: a push sent again (recovery) may name one whose rounds are over
KEEP_EPOCHS = 3


def parse_rounds(raw: object) -> list[tuple[int, int]]:
    """A worker's ROUTES_ACK rounds [[key, round], ...], validated (WireError)."""
    if type(raw) is not list or len(raw) > MAX_ACK_KEYS:
        raise WireError(f"rounds must be a list of at most {MAX_ACK_KEYS} [key, round] pairs, got {brief(raw)}")
    pairs = []
    for item in raw:
        if (type(item) is not list or len(item) != 2 or not all(type(v) is int for v in item)
                or not 0 <= item[0] < 1 << 31 or not 0 <= item[1] < 1 << 62):
            raise WireError(f"a round entry must be [key, round], got {brief(item)}")
        pairs.append((item[0], item[1]))
    return pairs


@dataclass(frozen=True)
class Told:
    """What one node was told of the last switch: its ROUTES, its answer (a worker's rounds), the COMMIT (and
    the chunks it moved)."""

    routes: Routing | None = None
    acked: list[tuple[int, int]] | None = None
    committed: tuple[int, list[tuple[int, int]]] | None = None
    moved: tuple[Moved, ...] = ()


def parse_told(raw: object) -> Told:
    """A REJOIN's `routing` {routes, acked, committed} (None: told nothing), each part checked (WireError)."""
    if raw is None:
        return Told()
    if type(raw) is not dict or set(raw) != {"routes", "acked", "committed"}:
        raise WireError(f"a REJOIN's routing must be {{routes, acked, committed}}, got {brief(raw)}")
    committed: Any = raw["committed"]
    moved: list[Moved] = []
    if committed is not None:
        if type(committed) is not list or len(committed) not in (2, 3) or type(committed[0]) is not int:
            raise WireError(f"a REJOIN's last COMMIT must be [epoch, rounds, moved], got {brief(committed)}")
        moved = parse_moved(committed[2]) if len(committed) == 3 else []
        committed = (committed[0], parse_rounds(committed[1]))
    return Told(None if raw["routes"] is None else parse_routing(raw["routes"]),
                None if raw["acked"] is None else parse_rounds(raw["acked"]), committed, tuple(moved))


@dataclass
class _Switch:
    routing: Routing
    waiting_aggregators: set[str]
    waiting_workers: set[str] = field(default_factory=set)
    last_rounds: dict[int, int] = field(default_factory=dict)
    #: each worker's pushes of rounds in flight held back at ROUTES
    held: dict[str, list[Held]] = field(default_factory=dict)
    #: the oldest epoch any worker's rounds in flight travel, as they answered (0: none)
    oldest: int = 0


@dataclass
class RouteSwitch:
    """The scheduler's side of the switch protocol for one job (plain data: comparable, copyable)."""

    workers: list[str] = field(default_factory=list)
    aggregators: list[str] = field(default_factory=list)
    epoch: int = 0
    current: Routing | None = None
    started: bool = False
    _switch: _Switch | None = None
    _queued: tuple[Route, ...] | None = None
    _gone: set[str] = field(default_factory=set)
    #: the committed routings whose rounds may still be in flight, newest last
    history: list[Routing] = field(default_factory=list)
    #: the oldest epoch whose rounds may still be in flight (0: not known, every node keeps all it has)
    keep_from: int = 0

    @property
    def switching(self) -> bool:
        return self._switch is not None

    def start(self, workers: Sequence[str], aggregators: Sequence[str]) -> list[Out]:
        """The job has formed: these are its members; a proposal that came earlier starts now."""
        self.workers, self.aggregators, self.started = list(workers), list(aggregators), True
        return self._next()

    def propose(self, trees: Sequence[Route]) -> list[Out]:
        """New trees (already checked against the job's members); they replace any not yet begun."""
        self._queued = tuple(trees)
        return self._next() if self.started and self._switch is None else []

    def on_ack(self, name: str, role: str, epoch: int, rounds: list[tuple[int, int]],
               held: Sequence[Held] = (), oldest: int = 0) -> list[Out]:
        """A ROUTES_ACK: an aggregator's, or a worker's with its last `rounds` started, its pushes `held` back and
        the `oldest` epoch its rounds in flight travel (0: none)."""
        switch = self._switch
        if switch is None or epoch != switch.routing.epoch:
            raise WireError(f"ROUTES_ACK for epoch {epoch} from {name}, which is not being switched to")
        if role == "aggregator" and name in switch.waiting_aggregators:
            switch.waiting_aggregators.discard(name)
            return self._to_workers(switch) if not switch.waiting_aggregators else []
        if role == "worker" and name in switch.waiting_workers:
            switch.waiting_workers.discard(name)
            for key, round_ in rounds:
                switch.last_rounds[key] = max(round_, switch.last_rounds.get(key, 0))
            switch.held[name] = list(held)
            if oldest:
                switch.oldest = min(oldest, switch.oldest or oldest)
            return self._commit(switch) if not switch.waiting_workers else []
        raise WireError(f"unexpected ROUTES_ACK for epoch {epoch} from {name}")

    def gone(self, name: str) -> list[Out]:
        """A worker left (said goodbye): never wait for its answer."""
        self._gone.add(name)
        switch = self._switch
        if switch is None or name not in switch.waiting_workers:
            return []
        switch.waiting_workers.discard(name)
        return self._commit(switch) if not switch.waiting_workers and not switch.waiting_aggregators else []

    def resume(self, told: Mapping[str, Told], workers: Sequence[str], aggregators: Sequence[str],
               gone: Sequence[str]) -> list[Out]:
        """A standby's takeover: this switch rebuilt from what each member was `told`; the messages that finish
        a switch left open (or that start the standby's own first one when no node was told of trees)."""
        self.workers, self.aggregators, self.started, self._gone = list(workers), list(aggregators), True, set(gone)
        routes = {name: t.routes for name, t in told.items() if t.routes is not None}
        if not routes:
            return self._next()
        newest = max(routes.values(), key=lambda r: r.epoch)
        has = {name for name, r in routes.items() if r.epoch == newest.epoch}
        if any(routes[name] != newest for name in has):
            raise WireError(f"the nodes were told different trees for routing epoch {newest.epoch}")
        self.epoch, self._queued = newest.epoch, None
        live = [w for w in workers if w not in self._gone]
        done = [told[name] for name in has if (told[name].committed or (0,))[0] == newest.epoch]
        if done:  # every worker had answered: the COMMIT was on its way
            self.current, self.history = newest, [newest]
            rounds = done[0].committed[1] if done[0].committed else []
            commit = _message(Kind.COMMIT, epoch=newest.epoch, rounds=[list(pair) for pair in rounds],
                              **_moved_meta(done[0].moved))
            return [(w, commit) for w in live if w in has and (told[w].committed or (0,))[0] != newest.epoch]
        lacking = {a for a in aggregators if a not in has}
        switch = self._switch = _Switch(newest, lacking)
        if lacking:  # no worker was told yet: step 1 again, for the aggregators that missed it
            message = _message(Kind.ROUTES, routes=newest.encode())
            return [(a, message) for a in sorted(lacking)]
        for name in live:
            acked = told[name].acked if name in has else None
            if acked is None:
                switch.waiting_workers.add(name)
            for key, round_ in acked or ():
                switch.last_rounds[key] = max(round_, switch.last_rounds.get(key, 0))
        if not switch.waiting_workers:
            return self._commit(switch)
        message = _message(Kind.ROUTES, routes=newest.encode())
        return [(name, message) for name in sorted(switch.waiting_workers)]

    def _next(self) -> list[Out]:
        if self._queued is None:
            return []
        trees, self._queued = self._queued, None
        self.epoch += 1
        routing = Routing(self.epoch, trees)
        self._switch = _Switch(routing, set(self.aggregators))
        if not self.aggregators:
            return self._to_workers(self._switch)
        message = _message(Kind.ROUTES, routes=routing.encode(), **self._keep_meta())
        return [(name, message) for name in self.aggregators]

    def _to_workers(self, switch: _Switch) -> list[Out]:
        switch.waiting_workers = {w for w in self.workers if w not in self._gone}
        if not switch.waiting_workers:
            return self._commit(switch)
        message = _message(Kind.ROUTES, routes=switch.routing.encode())
        return [(name, message) for name in sorted(switch.waiting_workers)]

    def installed(self, aggregator: str) -> list[Out]:
        """A replaced aggregator (ps.recover): the routings it must hold again, oldest first; only an open
        switch's that it has yet to acknowledge asks for an answer (meta `again` marks the others)."""
        outs = [(aggregator, _message(Kind.ROUTES, routes=r.encode(), again=True)) for r in self.history]
        if (switch := self._switch) is not None:
            again = aggregator not in switch.waiting_aggregators
            outs.append((aggregator, _message(Kind.ROUTES, routes=switch.routing.encode(),
                                              **({"again": True} if again else {}))))
        return outs

    def _keep_meta(self) -> dict[str, int]:
        return {"keep_from": self.keep_from} if self.keep_from else {}  # absent: 0, keep every epoch

    def _commit(self, switch: _Switch) -> list[Out]:
        held = {name: entries for name, entries in switch.held.items() if name not in self._gone}
        moved = plan_moves(held, self.workers, self.history, switch.routing)
        newest = switch.routing.epoch
        self.keep_from = max(0, min(switch.oldest or newest, newest - KEEP_EPOCHS + 1))
        history = [*self.history, switch.routing]
        stale = set(stale_epochs((r.epoch for r in history), self.keep_from))
        self.history = [r for r in history if r.epoch not in stale]
        self.current, self._switch = switch.routing, None
        rounds = [[key, last + 1] for key, last in sorted(switch.last_rounds.items())]
        message = _message(Kind.COMMIT, epoch=newest, rounds=rounds, **self._keep_meta(), **_moved_meta(moved))
        return [(name, message) for name in self.workers if name not in self._gone] + self._next()


def switch_notes(outs: Sequence[Out]) -> list[str]:
    """Log lines for the switch messages among `outs`: each kind and epoch once, with the roles it went to
    (the times of these lines are the switch's steps: bench/replan.py reads them)."""
    sent: dict[tuple[str, int], dict[str, int]] = {}
    for name, msg in outs:
        meta = msg.meta or {}
        if msg.kind == Kind.ROUTES:
            epoch = meta["routes"][0]
        elif msg.kind == Kind.COMMIT:
            epoch = meta["epoch"]
        else:
            continue
        roles = sent.setdefault((msg.kind.name, epoch), {})
        role = name.rpartition("-")[0] or name
        roles[role] = roles.get(role, 0) + 1
        moved = meta.get("moved") if msg.kind == Kind.COMMIT else None
        if moved and ("moved", epoch) not in sent:
            sent[("moved", epoch)] = {"chunk": len(moved), "push": sum(len(m[3]) for m in moved)}
    return [f"routing epoch {epoch}: moved onto its trees inside the rounds in flight: {roles['chunk']} chunks, "
            f"{roles['push']} pushes" if kind == "moved" else
            f"routing epoch {epoch}: {kind} sent to " + ", ".join(f"{n} {role}s" for role, n in sorted(roles.items()))
            for (kind, epoch), roles in sent.items()]


def _moved_meta(moved: Sequence[Moved]) -> dict[str, object]:
    """A COMMIT's `moved` (left out when nothing moved)."""
    return {"moved": [[key, round_, chunk, list(workers)] for key, round_, chunk, workers in moved]} if moved else {}


def _message(kind: Kind, **meta: object) -> Message:
    return Message(kind, sender=0, meta=dict(meta))
