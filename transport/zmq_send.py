"""The send side of ZmqTransport: its outbox into per-route priority queues, and queued messages to sockets."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq
import zmq.utils.garbage  # its atexit handler now, so that handlers registered later (a close) run before it

from sluice.transport.sendqueue import ChannelQueue
from sluice.transport.wire import Flag, Message, encode
from sluice.transport.zmq_receive import ReceivePath, Route

log = logging.getLogger("sluice.transport")

Frames = list[Any]


class SendPath(ReceivePath):
    """The send side of ZmqTransport (its base class, over the receive side); the state is ZmqTransport's."""

    #: called (message, queued at, sent at; monotonic seconds) as each message goes to its socket, on the I/O thread
    tracer: Callable[[Message, float, float], None] | None = None
    _outbox: deque[tuple[Route, Message, float]]
    _routers: list[zmq.Socket[bytes]]
    _inflight: int
    _aging: float
    _last_pump: float

    def _drain_outbox(self) -> None:
        while self._outbox:
            (peer, channel), msg, enqueued = self._outbox.popleft()
            dealers = self._dealers.get(peer)
            route = (peer, min(channel, len(dealers) - 1)) if dealers else (peer, channel)
            queue = self._queues.get(route)
            if queue is None:
                queue = self._queues[route] = ChannelQueue(self._inflight, self._aging)
            queue.push(msg.priority, msg.nbytes, msg, enqueued)
            self._active.add(route)

    def _pump(self) -> None:
        now = time.monotonic()
        if self._active:  # what waited since the last pump (the network agent's measure of a path)
            self.metrics.backlogged({peer for peer, _ in self._active}, now - self._last_pump)
        self._last_pump = now
        for route in list(self._active):
            queue = self._queues[route]
            ready = queue.pop_ready(now)
            for index, (priority, nbytes, msg, enqueued) in enumerate(ready):
                if not self._send_message(route, msg, nbytes):
                    for later_priority, later_bytes, later, later_enqueued in reversed(ready[index:]):
                        queue.push_front(later_priority, later_bytes, later, later_enqueued)
                    break
                self.metrics.sent(route[1], priority, nbytes, now - enqueued, route[0])
                if self.tracer is not None:  # the timeline (worker/trace.py): off unless asked for
                    self.tracer(msg, enqueued, now)
            if not len(queue):
                self._active.discard(route)

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
            sent = self._send_frames(route, encode(msg))
        finally:
            msg.shm = None
        if not sent:
            self._shared.unsent(route, descriptor)
        elif nbytes:
            self._shared.sent(route, nbytes, descriptor)
        return sent

    def _send_frames(self, route: Route, frames: Frames) -> bool:
        """Hand frames to ZeroMQ without blocking; False when the socket is full (retry later)."""
        peer, channel = route
        dealers = self._dealers.get(peer)
        # A zero-copy send needs pyzmq's garbage-collector thread, which pyzmq's atexit handler stops for
        # good: sends from a close at exit (a stage's last gradients) then copy, or the I/O thread dies.
        copy = zmq.utils.garbage.gc._stay_down
        try:
            if dealers is not None:
                dealers[channel].send_multipart(frames, zmq.NOBLOCK, copy=copy)
            elif (ident := self._route_ident(peer)) is not None and self._routers:
                self._routers[channel].send_multipart([ident, *frames], zmq.NOBLOCK, copy=copy)
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
