"""The ZeroMQ transport's sending half (Sender): its outbox into per-route priority queues, and those to sockets."""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from collections.abc import Callable

import zmq
import zmq.utils.garbage  # its atexit handler now, so that handlers registered later (a close) run before it

from sluice.transport.config import TransportConfig
from sluice.transport.metrics import TransportMetrics
from sluice.transport.sendqueue import ChannelQueue
from sluice.transport.shm import SharedPayloads
from sluice.transport.wire import Flag, Message, encode
from sluice.transport.zmq_receive import Frames, Route
from sluice.transport.zmq_seal import Seals

log = logging.getLogger("sluice.transport")

#: a message whose last frame (its payload) is at most this many bytes is copied into ZeroMQ's message rather
#: than lent to it. A lent buffer costs pyzmq a tracked Frame and, once sent, libzmq a message to pyzmq's
#: garbage-collector thread, which wakes to let it go: with 256 and 512 KiB chunks that cost more than the
#: copy (bench/chunk_cpu.py: about 8-15% less CPU a chunk; at 1 MiB no gain; on the shaped testbed, where
#: the links and the cipher bind, no measurable change: docs/priority.md).
COPY_BYTES = 512 << 10

#: per route, at most this many unacknowledged messages are timed (a peer that never acknowledges costs no more)
UNACKED_KEPT = 4096


