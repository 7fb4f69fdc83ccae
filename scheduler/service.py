"""The scheduler role: runs the rendezvous state machine over a real transport until the job ends."""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from dataclasses import replace

from sluice.errors import SluiceError
from sluice.scheduler import culprit
from sluice.scheduler.bootstrap import NodeEnv, elastic_generation
from sluice.scheduler.config import SchedulerConfig
from sluice.scheduler.hierarchy.config import AggregationConfig
from sluice.scheduler.hierarchy.manager import tree_source
from sluice.scheduler.hierarchy.placement import NodeAt
from sluice.scheduler.hierarchy.switch import switch_notes
from sluice.scheduler.jobs_registry import Registry
from sluice.scheduler.node import endpoint_host
from sluice.scheduler.recovery import ServerRecovery, report_silent
from sluice.scheduler.rendezvous import Out, Rendezvous
from sluice.scheduler.standby_watch import SchedulerWatch, standby_patience
from sluice.scheduler.timeline_parts import TIMEOUT_S, Gatherer
from sluice.transport.base import Transport, open_transport
from sluice.transport.prometheus import Readings, serve_metrics
from sluice.transport.rejects import Rejections
from sluice.transport.timeline import TimelineConfig
from sluice.transport.wire import Kind, Message, WireError

log = logging.getLogger("sluice.scheduler")

_TICK_SECONDS = 0.2
#: how often the loop looks for a plan being made on the planner's thread
_PLAN_POLL_SECONDS = 0.02
#: control messages waiting for the state machine; beyond this a flood is refused, not queued
_INBOX_LIMIT = 10_000


