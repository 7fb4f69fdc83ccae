"""The server role: one shard store behind a transport, registered with the scheduler."""

from __future__ import annotations

import os

from sluice.errors import SluiceError
from sluice.ps.config import ServerConfig
from sluice.ps.mirror_links import ENV_TAKEOVER, MirrorLinks, took_over_from
from sluice.ps.recovered import open_recovery
from sluice.ps.role import Reply, Role
from sluice.ps.snapshot import state_tag
from sluice.ps.store import ShardStore
from sluice.ps.trace import ServerTrace
from sluice.scheduler import culprit
from sluice.scheduler.bootstrap import NodeEnv
from sluice.scheduler.declaration import parse_limits
from sluice.scheduler.timeline_parts import send_part
from sluice.transport.prometheus import Readings, retried
from sluice.transport.timeline import TimelineConfig, part_path
from sluice.transport.wire import Kind, Message, WireError, keep_payload, meta_field

#: the messages between a server and the servers it mirrors to or for (ps/mirror_links.py)
MIRROR_KINDS = (Kind.MIRROR, Kind.MIRROR_ACK)
#: at most this many of them are kept from before the welcome (a linked server's hello, and MIRRORs of the
#: chunks it restored if it was replaced)
EARLY_MIRRORS = 4096


class Server(Role):
    role = "server"

    def __init__(self, env: NodeEnv) -> None:
        self.settings = ServerConfig(**env.section("ps"))
        #: ps.replicas: the rank of the server whose mirror of this one it restores from, started on that server's
        #: host, its own lost (the file is opened at the first PLAN: the holder unlocks it once the scheduler saw
        #: this server register); -1: none
        self.takeover = took_over_from(os.environ.get(ENV_TAKEOVER, "")) if self.settings.mirrored else -1
        # before the transport: a live server holding the state file is refused with nothing to undo
        recovery = open_recovery(env, self.settings) if self.settings.recover and self.takeover < 0 else None
        try:
            super().__init__(env)
        except BaseException:
            if recovery is not None:
                recovery.close()
            raise
        self.store = ShardStore(-1, env.workers, self.settings.sync, alloc=self.transport.alloc)
        self.store.recovery = recovery
        self.store.on_first_orphan = self._report_orphan
        #: ps.replicas: this server's copy on another host, and the copies it holds of others (ps/mirror.py)
        self.mirrors: MirrorLinks | None = None
        #: ps.replicas, until the welcome: what a linked server sent first (welcomed first, it dialled and said
        #: hello at once; refused, the hello would be lost and no MIRROR ever sent), handled at the welcome
        self.early_mirrors: list[tuple[str, Message]] | None = [] if self.settings.mirrored else None
        timeline = TimelineConfig(**env.section("timeline"))
        self.timeline_part = part_path(timeline.path, "server", env.rank) if timeline.path else None
        self.trace = ServerTrace(str(self.timeline_part), "server", env.rank,
                                 self.store.chunks) if self.timeline_part is not None else None

    def handle(self, peer: str, channel: int, msg: Message, now: float) -> list[Reply]:
        if msg.kind == Kind.PROBE:  # a worker's calibration: answer at once, no payload
            self.store.check_worker(peer, msg.sender)
            return [(peer, channel, Message(Kind.PROBE_REPLY, sender=self.store.node_id, round=msg.round,
                                            priority=msg.priority))]
        try:
            if self.mirrors is not None and msg.kind in MIRROR_KINDS:  # off: one test a push
                return self.mirrors.handle(peer, msg)
            if self.early_mirrors is not None and msg.kind in MIRROR_KINDS:
                if len(self.early_mirrors) >= EARLY_MIRRORS:
                    raise WireError(f"more than {EARLY_MIRRORS} mirror messages before this server was welcomed")
                self.early_mirrors.append((peer, keep_payload(msg)))
                return []
            replies = self.store.handle(peer, channel, msg, now)
        except SluiceError as exc:  # the state file could not take a commit: this server cannot go on safely
            self.control.fail(str(exc))
            return []
        if self.mirrors is not None and self.mirrors.sender is not None:
            replies = self.mirrors.sender.take(replies)  # MIRRORs first; later rounds' replies wait for acks
        if self.trace is not None and msg.kind == Kind.PUSH:
            self.trace.pushed(msg, channel)
        return replies

    def on_welcome(self) -> None:
        """Workers may probe this server the moment they are admitted."""
        self.store.node_id = self.control.node_id
        self.store.worker_ids = {p.node_id: (p.name, p.rank) for p in self.control.peers if p.role == "worker"}
        self.store.aggregator_ids = {p.node_id: p.name for p in self.control.peers if p.role == "aggregator"}
        if self.settings.mirrored:
            self.mirrors = MirrorLinks(self.transport, self.control.rank, self.control.node_id,
                                       state_tag(self.env.secret), self.env.workers, self.settings.mirror_timeout,
                                       self.settings.mirror_rounds)
            try:
                self.mirrors.place(self.control.peers, self.control.welcomed.get("mirror"))
            except (SluiceError, WireError) as exc:
                self.control.fail(str(exc))
            self.control.mirror_links = self.mirrors.links
            self._mirror_commits()
            early, self.early_mirrors = self.early_mirrors or [], None
            for peer, msg in early:
                self._on_message(peer, self.mirrors.channel, msg)

    def _mirror_commits(self) -> None:
        """Each commit goes to the holder too, while this server has one."""
        if self.store.recovery is not None:
            sender = self.mirrors.sender if self.mirrors is not None else None
            self.store.recovery.after_commit = sender.committed if sender is not None else None
            self.store.recovery.before_step = sender.stepping if sender is not None else None

    def on_scheduler(self, msg: Message) -> None:
        if msg.kind == Kind.SERVER_BACK and self.mirrors is not None:  # a server linked to this one was restarted
            for to, channel, out in self.mirrors.server_back(msg):
                self.transport.send(to, channel, out)
            self._mirror_commits()
            return
        if msg.kind == Kind.MIRROR_RELEASE and self.mirrors is not None:
            rank = meta_field(msg, "rank", int)
            path = self.mirrors.release(rank)
            self.log.info("server %d: server %d took over from its mirror here (%s)", self.control.rank, rank, path)
            return
        if msg.kind != Kind.PLAN:
            raise WireError(f"unexpected {msg.kind.name} from the scheduler")
        seq = meta_field(msg, "seq", int)
        recovering = bool(msg.meta and msg.meta.get("recovery") is True)  # sent again to a replacement
        try:
            if self.takeover >= 0 and self.store.recovery is None:
                self.store.recovery = open_recovery(self.env, self.settings, held_by=self.takeover,
                                                    lock_timeout=self.settings.mirror_timeout)
                self._mirror_commits()
            restored = self.store.add_plan(meta_field(msg, "tensors", list), recovering)
            mirrors = msg.meta.get("mirrors") if msg.meta else None
            if mirrors is not None:
                if self.mirrors is None:
                    raise WireError("a PLAN names mirrors, but this server keeps none (ps.replicas differs?)")
                self.mirrors.add_plans(mirrors)
            limits = parse_limits(meta_field(msg, "limits", list))
        except (ValueError, TypeError, KeyError) as exc:
            self.control.fail(f"server {self.control.rank} cannot take the plan of declaration {seq}: {exc}")
            return
        except SluiceError as exc:
            self.control.fail(str(exc))
            return
        if restored and self.mirrors is not None and self.mirrors.sender is not None:
            self.mirrors.sender.restored(restored)
            for to, channel, out in self.mirrors.sender.take([]):
                self.transport.send(to, channel, out)
        rounds = [chunk.round for chunk in restored]
        if rounds and self.takeover >= 0:  # the line that says what the job did about a lost host, with the step
            self.log.info("server %d took shard %d at step %d from server %d's copy on this host (declaration %d: %d "
                          "chunks at rounds %d..%d; the workers redo the rounds after)", self.control.rank,
                          self.control.rank, max(rounds), self.takeover, seq, len(rounds), min(rounds), max(rounds))
        elif rounds:
            self.log.info("server %d: restored %d chunks of declaration %d at rounds %d..%d", self.control.rank,
                          len(rounds), seq, min(rounds), max(rounds))
        if self.take_limits(limits):
            self.transport.stats(reset=True)  # the calibration probes are over: metrics start here
            self.log.info("server %d: %s", self.control.rank, limits.describe())
        self.control.send(Kind.PLAN_ACK, seq=seq)

    def readings(self) -> Readings:
        readings = super().readings()
        chunks = self.store.chunks
        readings.rounds = retried(lambda: sum(chunk.round for chunk in chunks.values()))
        return readings

    def before_goodbye(self) -> None:
        """After the scheduler's SHUTDOWN (a clean end only), the timeline part goes to the scheduler."""
        if self.trace is None or self.timeline_part is None or not self.done.is_set() or self.exit_code:
            return
        self.trace.close()
        why = send_part(self.control, self.timeline_part)
        if why is not None:
            self.log.warning("timeline: server %d's part stays at %s: %s", self.control.rank, self.timeline_part, why)

    def on_close(self) -> None:
        if self.trace is not None:
            self.trace.close()
        clean = self.done.is_set() and self.exit_code == 0
        if self.store.recovery is not None:  # a clean end (SHUTDOWN) leaves nothing to recover
            if self.store.recovery.replayed:
                self.log.info("server %d: took %d replayed pushes of rounds its state was behind (ps.replicas)",
                              self.control.rank, self.store.recovery.replayed)
            self.store.recovery.close(remove=clean)
        if self.mirrors is not None:
            self.mirrors.close(clean)

    def stalled(self, now: float, limit: float) -> list[str]:
        sender = self.mirrors.sender if self.mirrors is not None else None
        why = sender.overdue(now) if sender is not None else None
        if why is not None:
            self.control.fail(why)
        return self.store.stalled(now, limit)

    def worker_left(self, rank: int, error: str) -> list[Reply]:
        return self.store.worker_left(rank, error)

    def _report_orphan(self, rank: int, error: str) -> None:
        """The first worker to leave early is the cause of every failed round after it: name it, once."""
        culprit.report("worker", rank, error)


def run_server(env: NodeEnv) -> int:
    return Server(env).run()