class Sender:
    """The sending half of ZmqTransport: callers append to its outbox (any thread); the rest runs on the
    transport's I/O thread, which owns the sockets this half sends on."""

    def __init__(self, config: TransportConfig, metrics: TransportMetrics, *,
                 dealers: dict[str, list[zmq.Socket[bytes]]], routers: list[zmq.Socket[bytes]],
                 ident: Callable[[str], bytes | None], local: set[str] | None, shared: SharedPayloads,
                 seals: Seals | None = None) -> None:
        #: (route, message, queued at): appended by any thread, drained into the queues by the I/O thread
        self.outbox: deque[tuple[Route, Message, float]] = deque()
        self.queues: dict[Route, ChannelQueue[Message]] = {}
        #: the routes whose queues hold messages
        self.active: set[Route] = set()
        #: called (message, queued at, sent at; monotonic seconds) as each message goes to its socket, on the I/O thread
        self.tracer: Callable[[Message, float, float], None] | None = None
        self._inflight = config.inflight_limit
        self._aging = config.aging_ms / 1e3
        self._last_pump = time.monotonic()
        self._metrics = metrics
        #: the transport's sockets (DEALERs by peer, ROUTERs by channel; not ours to change), a ROUTER peer's identity
        self._dealers = dealers
        self._routers = routers
        self._ident = ident
        #: peers on this host that read our shared memory (None: shared memory is off), and that memory
        self._local = local
        self._shared = shared
        #: sealed connections (transport/zmq_seal.py), or None
        self._seals = seals
        #: per route, [sent at, bytes not yet acknowledged] of each message with a payload, oldest first: its
        #: acknowledgement's delay is the path's (the network agent's measure of a rack uplink)
        self._unacked: dict[Route, deque[list[float]]] = {}

    def idle(self) -> bool:
        """Nothing waits to be sent."""
        return not self.outbox and not any(len(self.queues[r]) for r in self.active)

    def set_inflight(self, nbytes: int) -> None:
        """Bound every route's unacknowledged bytes by `nbytes`, the queues to come too."""
        self._inflight = nbytes
        for queue in self.queues.values():
            queue.bound = nbytes

    def credit(self, route: Route, nbytes: int) -> None:
        """The peer acknowledged `nbytes` sent on `route`: they no longer count against its bound."""
        queue = self.queues.get(route)
        unacked, left = self._unacked.get(route), nbytes
        waited, count = 0.0, 0
        if unacked:
            now = time.monotonic()
            while unacked and left > 0:
                oldest = unacked[0]
                if oldest[1] > left:  # acknowledged in part (credit comes back in byte counts)
                    oldest[1] -= left
                    break
                left -= int(oldest[1])
                unacked.popleft()
                waited, count = waited + now - oldest[0], count + 1
        if queue is not None:
            # what got through: no more than was in flight (a peer's acknowledgement is only a number it sent)
            self._metrics.acked(route[0], waited, count, min(nbytes, queue.inflight))
            queue.ack(nbytes)
            self._shared.acked(route, nbytes)
            self.active.add(route)

    def forget(self, peer: str) -> list[Route]:
        """Drop what is queued for `peer` (replaced), and with the queues the credit its acknowledgements
        would have freed; return the routes dropped."""
        routes = [r for r in self.queues if r[0] == peer]
        for route in routes:
            del self.queues[route]
            self._unacked.pop(route, None)
            self.active.discard(route)
        return routes

    def withdraw(self, match: Callable[[Route, Message], bool]) -> list[tuple[Route, Message]]:
        """Take back the queued messages `match` picks (none has begun to leave), by route, each route's in the
        order they would have left."""
        self.drain_outbox()
        taken: list[tuple[Route, Message]] = []
        for route, queue in self.queues.items():
            taken += [(route, msg) for _, _, msg, _ in queue.take(functools.partial(match, route))]
            if not len(queue):
                self.active.discard(route)
        return taken

    def drain_outbox(self) -> None:
        while self.outbox:
            (peer, channel), msg, enqueued = self.outbox.popleft()
            dealers = self._dealers.get(peer)
            route = (peer, min(channel, len(dealers) - 1)) if dealers else (peer, channel)
            queue = self.queues.get(route)
            if queue is None:
                queue = self.queues[route] = ChannelQueue(self._inflight, self._aging)
            queue.push(msg.priority, msg.nbytes, msg, enqueued)
            self.active.add(route)

    def pump(self) -> None:
        now = time.monotonic()
        if self.active:  # what waited since the last pump (the network agent's measure of a path)
            self._metrics.backlogged({peer for peer, _ in self.active}, now - self._last_pump)
        self._last_pump = now
        for route in list(self.active):
            queue = self.queues[route]
            ready = queue.pop_ready(now)
            for index, (priority, nbytes, msg, enqueued) in enumerate(ready):
                if not self._send_message(route, msg, nbytes):
                    for later_priority, later_bytes, later, later_enqueued in reversed(ready[index:]):
                        queue.push_front(later_priority, later_bytes, later, later_enqueued)
                    break
                self._metrics.sent(route[1], priority, nbytes, now - enqueued, route[0])
                if nbytes:  # only payload bytes take credit, and come back acknowledged
                    unacked = self._unacked.get(route)
                    if unacked is None:
                        unacked = self._unacked[route] = deque(maxlen=UNACKED_KEPT)
                    unacked.append([now, nbytes])
                if self.tracer is not None:  # the timeline (worker/trace.py): off unless asked for
                    self.tracer(msg, enqueued, now)
            if not len(queue):
                self.active.discard(route)

    def _send_message(self, route: Route, msg: Message, nbytes: int) -> bool:
        """Encode and send one queued message (`nbytes` of payload, counted when it was queued),
        its payload through shared memory for local peers."""
        local = self._local is not None and route[0] in self._local
        if local and route[0] in self._dealers:
            msg.flags |= Flag.LOCAL
        descriptor: tuple[str, int, int] | None = None
        if local and msg.payload is not None:
            placed = self._shared.prepare(route, msg.payload, nbytes)
            if placed is False:
                return False  # the ring is full until the peer acknowledges older payloads
            descriptor = placed
        msg.shm = descriptor
        try:
            sent = self.send_frames(route, encode(msg))
        finally:
            msg.shm = None
        if not sent:
            self._shared.unsent(route, descriptor)
        elif nbytes:
            self._shared.sent(route, nbytes, descriptor)
        return sent

    def send_frames(self, route: Route, frames: Frames) -> bool:
        """Hand frames to ZeroMQ without blocking; False when the socket is full (retry later)."""
        peer, channel = route
        dealers = self._dealers.get(peer)
        # A zero-copy send needs pyzmq's garbage-collector thread, which pyzmq's atexit handler stops for
        # good: sends from a close at exit (a stage's last gradients) then copy, or the I/O thread dies.
        copy = zmq.utils.garbage.gc._stay_down or memoryview(frames[-1]).nbytes <= COPY_BYTES
        try:
            if dealers is not None:
                sock = dealers[channel]
                sock.send_multipart(self._seals.seal(frames, sock, peer, channel) if self._seals else frames,
                                    zmq.NOBLOCK, copy=copy)
            elif (ident := self._ident(peer)) is not None and self._routers:
                sealed = self._seals.seal(frames, None, peer, channel) if self._seals else frames
                self._routers[channel].send_multipart([ident, *sealed], zmq.NOBLOCK, copy=copy)
            else:
                log.error("no route to peer %r; message dropped", peer)
            return True
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:  # it left (or never was): acks to it are expected to fail
                log.debug("peer %r is not connected; message dropped", peer)
                return True
            raise