def run_scheduler(env: NodeEnv, announce: Callable[[str], None]) -> int:
    """Serve the control plane for `env.workers` workers and `env.servers` servers; the exit code."""
    started = time.time()
    settings = SchedulerConfig(**env.section("scheduler"))
    standby = env.rank >= 1  # scheduler.standby: rank 1 waits for the nodes to rejoin it (scheduler/standby.py)
    ps_section = env.section("ps")  # ps.recover's keys (ps/config.py, validated by the launcher)
    data_settings = env.transport_config()
    inbox: queue.Queue[tuple[str, Message]] = queue.Queue(_INBOX_LIMIT)
    # one channel; its packets marked as network control (scheduler.control_tos), so that ROUTES and COMMIT
    # overtake data on links that serve DSCP classes
    control_settings = replace(data_settings, channels=1, tos=(settings.control_tos,) if data_settings.marks else (),
                               so_priority=(), channel_levels=())
    transport: Transport | None = None

    members = frozenset(env.members)

    def take(peer: str, _channel: int, msg: Message) -> None:
        """On the I/O thread: hand over to the state machine's thread. What no member of the job could
        have sent is refused here, so a flood of strangers (CURVE off) cannot crowd out heartbeats."""
        assert transport is not None
        if peer not in members:
            transport.refuse(peer, f"rejected {msg.kind.name} from {peer!r:.60}: not a member of this job")
            return
        try:
            inbox.put_nowait((peer, msg))
        except queue.Full:
            transport.refuse(peer, f"dropped {msg.kind.name} from {peer!r:.60}: the scheduler's inbox is full")

    transport = open_transport("scheduler", control_settings, take, keys=env.job_keys(), control=True,
                               members=members)
    rejects = Rejections(log)
    machine = Rendezvous(
        env.workers, env.servers, data_settings.chunk_bytes, settings, env.fingerprint(), time.monotonic(),
        inflight_bytes=data_settings.inflight_bytes, aggregators=env.aggregators,
        recovery=ServerRecovery(bool(ps_section.get("recover", False)), float(ps_section.get("recover_timeout", 60)),
                                replicas=max(0, int(ps_section.get("replicas", 0))),
                                same_host=bool(ps_section.get("mirror_same_host", False))),
        standby=standby, generation=elastic_generation(),
    )
    trees = tree_source(AggregationConfig(**env.section("aggregation")), time.monotonic())
    first = trees.due(time.monotonic()) if trees is not None else None
    if first is not None:  # static trees: checked against the job before anyone registers
        try:
            machine.propose_routes(first)
        except ValueError as exc:
            transport.close()
            log.error("aggregation.trees do not fit this job: %s", exc)
            return 1
    try:
        endpoint = transport.listen(settings.port if not standby else settings.standby_port)[0]
    except (OSError, ValueError) as exc:
        transport.close()
        log.error("the scheduler cannot listen: %s (transport.host = %s, scheduler.port = %d)",
                  exc, data_settings.host, settings.port)
        return 1
    readings = Readings.of_transport("scheduler", 0, transport, rejects)
    readings.plan_changes = lambda: {"routes": machine.switch.epoch}
    try:  # not a standby's: the port may be the scheduler's, on the same host
        exporter = serve_metrics(env.section("metrics"), readings, 0) if not standby else None
    except SluiceError as exc:
        transport.close()
        log.error("%s", exc)
        return 1
    timeline = TimelineConfig(**env.section("timeline"))
    gatherer = Gatherer(timeline.path, timeline.gather_mib) if timeline.path and not standby else None
    announce(endpoint)
    registry = Registry(endpoint, env, started) if not standby else None
    if standby:
        log.info("standby scheduler ready at %s: it takes over if the scheduler at %s falls silent", endpoint,
                 env.scheduler or "(unknown)")
    else:
        log.info("waiting for %d servers, %d workers and %d aggregators", env.servers, env.workers, env.aggregators)

    def send(outs: list[Out]) -> None:
        # noted first: a peer may act on the message (end this process, even) before a line after the send is written
        for note in switch_notes(outs) if trees is not None else ():
            log.info("%s", note)
        for peer, msg in outs:
            transport.send(peer, 0, msg)

    # in a ring (Kubernetes) the pods' lifetimes are the JobSet's, and a lost scheduler's pod may take minutes to
    # come back: a standby waits for as long as it runs
    watch = SchedulerWatch(env.scheduler, settings.heartbeat_interval, standby_patience(settings.heartbeat_timeout),
                           time.monotonic()) if standby and env.scheduler and not env.ring else None
    def plan(now: float) -> list[Out]:
        """The trees' source takes the network reports in, and may have new trees to switch to."""
        if trees is None or machine.phase != "running":
            return []
        nodes = [NodeAt(n.name, n.role, endpoint_host(n.endpoints)) for n in machine.nodes.values()]
        trees.observe_reports(machine.net_reports, nodes)
        due = trees.due(now, nodes)
        return machine.propose_routes(due) if due is not None else []

    next_tick = 0.0
    try:
        while machine.phase in ("standby", "registering", "running"):
            was = machine.phase
            # while a plan is being made, look for it often: the switch to it should not wait for a tick
            planning = trees is not None and trees.planning
            report = False
            try:
                peer, msg = inbox.get(timeout=_PLAN_POLL_SECONDS if planning else _TICK_SECONDS)
            except queue.Empty:
                pass
            else:
                report = msg.kind == Kind.HEARTBEAT and "net" in (msg.meta or {})
                try:
                    if msg.kind == Kind.TIMELINE and gatherer is not None:
                        send(gatherer.take(machine.nodes.get(peer), msg))
                    else:
                        send(machine.on_message(peer, msg, time.monotonic()))
                except WireError as exc:
                    rejects.refuse(peer, f"rejected {msg.kind.name} from {peer!r:.60}: {exc}", time.monotonic())
                except Exception as exc:  # the last resort: a hostile message must not end the control plane
                    rejects.refuse(peer, f"handling {msg.kind.name} from {peer!r:.60} failed ({type(exc).__name__})",
                                   time.monotonic(), exc_info=True)
            now = time.monotonic()
            rejects.tick(now)
            if watch is not None and machine.phase == "standby" and machine.takeover is not None:
                why = watch.tick(now, bool(machine.takeover.rejoins))
                if why is not None:
                    machine.phase, machine.exit_code, machine.error = "failed", 1, why
                    break
            if now >= next_tick:
                outs = machine.on_tick(now) + plan(now)
                if registry is not None:
                    registry.tick(now, machine.job_reports)
                if machine.lost is not None:  # named before NODE_LOST makes everyone else fail too
                    lost = machine.lost
                    culprit.report(lost.role, lost.rank, machine.error, pid=lost.pid)
                send(outs)
                next_tick = now + _TICK_SECONDS
            elif report or planning:  # a report may complete a period of evidence; a plan may be ready
                send(plan(now))
            for note in machine.notes:
                log.info("%s", note)
            machine.notes.clear()
            for role, rank in machine.silent_nodes:  # after its note: the launcher may act on it at once
                report_silent(role, rank)
            machine.silent_nodes.clear()
            if was == "registering" and machine.phase == "running":
                log.info("all nodes registered: %s", ", ".join(n.describe() for n in machine.nodes.values()))
            if was == "standby" and machine.phase == "running":  # this standby took over: it is the scheduler now
                # under the name the job had (the silent scheduler's endpoint, which the nodes rejoined with), so
                # it is listed once; started when the scheduler was, as the launcher starts both together
                job = machine.takeover.job() if machine.takeover is not None else ""
                registry = Registry(job or endpoint, env, started)
                log.info("the job's registry entry is published by this standby now, as %s", job or endpoint)
                try:  # the scheduler's metrics, from here now (its port is free: on another host, or its owner dead)
                    exporter = serve_metrics(env.section("metrics"), readings, 0)
                except SluiceError as exc:
                    log.warning("the standby took over but serves no metrics: %s", exc)
                if timeline.path:
                    gatherer = Gatherer(timeline.path, timeline.gather_mib)
        if gatherer is not None and machine.phase == "done":
            _gather_parts(machine, gatherer, inbox, send, rejects)
    finally:
        if gatherer is not None:
            gatherer.close()
        if exporter is not None:
            exporter.close()
        if registry is not None:
            registry.close()
        if trees is not None:
            trees.close()
        transport.close(flush_seconds=2.0)
        stats = transport.stats()  # also when SIGTERM ends the scheduler (SystemExit)
        log.info("scheduler stopped (%d messages rejected, %d connections refused)",
                 stats["rejected"] + rejects.total, stats["refused_connections"])
    if machine.exit_code:
        log.error("job failed: %s", machine.error)
    elif machine.left_with_error:  # the launcher (or the pods' orchestrator) sees those workers' exit codes
        rank, error = next(iter(machine.left_with_error.items()))  # in the order they left: the first is the cause
        log.warning("every worker has left, %d of them with an error; the first: worker %d (%s)",
                    len(machine.left_with_error), rank, error)
    else:
        log.info("all workers finished; job done")
    return machine.exit_code or 0


