"""ZeroMQ transport: one socket per channel and peer, one I/O thread, credit-bounded priority queues.

Listening nodes bind one ROUTER per channel; connecting nodes open one DEALER per channel to each
peer, with their node name as identity. All sockets live on a single I/O thread that polls them
with a zmq Poller (blocking sockets, no asyncio: see ARCHITECTURE.md section 5). Callers hand it
messages through a lock-free deque and an eventfd. Every received payload is acknowledged back to
its sender in batches; the sender keeps at most `inflight_bytes` unacknowledged per channel, so the
backlog stays in our priority heap instead of ZeroMQ's FIFO pipes.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import tempfile
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np
import zmq

from transport.base import Handler
from transport.config import LOCAL_ENDPOINTS, TransportConfig
from transport.metrics import TransportMetrics
from transport.sendqueue import ChannelQueue
from transport.shm import SharedPayloads
from transport.wire import Flag, Kind, Message, WireError, decode, encode

log = logging.getLogger("sluice.transport")

_RECV_BATCH = 64
_MAX_ROUTER_PEERS = 4096
_HWM = 100_000
_LINGER_MS = 2000

Route = tuple[str, int]  # (peer name, channel)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def _keep_large_buffers_mapped() -> None:
    """Stop glibc from mmap-ing (and unmapping) every received 1 MiB frame.

    libzmq mallocs each large incoming message; above the mmap threshold every one costs fresh page
    faults. Measured with 2 workers x 2 servers, 64 MiB push_pull: 816k -> 56k minor faults and a
    third less system time with the threshold at 64 MiB.
    """
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, 64 << 20)
        libc.mallopt(_M_TRIM_THRESHOLD, 256 << 20)
    except (OSError, AttributeError):  # not glibc: keep the allocator's defaults
        pass
Frames = list[Any]


class ZmqTransport:
    def __init__(self, name: str, config: TransportConfig, handler: Handler) -> None:
        self.name = name
        self.config = config
        self._handler = handler
        self._tos = config.channel_tos()
        self._inflight = config.inflight_limit
        self._aging = config.aging_ms / 1e3
        _keep_large_buffers_mapped()
        self._ctx = zmq.Context(io_threads=1)
        self._poller = zmq.Poller()
        self._routers: list[zmq.Socket[bytes]] = []
        self._dealers: dict[str, list[zmq.Socket[bytes]]] = {}
        self._router_idents: dict[str, bytes] = {}
        self._socket_channel: dict[zmq.Socket[bytes], tuple[str | None, int]] = {}
        self._queues: dict[Route, ChannelQueue[Message]] = {}
        self._active: set[Route] = set()
        self._outbox: deque[tuple[Route, Message, float]] = deque()
        #: peers on this host that read our shared memory (None: shared memory is off)
        self._local: set[str] | None = set() if config.shm else None
        # the live part of a ring is at most the in-flight bound, plus what a wrap-around leaves unused
        self._shared = SharedPayloads(config.inflight_limit + 2 * config.chunk_limit)
        self._commands: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._unacked: dict[Route, int] = defaultdict(int)
        self.metrics = TransportMetrics(config.channels)
        self._ipc_dir: str | None = None
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._wake_lock = threading.Lock()
        self._closed = False
        self._poller.register(self._wake, zmq.POLLIN)
        self._stop_at: float | None = None
        self._thread = threading.Thread(target=self._run, name=f"sluice-io-{name}", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- caller side (any thread)
    def listen(self) -> list[str]:
        return list(self._call(self._listen))

    def connect(self, peer: str, endpoints: Sequence[str]) -> None:
        self._call(lambda: self._connect(peer, list(endpoints)))

    def send(self, peer: str, channel: int, msg: Message) -> None:
        if not 0 <= channel < self.config.channels:
            raise ValueError(f"channel {channel} out of range 0..{self.config.channels - 1}")
        self._outbox.append(((peer, channel), msg, time.monotonic()))
        if threading.get_ident() != self._thread.ident:  # the I/O thread drains its outbox anyway
            self._notify()

    def alloc(self, count: int, dtype: np.dtype) -> np.ndarray:
        if self._local is None:
            return np.zeros(count, dtype)
        return self._shared.registry.alloc(count, dtype)

    def stats(self, reset: bool = False) -> dict[str, Any]:
        def snapshot() -> dict[str, Any]:
            taken = self.metrics.snapshot()
            if reset:
                self.metrics.reset()
            return taken

        if self._stop_at is not None:  # the I/O thread may be gone; its counters no longer change
            return snapshot()
        return dict(self._call(snapshot))

    def set_inflight(self, nbytes: int) -> None:
        if nbytes < 1:
            raise ValueError(f"in-flight bound must be positive, got {nbytes}")

        def apply() -> None:
            self._inflight = nbytes
            for queue in self._queues.values():
                queue.bound = nbytes

        self._call(apply)

    def close(self, flush_seconds: float = 1.0) -> None:
        if self._stop_at is None:
            self._stop_at = time.monotonic() + flush_seconds
            self._notify()
        self._thread.join(flush_seconds + 5.0)
        if self._thread.is_alive():
            log.error("transport %s: I/O thread did not stop", self.name)
            return
        with self._wake_lock:
            if not self._closed:
                self._closed = True
                os.close(self._wake)

    def _notify(self) -> None:
        """Wake the I/O thread; a no-op once closed, so late senders (heartbeats) cannot fail."""
        with self._wake_lock:
            if not self._closed:
                os.eventfd_write(self._wake, 1)

    def _call(self, fn: Callable[[], Any], timeout: float = 10.0) -> Any:
        if threading.get_ident() == self._thread.ident:  # a handler calling back: run it in place
            return fn()
        future: Future[Any] = Future()
        self._commands.append((fn, future))
        self._notify()
        return future.result(timeout)

    # ----------------------------------------------------------------- I/O thread
    def _socket(self, kind: int, channel: int) -> zmq.Socket[bytes]:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, _LINGER_MS)
        sock.setsockopt(zmq.SNDHWM, _HWM)
        sock.setsockopt(zmq.RCVHWM, _HWM)
        if self._tos:
            sock.setsockopt(zmq.TOS, self._tos[channel])
        if self.config.so_priority:
            sock.setsockopt(zmq.PRIORITY, self.config.so_priority[channel])
        return sock

    def _listen(self) -> list[str]:
        if self._routers:
            raise RuntimeError(f"transport {self.name} is already listening")
        endpoints = []
        for channel in range(self.config.channels):
            sock = self._socket(zmq.ROUTER, channel)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            if self.config.protocol == "ipc":
                self._ipc_dir = self._ipc_dir or tempfile.mkdtemp(prefix="sluice-")
                sock.bind(f"ipc://{self._ipc_dir}/ch{channel}")
            else:
                sock.bind(f"tcp://{self.config.host}:0")
            endpoints.append(sock.getsockopt_string(zmq.LAST_ENDPOINT))
            self._routers.append(sock)
            self._socket_channel[sock] = (None, channel)
            self._poller.register(sock, zmq.POLLIN)
        return endpoints

    def _connect(self, peer: str, endpoints: list[str]) -> None:
        if peer in self._dealers:
            return
        if not endpoints:
            raise ValueError(f"no endpoints given for peer {peer}")
        socks = []
        if self._local is not None and all(e.startswith(LOCAL_ENDPOINTS) for e in endpoints):
            self._local.add(peer)
        for channel, endpoint in enumerate(endpoints[: self.config.channels]):
            sock = self._socket(zmq.DEALER, channel)
            sock.setsockopt(zmq.IDENTITY, self.name.encode())
            sock.connect(endpoint)
            socks.append(sock)
            self._socket_channel[sock] = (peer, channel)
            self._poller.register(sock, zmq.POLLIN)
        self._dealers[peer] = socks

    def _run(self) -> None:
        try:
            while not self._finished():
                events = self._poller.poll(5 if self._active else 100)
                arrived: list[tuple[int, int, str, int, Message]] = []
                for sock, _ in events:
                    if sock == self._wake:
                        os.eventfd_read(self._wake)
                    else:
                        self._receive(sock, arrived)
                self._dispatch(arrived)
                self._run_commands()
                self._flush_acks()
                self._drain_outbox()
                self._pump()
        except Exception:
            log.exception("transport %s: I/O thread failed", self.name)
        finally:
            self._shutdown()

    def _finished(self) -> bool:
        if self._stop_at is None:
            return False
        idle = not self._outbox and not any(len(self._queues[r]) for r in self._active)
        return idle or time.monotonic() > self._stop_at

    def _run_commands(self) -> None:
        while self._commands:
            fn, future = self._commands.popleft()
            try:
                future.set_result(fn())
            except Exception as exc:
                future.set_exception(exc)

    def _receive(self, sock: zmq.Socket[bytes], arrived: list[tuple[int, int, str, int, Message]]) -> None:
        """Read up to a batch from `sock`: credit acks are applied now, the rest goes to `arrived`."""
        peer, channel = self._socket_channel[sock]
        for _ in range(_RECV_BATCH):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            source = peer
            if source is None:  # a ROUTER: the first frame names the sender, as the sender chose it
                ident = frames.pop(0).bytes
                source = ident.decode("utf-8", "replace")
                if source in self._dealers:
                    log.warning("dropped a message whose sender calls itself %r, a peer we connected to", source)
                    continue
                self._remember(source, ident)
            try:
                msg = decode(frames)
                if msg.shm is not None:
                    self._unacked[(source, channel)] += msg.shm[2]
                    msg.payload = self._map_shared(msg.shm)
                    msg.shm = None
            except WireError as exc:
                log.warning("dropped a message from %r on channel %d: %s", source, channel, exc)
                continue
            if msg.flags & Flag.LOCAL and self._local is not None and peer is None:
                self._local.add(source)
            if msg.kind == Kind.ACK:
                queue = self._queues.get((source, channel))
                if queue is not None:
                    queue.ack(msg.round)
                    self._shared.acked((source, channel), msg.round)
                    self._active.add((source, channel))
                continue
            if msg.payload is not None:
                if not msg.flags & Flag.SHM:
                    self._unacked[(source, channel)] += msg.payload.nbytes
                self.metrics.received_bytes[channel] += msg.payload.nbytes
            arrived.append((msg.priority, len(arrived), source, channel, msg))

    def _dispatch(self, arrived: list[tuple[int, int, str, int, Message]]) -> None:
        """Hand what one poll brought in to the handler, most urgent first, FIFO among equals: the
        receiving hop keeps the senders' priorities (a server sums and answers urgent chunks first)."""
        if len(arrived) > 1:
            arrived.sort()  # (priority, arrival index, ...): the index is unique, so nothing after it is compared
        for _, _, source, channel, msg in arrived:
            try:
                self._handler(source, channel, msg)
            except Exception:
                log.exception("handling %s from %s failed; message dropped", msg.kind.name, source)

    def _remember(self, source: str, ident: bytes) -> None:
        """Keep the identity a ROUTER needs to reply; bounded, so a flood of strangers cannot grow it."""
        if source not in self._router_idents and len(self._router_idents) >= _MAX_ROUTER_PEERS:
            del self._router_idents[next(iter(self._router_idents))]
        self._router_idents[source] = ident

    def _flush_acks(self) -> None:
        if not self._unacked:
            return
        pending, self._unacked = self._unacked, defaultdict(int)
        for route, nbytes in pending.items():
            if not self._send_frames(route, encode(Message(Kind.ACK, key=route[1], round=nbytes))):
                self._unacked[route] += nbytes

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
        for route in list(self._active):
            queue = self._queues[route]
            ready = queue.pop_ready(now)
            for index, (priority, nbytes, msg, enqueued) in enumerate(ready):
                if not self._send_message(route, msg, nbytes):
                    for later_priority, later_bytes, later, later_enqueued in reversed(ready[index:]):
                        queue.push_front(later_priority, later_bytes, later, later_enqueued)
                    break
                self.metrics.sent(route[1], priority, nbytes, now - enqueued)
            if not len(queue):
                self._active.discard(route)

    def _map_shared(self, descriptor: tuple[str, int, int]) -> memoryview:
        try:
            return self._shared.mapper.view(*descriptor)
        except ValueError as exc:
            raise WireError(str(exc)) from None

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
        try:
            if dealers is not None:
                dealers[channel].send_multipart(frames, zmq.NOBLOCK, copy=False)
            elif peer in self._router_idents and self._routers:
                self._routers[channel].send_multipart(
                    [self._router_idents[peer], *frames], zmq.NOBLOCK, copy=False
                )
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

    def _shutdown(self) -> None:
        self._shared.close()
        for sock in list(self._socket_channel):
            sock.close(linger=_LINGER_MS if self._stop_at is not None else 0)
        self._ctx.term()
        if self._ipc_dir:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
        while self._commands:
            self._commands.popleft()[1].set_exception(RuntimeError(f"transport {self.name} closed"))
