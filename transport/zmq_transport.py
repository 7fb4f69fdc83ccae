"""ZeroMQ transport: one socket per channel and peer, one I/O thread, credit-bounded priority queues.

Listening nodes bind one ROUTER per channel (on an abstract Unix socket and a TCP port: peers on this
host dial the first, local_endpoints.py); connecting nodes open one DEALER per channel to each peer,
with their node name as identity. All sockets live on a single I/O thread that polls them
with a zmq Poller (blocking sockets, no asyncio: see docs/architecture.md). Callers hand it
messages through a lock-free deque and an eventfd. Every received payload is acknowledged back to
its sender (lazily: zmq_receive.py); the sender keeps at most `inflight_bytes` unacknowledged per
channel, so the backlog stays in our priority heap instead of ZeroMQ's FIFO pipes. ZmqTransport owns
the sockets, the I/O thread and its loop, and two halves it runs there: a Receiver (zmq_receive.py)
validates what arrives, a Sender (zmq_send.py) queues and sends; CURVE, ZAP, size caps and socket monitors are
zmq_guard.py's, sealed connections zmq_seal.py's.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from errno import EADDRINUSE
from typing import Any

import numpy as np
import zmq

from sluice.transport import local_endpoints
from sluice.transport.auth import JobKeys
from sluice.transport.base import Handler
from sluice.transport.config import TransportConfig, on_this_host
from sluice.transport.metrics import TransportMetrics
from sluice.transport.rejects import Rejections
from sluice.transport.shm import SharedPayloads
from sluice.transport.wakeup import Wakeup
from sluice.transport.wire import CONTROL_HEADER_BYTES, DATA_HEADER_BYTES, Kind, Message, encode
from sluice.transport.zmq_guard import Guard, io_thread_mask, make_socket
from sluice.transport.zmq_receive import Arrived, Receiver, RouterPeers, _keep_large_buffers_mapped
from sluice.transport.zmq_seal import Seals
from sluice.transport.zmq_send import Sender

log = logging.getLogger("sluice.transport")


class ZmqTransport:
    """The sockets, the I/O thread that polls them and runs callers' commands, and the two halves it calls:
    `_receiver` for what a socket brings in, `_sender` for what callers send."""

    def __init__(self, name: str, config: TransportConfig, handler: Handler, keys: JobKeys | None = None,
                 control: bool = False, members: Iterable[str] = ()) -> None:
        if config.curve and keys is None:
            raise ValueError("transport.curve is on but no job keys were given; pass them, or set curve=False")
        self.name = name
        self.config = config
        self._keys = keys if config.curve else None
        #: a control-plane transport (the scheduler's) takes control-size headers on every socket
        self._control = control
        self._tos = config.channel_tos()
        _keep_large_buffers_mapped()
        self._ctx = zmq.Context(io_threads=config.io_threads)
        self._poller = zmq.Poller()
        #: data connections between hosts sealed (transport/zmq_seal.py); the scheduler's keep CURVE
        self._seals = Seals(name, self._keys) if self._keys is not None and config.cipher == "aes-gcm" \
            and not control else None
        self._guard = Guard(self._ctx, name, self._keys, self._seals, config.congestion_control)
        if self._guard.zap is not None:
            self._poller.register(self._guard.zap, zmq.POLLIN)
        self._monitors: set[zmq.Socket[bytes]] = set()
        self._max_header: dict[zmq.Socket[bytes], int] = {}
        self.rejects = Rejections(log)
        self._routers: list[zmq.Socket[bytes]] = []
        self._dealers: dict[str, list[zmq.Socket[bytes]]] = {}
        self._socket_channel: dict[zmq.Socket[bytes], tuple[str | None, int]] = {}
        #: peers on this host that read our shared memory (None: shared memory is off)
        self._local: set[str] | None = set() if config.shm else None
        # the live part of a ring is at most the in-flight bound, plus what a wrap-around leaves unused
        self._shared = SharedPayloads(config.inflight_limit + 2 * config.chunk_limit)
        self._commands: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self.metrics = TransportMetrics(config.channels)
        # the halves share the socket tables and shared memory above; each keeps its own state
        job = frozenset(members) | (self._keys.names if self._keys is not None else frozenset())
        peers = RouterPeers(job)
        self._sender = Sender(config, self.metrics, dealers=self._dealers, routers=self._routers, ident=peers.ident,
                              local=self._local, shared=self._shared, seals=self._seals)
        self._receiver = Receiver(name, config, handler, curve=self._keys is not None, members=job, peers=peers,
                                  dealers=self._dealers, local=self._local, shared=self._shared, metrics=self.metrics,
                                  rejects=self.rejects, cut=self._guard.cut, send_frames=self._sender.send_frames,
                                  credit=self._sender.credit, forget_peer=self._forget_peer, seals=self._seals)
        #: this transport's process token, in the HELLO that opens each of its connections (transport/incarnations.py)
        self._process = secrets.token_hex(8)
        self._enqueue = self._sender.outbox.append  # send()'s one step, bound once
        self._local_dials: set[str] = set()
        self._wake = Wakeup()
        self._poller.register(self._wake.fileno(), zmq.POLLIN)
        self._stop_at: float | None = None
        self._linger_ms = 2000
        #: why the I/O thread stopped, if it stopped on an error, and who wants to know (on_failure)
        self._failure: str | None = None
        self._failure_listeners: list[Callable[[str], None]] = []
        self._failure_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"sluice-io-{name}", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- caller side (any thread)
    def listen(self, port: int = 0) -> list[str]:
        return list(self._call(lambda: self._listen(port)))

    def connect(self, peer: str, endpoints: Sequence[str], control: bool = False, tos: int | None = None) -> None:
        self._call(lambda: self._connect(peer, list(endpoints), control, tos))

    def replace_peer(self, peer: str, endpoints: Sequence[str], control: bool = False,
                     tos: int | None = None) -> None:
        self._call(lambda: self._replace_peer(peer, list(endpoints), control, tos))

    def send(self, peer: str, channel: int, msg: Message) -> None:
        if not 0 <= channel < self.config.channels:
            raise ValueError(f"channel {channel} out of range 0..{self.config.channels - 1}")
        self._enqueue(((peer, channel), msg, time.monotonic()))
        if threading.get_ident() != self._thread.ident:  # the I/O thread drains its outbox anyway
            self._wake.ring()

    def withdraw(self, match: Callable[[str, int, Message], bool]) -> list[tuple[str, int, Message]]:
        taken = self._call(lambda: self._sender.withdraw(lambda route, msg: match(route[0], route[1], msg)))
        return [(peer, channel, msg) for (peer, channel), msg in taken]

    def alloc(self, count: int, dtype: np.dtype) -> np.ndarray:
        if self._local is None:
            return np.zeros(count, dtype)
        return self._shared.registry.alloc(count, dtype)

    @property
    def tracer(self) -> Callable[[Message, float, float], None] | None:
        """Called (message, queued at, sent at; monotonic seconds) as each message goes to its socket (I/O thread)."""
        return self._sender.tracer

    @tracer.setter
    def tracer(self, tracer: Callable[[Message, float, float], None] | None) -> None:
        self._sender.tracer = tracer

    def stats(self, reset: bool = False) -> dict[str, Any]:
        def snapshot() -> dict[str, Any]:
            taken = self.metrics.snapshot()
            taken["rejected"] = self.rejects.total
            taken["refused_connections"] = self._guard.refused_handshakes
            taken["tuned_connections"] = self._guard.tuned_connections  # given transport.congestion_control
            taken["local_peers"] = sorted(self._local_dials)  # dialled over their Unix sockets
            taken["sealed_connections"] = self._seals.connections() if self._seals is not None else 0
            taken["acks_sent"] = list(self.metrics.acks_sent)
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
            self._sender.set_inflight(nbytes)
            self._receiver.ack_bytes = 1  # the senders' bounds may now differ from ours: see ack_threshold

        self._call(apply)

    def close(self, flush_seconds: float = 1.0, linger_seconds: float = 2.0) -> None:
        if self._stop_at is None:
            self._linger_ms = max(0, round(linger_seconds * 1000))
            self._stop_at = time.monotonic() + flush_seconds
            self._wake.ring()
        self._thread.join(flush_seconds + 5.0)
        if self._thread.is_alive():
            log.error("transport %s: I/O thread did not stop", self.name)
            return
        self._wake.close()

    def refuse(self, peer: str, text: str) -> None:
        """Count and log (rate-limited) a message the handler refused; call it on the I/O thread."""
        self.rejects.refuse(peer, text, time.monotonic(), member=self._receiver.is_member(peer), delivered=True)

    def _call(self, fn: Callable[[], Any], timeout: float = 10.0) -> Any:
        if threading.get_ident() == self._thread.ident:  # a handler calling back: run it in place
            return fn()
        future: Future[Any] = Future()
        self._commands.append((fn, future))
        self._wake.ring()
        return future.result(timeout)

    # ----------------------------------------------------------------- I/O thread
    def _socket(self, kind: int, channel: int, control: bool, tos: int | None = None) -> zmq.Socket[bytes]:
        """`tos`: this socket's mark instead of its channel's, where packets are marked."""
        header = CONTROL_HEADER_BYTES if control else DATA_HEADER_BYTES
        largest = header if control else max(header, self.config.largest_payload)
        mark = (self._tos[channel] if tos is None else tos) if self._tos else None
        sock = make_socket(self._ctx, kind, largest, mark,
                           self.config.so_priority[channel] if self.config.so_priority else None)
        self._max_header[sock] = header
        if self.config.io_threads > 1:
            sock.setsockopt(zmq.AFFINITY, io_thread_mask(channel, self.config.io_threads))
        if kind == zmq.ROUTER:
            # a process that replaced a dead one (ps.recover) dials under its name while the dead one's
            # connection may look open for good (its host lost with its link down: no FIN came): the new
            # connection takes the name. With CURVE only a member's key can connect, and members are trusted
            sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        return sock

    def _listen(self, port: int) -> list[str]:
        if self._routers:
            raise RuntimeError(f"transport {self.name} is already listening")
        channels = self.config.channels
        if port and (self.config.protocol != "tcp" or not 0 < port <= 65536 - channels):
            raise ValueError(f"cannot listen on port {port}: a fixed port needs transport.protocol = tcp and "
                             f"{channels} ports from it up to 65535")
        made: list[tuple[zmq.Socket[bytes], zmq.Socket[bytes] | None]] = []
        # each channel's ROUTER binds its local Unix socket, then (protocol tcp) its port: both published
        local = local_endpoints.new_names(channels) if local_endpoints.AVAILABLE else []
        if not local and self.config.protocol == "ipc":
            raise ValueError("transport.protocol = ipc needs Linux's abstract Unix sockets; use tcp here")
        network: list[str] = []
        address = ""
        try:
            for channel in range(channels):
                sock = self._socket(zmq.ROUTER, channel, self._control)
                sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
                made.append((sock, self._guard.watch(sock)))
                binds = local[channel:channel + 1]
                if self.config.protocol == "tcp":
                    binds.append(self._address(channel, port))
                for address in binds:
                    self._guard.secure_listener(sock, address, channel)
                    sock.bind(address)
                if self.config.protocol == "tcp":
                    network.append(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        except zmq.ZMQError as exc:
            self._drop(made)
            in_use = exc.errno == EADDRINUSE
            taken = ": another process holds it; stop that one, or choose another port" if in_use else ""
            error = OSError(f"cannot listen on {address} ({os.strerror(exc.errno or 0)}){taken}")
            error.errno = exc.errno
            raise error from None
        for channel, (sock, monitor) in enumerate(made):
            if monitor is not None:
                self._guard.tune_listener(monitor)
            self._watch(monitor)
            self._routers.append(sock)
            self._socket_channel[sock] = (None, channel)
            self._poller.register(sock, zmq.POLLIN)
        return network + local

    def _address(self, channel: int, port: int) -> str:
        return f"tcp://{self.config.host}:{port + channel if port else 0}"

    def _drop(self, made: list[tuple[zmq.Socket[bytes], zmq.Socket[bytes] | None]]) -> None:
        """Close listeners of a listen() that failed, so that none holds a port or is half set up."""
        for sock, _ in made:
            self._max_header.pop(sock, None)
            self._guard.unwatch(sock)
            sock.close(linger=0)

    def _watch(self, monitor: zmq.Socket[bytes] | None) -> None:
        if monitor is not None:
            self._monitors.add(monitor)
            self._poller.register(monitor, zmq.POLLIN)

    def _connect(self, peer: str, endpoints: list[str], control: bool, tos: int | None = None) -> None:
        if peer in self._dealers:
            return
        if not endpoints:
            raise ValueError(f"no endpoints given for peer {peer}")
        socks = []
        if self._local is not None and on_this_host(endpoints, self.config.host) and not control:
            self._local.add(peer)
            self._shared.announce_registered([peer])
        dialled, local = local_endpoints.choose(endpoints, self.config.channels, self.config.host)
        if local:
            self._local_dials.add(peer)
        for channel, endpoint in enumerate(dialled):
            sock = self._socket(zmq.DEALER, channel, control or self._control, tos)
            sock.setsockopt(zmq.IDENTITY, self.name.encode())
            self._watch(self._guard.watch(sock, listening=False))
            sock.connect(self._guard.secure_dialer(sock, peer, endpoint, channel, control or self._control))
            # the first message on the connection, before anything queued: a restarted process is told apart
            hello = encode(Message(Kind.HELLO, meta={"process": self._process}))
            sock.send_multipart(self._seals.seal(hello, sock, peer, channel) if self._seals else hello, zmq.NOBLOCK)
            socks.append(sock)
            self._socket_channel[sock] = (peer, channel)
            self._poller.register(sock, zmq.POLLIN)
        self._dealers[peer] = socks

    def _replace_peer(self, peer: str, endpoints: list[str], control: bool, tos: int | None) -> None:
        for sock in self._dealers.pop(peer, []):
            self._poller.unregister(sock)
            self._socket_channel.pop(sock, None)
            self._max_header.pop(sock, None)
            if self._seals is not None:
                self._seals.hung_up(sock)
            if (monitor := self._guard.unwatch(sock)) is not None:
                self._poller.unregister(monitor)
                self._monitors.discard(monitor)
            sock.close(linger=0)  # what ZeroMQ still held for the dead process goes with it
        self._local_dials.discard(peer)
        self._forget_peer(peer)
        self._connect(peer, endpoints, control, tos)

    def _forget_peer(self, peer: str) -> None:
        """What we kept for `peer`'s process, which a new one replaced: the queues and their credit, the
        acknowledgements owed, shared memory."""
        self._receiver.forget([*self._sender.forget(peer), *self._receiver.owed(peer)])
        if self._local is not None:
            self._local.discard(peer)
        self._shared.forget(peer)

    def _run(self) -> None:
        receiver, sender = self._receiver, self._sender
        try:
            while not self._finished():
                events = self._poller.poll(self._poll_ms())
                turn = time.monotonic()
                arrived: Arrived = []
                for sock, _ in events:
                    if sock == self._wake.fileno():
                        self._wake.clear()
                    elif sock is self._guard.zap:
                        self._guard.answer_zap()
                    elif sock in self._monitors:
                        if self._guard.read_monitor(sock):  # counted there; logged here, at a bounded rate
                            self.rejects.refuse("a stranger", "refused a connection whose handshake failed (no job "
                                                "secret: a key or a ticket that is no member's)", time.monotonic())
                    else:
                        peer, channel = self._socket_channel[sock]
                        receiver.receive(sock, peer, channel, self._max_header[sock], arrived)
                receiver.dispatch(arrived)
                self._run_commands()
                receiver.flush_acks(turn)
                sender.drain_outbox()
                sender.pump()
                receiver.announce()
                self.rejects.tick(time.monotonic())
        except Exception as exc:
            log.exception("transport %s: I/O thread failed", self.name)
            self._failed(f"transport {self.name}: its I/O thread stopped on {type(exc).__name__}: {exc}; "
                         "this process can send and receive nothing more (the log above has the traceback)")
        finally:
            self._shutdown()

    def on_failure(self, listener: Callable[[str], None]) -> None:
        with self._failure_lock:
            if self._failure is None:
                self._failure_listeners.append(listener)
                return
        listener(self._failure)

    def _failed(self, error: str) -> None:
        with self._failure_lock:
            self._failure, listeners, self._failure_listeners = error, self._failure_listeners, []
        for listener in listeners:
            try:
                listener(error)
            except Exception:  # one listener's error must not keep the others from hearing
                log.exception("transport %s: a failure listener failed", self.name)

    def _poll_ms(self) -> int:
        """How long the next poll may wait: a delayed acknowledgement leaves on time even when nothing
        else happens (at least 1 ms: one still due after a full socket does not spin)."""
        ack_due, busy = self._receiver.ack_due, bool(self._sender.active)
        if ack_due is None:
            return 5 if busy else 100
        return min(5 if busy else 100, max(1, math.ceil((ack_due - time.monotonic()) * 1e3)))

    def _finished(self) -> bool:
        if self._stop_at is None:
            return False
        return self._sender.idle() or time.monotonic() > self._stop_at

    def _run_commands(self) -> None:
        while self._commands:
            fn, future = self._commands.popleft()
            try:
                future.set_result(fn())
            except Exception as exc:
                future.set_exception(exc)

    def _shutdown(self) -> None:
        # No last acknowledgements: credit is for a peer that goes on sending to us, and we leave. One to a
        # peer that left first would hold ctx.term() for the whole linger, waiting for it to come back.
        self._shared.close()
        self._guard.close()
        for sock in list(self._socket_channel):
            sock.close(linger=self._linger_ms if self._stop_at is not None else 0)
        self._ctx.term()
        while self._commands:
            self._commands.popleft()[1].set_exception(RuntimeError(f"transport {self.name} closed"))
