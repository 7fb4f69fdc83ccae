"""A node's side of the control plane: register, declare tensors, barriers, heartbeats, failures."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from sluice.errors import SluiceError
from sluice.scheduler import culprit
from sluice.scheduler.bootstrap import NodeEnv
from sluice.scheduler.calibration import Limits
from sluice.scheduler.config import SchedulerConfig
from sluice.scheduler.declaration import parse_limits
from sluice.scheduler.hierarchy.agent import NodeAgent
from sluice.scheduler.rejoin import Recall
from sluice.transport.base import Transport
from sluice.transport.wire import Kind, Message, WireError, brief, meta_field

log = logging.getLogger("sluice.node")

SCHEDULER_PEER = "scheduler"


@dataclass(frozen=True)
class PeerInfo:
    node_id: int
    role: str
    rank: int
    name: str
    endpoints: tuple[str, ...]


def endpoint_host(endpoints: Sequence[str]) -> str:
    """The host part of a node's first endpoint ("tcp://10.0.0.5:4000" -> "10.0.0.5"; ipc: "localhost"),
    which groups ranks by host in the coordinator tree and the ring, and places nodes in racks."""
    if not endpoints or not endpoints[0].startswith("tcp://"):
        return "localhost"
    address = endpoints[0][len("tcp://"):].rpartition(":")[0]
    return "localhost" if address.startswith(("127.", "[::1]", "localhost")) else address


def parse_address_book(raw: object) -> list[PeerInfo]:
    """[[node_id, role, rank, name, [endpoint, ...]], ...] of a WELCOME, validated (WireError)."""
    if type(raw) is not list:
        raise WireError(f"the address book must be a list, got {brief(raw)}")
    peers = []
    for entry in raw:
        if type(entry) is not list or len(entry) != 5:
            raise WireError(f"an address-book entry must be [node id, role, rank, name, endpoints], got {brief(entry)}")
        node_id, role, rank, name, endpoints = entry
        if (type(node_id) is not int or type(rank) is not int or type(role) is not str or type(name) is not str
                or type(endpoints) is not list or not all(type(e) is str for e in endpoints)):
            raise WireError(
                f"address-book entry of {brief(name)}: want int, str, int, str, list of str; got {brief(node_id)}, "
                f"{brief(role)}, {brief(rank)}, {brief(name)}, {brief(endpoints)}"
            )
        peers.append(PeerInfo(node_id, role, rank, name, tuple(endpoints)))
    return peers


class ControlClient:
    """Talks to the scheduler for one node; every wait has a deadline and ends on a job failure."""

    def __init__(
        self,
        transport: Transport,
        env: NodeEnv,
        config: SchedulerConfig,
        on_fatal: Callable[[str], None] = lambda _: None,
        on_message: Callable[[Message], None] = lambda _: None,
        on_welcome: Callable[[], None] = lambda: None,
    ) -> None:
        self._transport, self._env, self._config = transport, env, config
        self._on_fatal, self._on_other, self._on_welcome = on_fatal, on_message, on_welcome
        self._cond = threading.Condition()
        self._replies: dict[Hashable, Message] = {}
        self._declare_seq = 0
        #: declarations of each process set's tensors (by its ranks) so far: numbered apart from the job's
        self._set_declare_seqs: dict[tuple[int, ...], int] = {}
        self._last_ack = time.monotonic()
        self._stop = threading.Event()
        self.failure: str | None = None
        self.node_id = -1
        self.rank = -1
        self.role = ""
        self.peers: list[PeerInfo] = []
        #: the WELCOME's meta (a server reads its mirror links there, ps.replicas)
        self.welcomed: dict[str, Any] = {}
        #: a server's mirror links as they are now (ps.replicas), told a standby that takes over
        self.mirror_links: Callable[[], dict[str, list[int]]] | None = None
        #: measures this node's link for the network manager (aggregation.mode = "plan" only)
        self.agent: NodeAgent | None = None
        #: a worker with job priorities on: [level, bytes pushed, rounds], sent with each heartbeat
        #: for the job registry (scheduler/jobs_registry.py)
        self.job_report: Callable[[], list[int]] | None = None
        #: what the scheduler told this node, for a standby to rebuild the job from (scheduler/rejoin.py)
        self.recall = Recall()
        self._endpoints: list[str] = []
        #: the standby scheduler this node rejoined last, once the scheduler fell silent ("": not yet), and how many
        #: it rejoined (the next silence goes to the next one)
        self.rejoined = ""
        self._rejoins = 0
        #: failovers since a standby last took over (in a ring of schedulers, a full round of them ends the job)
        self._unanswered = 0
        transport.on_failure(self._transport_failed)

    # ------------------------------------------------------------------ requests
    def register(self, role: str, endpoints: Sequence[str]) -> None:
        self.role, self._endpoints = role, list(endpoints)
        aggregation = self._env.section("aggregation")
        if aggregation.get("mode") == "plan":
            period = float(aggregation.get("report_s", 1.0))
            self.agent = NodeAgent.for_address(endpoint_host(endpoints), self._transport, period,
                                               deliver=lambda report: self._send(Kind.HEARTBEAT, net=report.encode()))
        # marked as network control where this node marks its packets, as the scheduler marks its own: a report
        # or an acknowledgement of new routes overtakes data on a link that serves DSCP classes
        self._transport.connect(SCHEDULER_PEER, [self._env.scheduler], control=True, tos=self._config.control_tos)
        self._send(
            Kind.REGISTER,
            role=role,
            rank=self._env.rank,
            endpoints=list(endpoints),
            pid=os.getpid(),
            fingerprint=self._env.fingerprint(),
        )
        welcome = self._wait(
            (Kind.WELCOME, None),
            self._config.rendezvous_timeout + 5,
            f"the scheduler at {self._env.scheduler} to admit this {role}",
        )
        if welcome.meta and "malformed" in welcome.meta:
            raise SluiceError(f"malformed WELCOME from the scheduler: {welcome.meta['malformed']}")
        self._last_ack = time.monotonic()
        threading.Thread(target=self._heartbeats, name="sluice-heartbeat", daemon=True).start()

    def declare(self, tensors: list[list[Any]], limits: Limits | None = None,
                ranks: list[int] | None = None) -> tuple[list[Any], Limits]:
        """Declare [[name, shape, dtype, optimizer], ...] collectively (with every worker, or with the other
        workers of a process set's `ranks`), proposing this worker's calibrated limits; the plan table for
        them and the job's chunk size and in-flight bound."""
        extra: dict[str, Any] = {"limits": limits.as_list()} if limits is not None else {}
        if ranks is None:
            seq, self._declare_seq = self._declare_seq, self._declare_seq + 1
            key: tuple[Any, ...] = (Kind.PLAN, seq)
        else:
            seq = self._set_declare_seqs.get(tuple(ranks), 0)
            self._set_declare_seqs[tuple(ranks)] = seq + 1
            key, extra["ranks"] = (Kind.PLAN, tuple(ranks), seq), list(ranks)
        plan = self._ask(key, Kind.DECLARE, {"seq": seq, "tensors": tensors, **extra},
                         f"the plan of tensor declaration {seq}")
        table: list[Any] = meta_field(plan, "tensors", list)
        try:
            settled = parse_limits(meta_field(plan, "limits", list))
            with self._cond:
                self.recall.planned(plan, seq, ranks, tensors)
        except WireError as exc:
            raise SluiceError(f"malformed PLAN from the scheduler: {exc}") from None
        return table, settled

    def barrier(self, name: str) -> None:
        self._ask((Kind.RELEASE, name), Kind.BARRIER, {"name": name}, f"every worker to reach barrier {name!r}")

    def _ask(self, key: Hashable, kind: Kind, meta: dict[str, Any], what: str,
             timeout: float | None = None) -> Message:
        """Send a request and wait for its answer; a standby taking over is sent it again. A DECLARE is also
        sent again each heartbeat_timeout while its PLAN has not come: one dropped in a brief disconnect
        would otherwise be waited for until op_timeout (the scheduler answers a repeat as the first)."""
        with self._cond:
            self.recall.asked(key, kind, meta)
        try:
            self._send(kind, **meta)
            again = (lambda: self._send(kind, **meta)) if kind == Kind.DECLARE else None
            return self._wait(key, self._config.op_timeout if timeout is None else timeout, what, again)
        finally:
            with self._cond:
                self.recall.answered(key)

    def send(self, kind: Kind, **meta: Any) -> None:
        with self._cond:
            self.recall.sent(kind, meta)
        self._send(kind, **meta)

    def wait_for(self, key: Hashable, timeout: float, what: str) -> Message:
        """The scheduler's message filed under `key` (e.g. (Kind.TIMELINE_ACK, seq)); SluiceError at `timeout`
        or when the job fails."""
        return self._wait(key, timeout, what)

    def bye(self, error: str = "") -> None:
        """Leave the job; `error`: the exception ending this process (scheduler/leaving.py), told the others."""
        if not self._stop.is_set() and self.failure is None and self.node_id >= 0:
            meta = {"error": error} if error else {}
            if self._env.standby and self.role == "worker":
                self._farewell(meta)
            else:
                self._send(Kind.BYE, **meta)
        self._stop.set()
        if self.agent is not None:
            self.agent.close()

    # ------------------------------------------------------------------ incoming (I/O thread)
    def receive(self, msg: Message) -> None:
        """A message from the scheduler, on the transport's I/O thread: a malformed one is refused
        (counted and logged by the transport) and changes nothing."""
        try:
            self.on_message(msg)
        except WireError as exc:
            self._transport.refuse(SCHEDULER_PEER, f"rejected {msg.kind.name} from the scheduler: {exc}")

    def on_message(self, msg: Message) -> None:
        if msg.kind == Kind.HEARTBEAT_ACK:
            self._last_ack = time.monotonic()
        elif msg.kind in (Kind.ERROR, Kind.NODE_LOST):
            error = msg.meta.get("error") if msg.meta else None
            self.fail(error if isinstance(error, str) and error else f"the scheduler sent {msg.kind.name}")
        elif msg.kind == Kind.WELCOME and (msg.meta or {}).get("rejoined") is True:
            self._taken_over()
            for back in self._replaced_meanwhile(msg):
                self._on_other(back)
        elif msg.kind == Kind.WELCOME:
            self._welcome(msg)
        elif msg.kind == Kind.PLAN and self.role == "worker":
            ranks = (msg.meta or {}).get("ranks")
            if ranks is None:
                self._put((Kind.PLAN, meta_field(msg, "seq", int)), msg)
            elif type(ranks) is list and all(type(r) is int for r in ranks):
                self._put((Kind.PLAN, tuple(ranks), meta_field(msg, "seq", int)), msg)
            else:
                raise WireError(f"a PLAN's ranks must be a list of ints, got {brief(ranks)}")
        elif msg.kind == Kind.RELEASE:
            self._put((Kind.RELEASE, meta_field(msg, "name", str)), msg)
            with self._cond:
                self.recall.on_message(msg)
        elif msg.kind == Kind.SHUTDOWN and self.role == "worker":  # the scheduler saw this worker's goodbye
            self._put((Kind.SHUTDOWN, None), msg)
        elif msg.kind == Kind.TIMELINE_ACK:
            self._put((Kind.TIMELINE_ACK, meta_field(msg, "seq", int)), msg)
        else:
            if msg.kind in (Kind.BYE, Kind.ROUTES, Kind.COMMIT):
                with self._cond:
                    self.recall.on_message(msg)
            self._on_other(msg)

    def _welcome(self, msg: Message) -> None:
        """Take the ids and the address book here, on the I/O thread, before any later message is
        handled: a peer told of this node at the same moment may send to it at once."""
        try:
            peers = parse_address_book(meta_field(msg, "nodes", list))
            self.node_id, self.rank = meta_field(msg, "node_id", int), meta_field(msg, "rank", int)
            generation = meta_field(msg, "generation", int)
            with self._cond:
                self.recall.generation = generation
            self.peers, self.welcomed = peers, msg.meta or {}
            self._on_welcome()
        except (TypeError, ValueError) as exc:
            msg = Message(Kind.WELCOME, meta={"malformed": str(exc)})
        self._put((Kind.WELCOME, None), msg)

    def fail(self, error: str) -> None:
        with self._cond:
            if self.failure is not None:
                return
            self.failure = error
            self._cond.notify_all()
        self._stop.set()
        if self.agent is not None:
            self.agent.close()
        log.error("%s", error)
        self._on_fatal(error)

    # ------------------------------------------------------------------ internals
    def _transport_failed(self, error: str) -> None:
        """This node's I/O thread died: it is the culprit, not the scheduler its heartbeats stop reaching."""
        culprit.report(self.role or "node", self.rank, error)
        self.fail(error)

    def _send(self, kind: Kind, **meta: Any) -> None:
        if self._unanswered and kind not in (Kind.REJOIN, Kind.HEARTBEAT):
            # a standby takes nothing else until it took over (it would refuse and count it); what waits for an
            # answer is in `recall.pending` and goes to it then (_taken_over), as does the last ROUTES_ACK
            return
        self._transport.send(SCHEDULER_PEER, 0, Message(kind, sender=self.node_id, meta=meta))

    def _put(self, key: Hashable, msg: Message) -> None:
        with self._cond:
            self._replies[key] = msg
            self._cond.notify_all()

    def _wait(self, key: Hashable, timeout: float, what: str, again: Callable[[], None] | None = None) -> Message:
        """The answer filed under `key`; `again` (the request sent once more) each heartbeat_timeout meanwhile."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            span = left if again is None else min(left, self._config.heartbeat_timeout)
            with self._cond:
                answered = self._cond.wait_for(lambda: key in self._replies or self.failure is not None, max(0.0, span))
                if answered or span >= left:
                    if self.failure is not None:
                        raise SluiceError(self.failure)
                    if key not in self._replies:
                        raise SluiceError(f"timed out after {timeout:.0f} s waiting for {what}")
                    return self._replies.pop(key)
            if again is not None:
                again()  # outside the lock, as every send

    def _heartbeats(self) -> None:
        interval, limit = self._config.heartbeat_interval, self._config.heartbeat_timeout
        while not self._stop.wait(interval):
            report = self.agent.report() if self.agent is not None else None
            meta: dict[str, Any] = {"net": report.encode()} if report is not None else {}
            if self.job_report is not None:
                meta["job"] = self.job_report()
            self._send(Kind.HEARTBEAT, **meta)
            silent = time.monotonic() - self._last_ack
            following = self._env.next_scheduler(self._rejoins, self._unanswered)
            if silent > limit and following is not None and self.failure is None:
                self._fail_over(silent, following)
            elif silent > limit:
                error = (f"the scheduler at {self.rejoined or self._env.scheduler} has not answered heartbeats for "
                         f"{silent:.1f} s")
                if self.failure is None:  # a node that failed for another reason is no witness of this
                    culprit.report("scheduler", 0, error)
                self.fail(error)
                return

    def _farewell(self, meta: dict[str, Any]) -> None:
        """A worker with a standby scheduler leaves once the scheduler saw it leave: a goodbye lost with the
        scheduler would leave the standby waiting for this worker (the heartbeats run on, so a silent
        scheduler is failed over and the goodbye asked of the standby)."""
        waited = (1 + len(self._env.standbys())) * (self._config.heartbeat_timeout + self._config.heartbeat_interval)
        try:
            self._ask((Kind.SHUTDOWN, None), Kind.BYE, meta, "the scheduler to see this worker leave", waited)
        except SluiceError as exc:
            log.warning("worker %d leaves without the scheduler's word: %s", self.rank, exc)

    def _fail_over(self, silent: float, following: str) -> None:
        """The scheduler (or the standby that took over from it) fell silent: rejoin the next standby (`following`),
        telling it what this node was told."""
        was, self.rejoined = self.rejoined or self._env.scheduler, following
        self._rejoins += 1
        self._unanswered += 1
        log.warning("%s %d: the scheduler at %s has not answered heartbeats for %.1f s; rejoining the standby "
                    "scheduler at %s", self.role, self.rank, was, silent, self.rejoined)
        self._transport.replace_peer(SCHEDULER_PEER, [self.rejoined], control=True, tos=self._config.control_tos)
        with self._cond:
            meta = self.recall.rejoin_meta(self.role, self.rank, self.node_id, self._endpoints, os.getpid(),
                                           self._env.fingerprint(), self._env.scheduler)
        if self.mirror_links is not None:
            meta["mirror"] = self.mirror_links()
        self._last_ack = time.monotonic()
        self._send(Kind.REJOIN, **meta)

    def _replaced_meanwhile(self, welcome: Message) -> list[Message]:
        """The SERVER_BACK or AGGREGATOR_BACK of each server or aggregator the standby's address book gives other
        endpoints than this node knows: one re-admitted by a scheduler that died before it told the others (a
        server handles only its mirror links' SERVER_BACK, from the scheduler itself)."""
        raw = (welcome.meta or {}).get("nodes")
        if self.role == "server" or raw is None:
            return []
        book = parse_address_book(raw)
        known = {peer.name: peer.endpoints for peer in self.peers}
        return [Message(Kind.SERVER_BACK if peer.role == "server" else Kind.AGGREGATOR_BACK, sender=0,
                        meta={"node_id": peer.node_id, "rank": peer.rank, "name": peer.name,
                              "endpoints": list(peer.endpoints)})
                for peer in book if peer.role in ("server", "aggregator") and peer.name in known
                and tuple(known[peer.name]) != tuple(peer.endpoints)]

    def _taken_over(self) -> None:
        """The standby rebuilt the job (I/O thread): what still waits for an answer is asked of it again."""
        self._last_ack = time.monotonic()
        self._unanswered = 0
        with self._cond:
            pending = list(self.recall.pending.values())
        log.info("%s %d: the standby scheduler at %s took over; asking it again %d pending requests", self.role,
                 self.rank, self.rejoined, len(pending))
        for kind, meta in pending:
            self._send(kind, **meta)
