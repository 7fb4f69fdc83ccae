"""The scheduler role: runs the rendezvous state machine over a real transport until the job ends."""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from dataclasses import replace

from scheduler.bootstrap import NodeEnv
from scheduler.config import SchedulerConfig
from scheduler.rendezvous import Out, Rendezvous
from transport.base import open_transport
from transport.wire import Message, WireError

log = logging.getLogger("sluice.scheduler")

_TICK_SECONDS = 0.2


def run_scheduler(env: NodeEnv, announce: Callable[[str], None]) -> int:
    """Serve the control plane for `env.workers` workers and `env.servers` servers; the exit code."""
    settings = SchedulerConfig(**env.section("scheduler"))
    data_settings = env.transport_config()
    inbox: queue.SimpleQueue[tuple[str, Message]] = queue.SimpleQueue()
    control_settings = replace(data_settings, channels=1, tos=(), so_priority=(), channel_levels=())
    transport = open_transport("scheduler", control_settings, lambda peer, _, msg: inbox.put((peer, msg)))
    machine = Rendezvous(
        env.workers, env.servers, data_settings.chunk_bytes, settings, env.fingerprint(), time.monotonic(),
        inflight_bytes=data_settings.inflight_bytes,
    )
    announce(transport.listen()[0])
    log.info("waiting for %d servers and %d workers", env.servers, env.workers)

    def send(outs: list[Out]) -> None:
        for peer, msg in outs:
            transport.send(peer, 0, msg)

    next_tick = 0.0
    try:
        while machine.phase in ("registering", "running"):
            try:
                peer, msg = inbox.get(timeout=_TICK_SECONDS)
            except queue.Empty:
                pass
            else:
                was = machine.phase
                try:
                    send(machine.on_message(peer, msg, time.monotonic()))
                except WireError as exc:
                    log.warning("rejected %s from %r: %s", msg.kind.name, peer, exc)
                for note in machine.notes:
                    log.info("%s", note)
                machine.notes.clear()
                if was == "registering" and machine.phase == "running":
                    log.info("all nodes registered: %s", ", ".join(n.describe() for n in machine.nodes.values()))
            now = time.monotonic()
            if now >= next_tick:
                send(machine.on_tick(now))
                next_tick = now + _TICK_SECONDS
    finally:
        transport.close(flush_seconds=2.0)
    if machine.exit_code:
        log.error("job failed: %s", machine.error)
    else:
        log.info("all workers finished; job done")
    return machine.exit_code or 0
