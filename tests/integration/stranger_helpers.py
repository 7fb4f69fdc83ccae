"""Processes that are not members of a job: stranger sockets, their messages, and what they hear."""

from __future__ import annotations

import contextlib
import secrets
import socket
import time
from typing import Any

import numpy as np
import zmq

from sluice.transport.auth import JobKeys
from sluice.transport.wire import Kind, Message, encode
from sluice.transport.zmq_seal import Seals


def _stranger(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, name: str, server_key: bytes,
              member: tuple[JobKeys, str] | None = None) -> zmq.Socket[bytes]:
    """A DEALER calling itself `name`: with random keys, or (`member`) with that member's real keys."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, name.encode())
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_key)
    if member is None:
        public, secret = zmq.curve_keypair()
    else:
        keys, who = member
        public, secret = keys.public_key(who), keys.secret_key(who)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    sock.connect(endpoint)
    return sock


def _ticketed(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, name: str, keys: JobKeys, who: str, server: str,
              channel: int = 0, shown_from: str | None = None) -> zmq.Socket[bytes]:
    """A DEALER calling itself `name` at `server`'s sealed TCP listener on `channel`, with member `who`'s ticket
    (transport/zmq_seal.py): made for this connection, or (`shown_from`) one made for the address the kernel
    picks, shown from `shown_from` instead: a ticket read off the network, replayed from another host."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, name.encode())
    dialled = Seals(who, keys).dial(sock, server, channel, endpoint)
    if shown_from is not None:
        dialled = f"tcp://{shown_from}:0;{dialled.split(';', 1)[1]}"
    sock.connect(dialled)
    return sock


def _send(sock: zmq.Socket[bytes], msg: Message) -> None:
    with contextlib.suppress(zmq.Again):  # a socket whose handshake never succeeds has nowhere to put it
        sock.send_multipart(encode(msg), zmq.NOBLOCK)


def _heard(sockets: list[zmq.Socket[bytes]], seconds: float) -> int:
    """How many messages all of `sockets` received within `seconds`."""
    poller = zmq.Poller()
    for sock in sockets:
        poller.register(sock, zmq.POLLIN)
    got, deadline = 0, time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        for sock, _ in poller.poll(left * 1000):
            sock.recv_multipart()
            got += 1
    return got


def _register(role: str, rank: int) -> Message:
    return Message(Kind.REGISTER, meta={"role": role, "rank": rank, "endpoints": [], "pid": 1, "fingerprint": "x"})


def probe(scheduler: str, servers: list[str], seconds: float) -> dict[str, Any]:
    """Run in the stranger's host: register as worker 0, push to every server endpoint and only listen,
    each with random CURVE keys, without CURVE and with a ticket made with a guessed secret; what all of it heard
    in `seconds`."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()

    guessed = JobKeys(secrets.token_bytes(32), ["worker-0", "listener", "server-0"])

    def dealer(endpoint: str, name: str, mode: str) -> zmq.Socket[bytes]:
        if mode == "curve":  # a guessed server key: the real ones derive from the job secret
            return _stranger(ctx, endpoint, name, zmq.curve_keypair()[0])
        if mode == "ticket" and endpoint.startswith("tcp://"):  # a sealed listener's ticket, of a guessed secret
            return _ticketed(ctx, endpoint, name, guessed, name, "server-0")
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, name.encode())
        sock.connect(endpoint)
        return sock

    push = Message(Kind.PUSH, sender=0, key=0, chunk=0, round=1, dtype="float32", shape=(16,),
                   payload=np.full(16, 1e6, np.float32))
    sockets, raw = [], []
    try:
        for mode in ("curve", "none", "ticket"):
            sockets.append(registering := dealer(scheduler, "worker-0", mode))
            _send(registering, _register("worker", 0))
            for endpoint in servers:
                sockets.append(pushing := dealer(endpoint, "worker-0", mode))
                _send(pushing, push)
            sockets += [dealer(endpoint, "listener", mode) for endpoint in (scheduler, *servers)]
        for endpoint in (scheduler, *servers):  # no ZeroMQ at all: connect and read (the TCP ports: another host's)
            if not endpoint.startswith("tcp://"):
                continue
            host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
            raw.append(socket.create_connection((host, int(port)), timeout=5))
        heard = _heard(sockets, seconds)
        raw_bytes = []
        for conn in raw:
            conn.settimeout(0.05)
            got = b""
            with contextlib.suppress(OSError):
                while chunk := conn.recv(4096):
                    got += chunk
            raw_bytes.append(len(got))
        return {"heard": heard, "sockets": len(sockets), "raw_bytes": raw_bytes}
    finally:
        for sock in sockets:
            sock.close()
        for conn in raw:
            conn.close()
        ctx.term()