def _gather_parts(machine: Rendezvous, gatherer: Gatherer, inbox: queue.Queue[tuple[str, Message]],
                  send: Callable[[list[Out]], None], rejects: Rejections) -> None:
    """The job is done: take the timeline parts the servers send after SHUTDOWN (the workers' came before
    their goodbyes), until each server's part is in or it said goodbye, for at most TIMEOUT_S."""
    waiting = {n.name for n in machine.nodes.values() if n.role == "server"} - gatherer.finished
    deadline = time.monotonic() + TIMEOUT_S
    while waiting - gatherer.finished and time.monotonic() < deadline:
        try:
            peer, msg = inbox.get(timeout=_TICK_SECONDS)
        except queue.Empty:
            continue
        try:
            if msg.kind == Kind.TIMELINE:
                send(gatherer.take(machine.nodes.get(peer), msg))
            elif msg.kind == Kind.HEARTBEAT:  # a server sending a large part must not think the scheduler gone
                send([(peer, Message(Kind.HEARTBEAT_ACK, sender=0))])
            elif msg.kind == Kind.BYE:
                waiting.discard(peer)
        except WireError as exc:
            rejects.refuse(peer, f"rejected {msg.kind.name} from {peer!r:.60}: {exc}", time.monotonic())
        except Exception as exc:  # the last resort, as in the main loop
            rejects.refuse(peer, f"handling {msg.kind.name} from {peer!r:.60} failed ({type(exc).__name__})",
                           time.monotonic(), exc_info=True)
    if missing := sorted(waiting - gatherer.finished):
        log.warning("timeline: no part from %s within %.0f s; each keeps its part on its host (its log says "
                    "where)", ", ".join(missing), TIMEOUT_S)
