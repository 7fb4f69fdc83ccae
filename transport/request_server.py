"""One-frame requests and replies beside a job: a ROUTER answering on a thread of its own behind the guard, a DEALER.

The cluster's job registry (scheduler/registry_service.py) and the per-machine launchers' rank service
(launch/node_ranks.py) both serve small JSON requests outside a job's transport. With keys, the ROUTER
is a CURVE server whose ZAP handler admits only clients whose key derives from the same secret
(transport/auth.py JobKeys), so a process without it never gets a request through; its failed handshakes
are counted. Every frame is capped before it is read (zmq_guard.make_socket); a request the owner's
`answer` refuses (ValueError) gets no reply and is counted, and the server goes on.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable

import zmq

from sluice.transport.auth import JobKeys
from sluice.transport.rejects import Rejections
from sluice.transport.zmq_guard import Guard, make_socket

_POLL_MS = 200


def json_within(data: bytes, limit: int, what: str) -> object:
    """`data` decoded as JSON once it is known to be at most `limit` bytes; ValueError naming `what` otherwise."""
    if len(data) > limit:
        raise ValueError(f"{what}of {len(data)} bytes, over {limit}" if what else f"{len(data)} bytes, over {limit}")
    try:
        return json.loads(data)
    except ValueError:
        raise ValueError(f"{what}that is not JSON" if what else "not JSON") from None


def tcp_url(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


#: answer(peer, request, now): the reply to send, or ValueError saying why the request is refused
Answer = Callable[[str, bytes, float], bytes]


class RequestServer:
    """Answers each one-frame request on a ROUTER bound to address:port, on a thread started by start()."""

    def __init__(self, name: str, address: str, port: int, keys: JobKeys | None, frame_cap: int, answer: Answer,
                 log: logging.Logger, what: str) -> None:
        """Bind (zmq.ZMQError when it cannot: taken, or not this host's). `name`: the member whose keys the ROUTER
        holds; `what`: how refusals name the service in the log."""
        self.endpoint, self._answer, self._what = tcp_url(address, port), answer, what
        self.rejects = Rejections(log)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._guard = Guard(self._ctx, name, keys)  # its own context: its own ZAP handler
        self._sock = make_socket(self._ctx, zmq.ROUTER, frame_cap, None, None)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.IPV6, int(":" in address))
        self._monitor = self._guard.watch(self._sock)
        self._guard.secure_listener(self._sock, self.endpoint)
        try:
            self._sock.bind(self.endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"sluice-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def refused(self) -> int:
        """Requests refused (malformed, oversized, or by `answer`) and handshakes failed (no secret)."""
        return self.rejects.total + self._guard.refused_handshakes

    def _serve(self) -> None:
        poller = zmq.Poller()
        for sock in (self._sock, self._guard.zap, self._monitor):
            if sock is not None:
                poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            ready = dict(poller.poll(_POLL_MS))
            if self._guard.zap is not None and self._guard.zap in ready:
                self._guard.answer_zap()
            if self._monitor is not None and self._monitor in ready:
                self._guard.read_monitor(self._monitor)
            while self._sock in ready:
                try:
                    frames = self._sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._take(frames, time.monotonic())
            self.rejects.tick(time.monotonic())

    def _take(self, frames: list[bytes], now: float) -> None:
        peer = frames[0].hex()[:16]
        try:
            if len(frames) != 2:
                raise ValueError(f"{len(frames) - 1} frames, expected 1")
            reply = self._answer(peer, frames[1], now)
        except ValueError as exc:
            self.rejects.refuse(peer, f"{self._what}: refused a request from {peer}: {exc}", now)
            return
        with contextlib.suppress(zmq.ZMQError):  # the client went away (or is not reading): it asks again
            self._sock.send_multipart([frames[0], reply], zmq.NOBLOCK)

    def _close_sockets(self) -> None:
        for sock in (self._sock, self._monitor):
            if sock is not None:
                sock.close(linger=0)
        self._guard.close()
        self._ctx.term()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=max(1.0, 5 * _POLL_MS / 1000))
        if not self._thread.is_alive():
            self._close_sockets()


def dealer(ctx: zmq.Context[zmq.Socket[bytes]], host: str, port: int, keys: JobKeys | None, names: tuple[str, str],
           max_reply: int, immediate: bool) -> zmq.Socket[bytes]:
    """A DEALER connected to a RequestServer at host:port; `names`: (this client's member, the server's member)
    whose keys authenticate both ends when `keys` is given. `immediate`: send only while connected."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 4)  # a server that is away must not collect a queue of old requests
    sock.setsockopt(zmq.RCVHWM, 4)
    sock.setsockopt(zmq.MAXMSGSIZE, max_reply + 4096)  # + CURVE's framing
    sock.setsockopt(zmq.IMMEDIATE, int(immediate))
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
    sock.setsockopt(zmq.IPV6, int(":" in host))
    if keys is not None:
        keys.secure_client(sock, *names)
    sock.connect(tcp_url(host, port))
    return sock
