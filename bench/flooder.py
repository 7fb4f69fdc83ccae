"""bench/flood.py's flooder: a process that sends garbage at a job's servers and scheduler (or only spins a core)."""

from __future__ import annotations

import errno
import random
import secrets
import socket
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

from sluice.scheduler.bootstrap import member_names, node_name
from sluice.transport import local_endpoints
from sluice.transport.auth import JobKeys
from sluice.transport.seal import MAX_FRAMES, Sealer
from sluice.transport.wire import VERSION, Kind
from sluice.transport.zmq_seal import Seals

#: the flood modes (bench/flood.py --modes)
STRANGERS, MEMBER, CURVE_OFF, CURVE_OFF_BANNED, SPIN = (
    "strangers", "member", "curve-off", "curve-off-banned", "busy-loop")
_SO_LINGER_RESET = struct.pack("ii", 1, 0)  # close with RST: no TIME_WAIT left behind per connection


# ---------------------------------------------------------------------------- the garbage
def _header(**fields: Any) -> bytes:
    """A data header (wire.py's positional array) with `fields` changed."""
    values: dict[str, Any] = {
        "version": VERSION, "kind": int(Kind.PUSH), "sender": 0, "key": 0, "chunk": 0, "round": 1,
        "priority": 0, "dtype": "float32", "shape": [4], "nbytes": 16, "flags": 0, "meta": None,
    }
    values.update(fields)
    order = ("version", "kind", "sender", "key", "chunk", "round", "priority", "dtype", "shape", "nbytes", "flags",
             "meta")
    return bytes(msgpack.packb([values[name] for name in order]))


def garbage(rng: random.Random, to_server: bool) -> list[list[bytes]]:
    """Single-frame messages the decoder refuses (a sample of tests/integration/attack.py's raw
    attacks); for a server also a well-formed PULL of an unknown key from a non-worker id, which its
    store refuses. None of them changes any state.

    One frame each: libzmq 4.3.5 aborts a process whose connection drops while it is between the
    frames of a multipart message (session_base.cpp:233, clean_pipes), and connections of banned
    strangers are cut while they flood."""
    valid = _header()
    nested = b"\x9c" + b"".join(bytes(msgpack.packb(v)) for v in (VERSION, int(Kind.PUSH))) + b"\x91" * 1000 + b"\xc0"
    frames = [
        [rng.randbytes(rng.randint(1, 64))],
        [rng.randbytes(rng.randint(1, 64))],
        [rng.randbytes(4096)],
        [_header(version=VERSION + 1)],
        [valid[: len(valid) // 2]],
        [valid[:1]],
        [b""],
        [_header(dtype="complex64", shape=[2], nbytes=16)],
        [_header(kind=77)],
        [_header(key=-1)],
        [_header(meta=[1, 2, 3])],
        [valid],  # a float32 header without its payload frame
        [nested],
        [b"\xdd\xff\xff\xff\xff"],  # an array header claiming 4 billion items
    ]
    if to_server:
        frames.append([_header(kind=int(Kind.PULL), key=1 << 20, sender=999, dtype="", shape=[], nbytes=0)])
    return frames


# ---------------------------------------------------------------------------- the flooding process
@dataclass
class Target:
    """One endpoint to flood: a server's channel or the scheduler."""

    endpoint: str
    server: str  # the member listening there: "server-R" or "scheduler"
    #: member mode: the member name (and key) the flooder claims there
    claim: str = ""
    #: the channel of the server's listener there (its network or its local endpoints, in channel order)
    channel: int = 0


@dataclass
class _Sender:
    target: Target
    sock: zmq.Socket[bytes]
    frames: list[list[bytes]]
    index: int = 0
    sent: int = 0
    #: member mode at a sealed listener: what seals each message, so that the garbage reaches the decoder
    sealer: Sealer | None = None


@dataclass
class FloodReport:
    mode: str
    seconds: float = 0.0
    sent_servers: int = 0
    sent_scheduler: int = 0
    sockets_opened: int = 0
    full_waits: int = 0
    failed_connections: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "seconds": self.seconds, "sent": self.sent_servers + self.sent_scheduler,
                "sent_servers": self.sent_servers, "sent_scheduler": self.sent_scheduler,
                "sockets_opened": self.sockets_opened, "full_waits": self.full_waits,
                "failed_connections": self.failed_connections}


class Flood:
    """The sockets of one flooding process, made as its mode says, and the loop that floods."""

    def __init__(self, mode: str, targets: list[Target], keys: JobKeys | None, sockets: int, rotate: int,
                 rate: float = 0.0) -> None:
        self.mode, self.targets, self.keys, self.rotate = mode, targets, keys, rotate
        #: messages (or connections) per second in all; 0: as fast as they are taken
        self.rate = rate
        self.rng = random.Random(secrets.randbits(64))
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context(io_threads=1)
        # closed sockets are reaped in the background: rotating identities outpaces it at the default 1023
        self.ctx.set(zmq.MAX_SOCKETS, 16384)
        self.report = FloodReport(mode)
        self.garbage = {True: garbage(self.rng, True), False: garbage(self.rng, False)}
        per = 1 if mode == MEMBER else sockets
        self.senders = [self._make(t, n) for t in targets for n in range(per)]

    def _make(self, target: Target, n: int) -> _Sender:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 1000)
        endpoint, sealer = target.endpoint, None
        if self.mode == MEMBER:
            assert self.keys is not None
            sock.setsockopt(zmq.IDENTITY, target.claim.encode())
            if target.server != "scheduler" and not target.endpoint.startswith(local_endpoints.PREFIX):
                seals = Seals(target.claim, self.keys)  # a data listener on the network: sealed (transport.cipher)
                endpoint = seals.dial(sock, target.server, target.channel, target.endpoint)
                sealer = seals.sealer(sock)
            else:
                self.keys.secure_dialer(sock, target.claim, target.server, target.endpoint)
        elif self.mode == STRANGERS:
            assert self.keys is not None
            # a stranger claiming a member's name; half know the server's public key (leaked), half guess it
            sock.setsockopt(zmq.IDENTITY, node_name("worker", 0).encode())
            if target.endpoint.startswith(local_endpoints.PREFIX):  # a ticket made with a guessed secret
                JobKeys(self.rng.randbytes(32), self.keys.names).secure_dialer(
                    sock, node_name("worker", 0), target.server, target.endpoint)
            else:
                server_key = self.keys.public_key(target.server) if n % 2 == 0 else zmq.curve_keypair()[0]
                public, secret = zmq.curve_keypair()
                sock.setsockopt(zmq.CURVE_SERVERKEY, server_key)
                sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
                sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
            # each retry is a refused handshake: paced, they come at about the rate asked for in all
            retry_ms = 1 if not self.rate else max(1, int(1000 * len(self.targets) * 4 / self.rate))
            sock.setsockopt(zmq.RECONNECT_IVL, retry_ms)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 0)
        else:
            sock.setsockopt(zmq.IDENTITY, f"stranger-{self.rng.getrandbits(48):012x}".encode())
        sock.connect(endpoint)
        self.report.sockets_opened += 1
        return _Sender(target, sock, self.garbage[target.server != "scheduler"], self.rng.randrange(64), sealer=sealer)

    def _remake(self, target: Target, n: int) -> _Sender:
        """A new socket; while too many closed ones await the reaper (EMFILE), wait for it a little."""
        for _ in range(200):
            try:
                return self._make(target, n)
            except zmq.ZMQError as exc:
                if exc.errno != errno.EMFILE:
                    raise
                self.report.full_waits += 1
                time.sleep(0.005)
        return self._make(target, n)

    def run(self, stop: Any, limit: float) -> FloodReport:
        """Flood until `stop` is set (or `limit` seconds have passed)."""
        started = time.monotonic()
        if self.mode == STRANGERS:
            self._connections(stop, started, limit)
        else:
            self._messages(stop, started, limit)
        self.report.seconds = time.monotonic() - started
        return self.report

    def _connections(self, stop: Any, started: float, limit: float) -> None:
        """Connections (TCP, or Unix at a local endpoint) that send a garbage greeting and reset, round robin over
        the endpoints (the CURVE strangers meanwhile retry their handshakes on ZeroMQ's I/O thread)."""
        addresses: list[tuple[Target, socket.AddressFamily, Any]] = []
        for target in self.targets:
            if target.endpoint.startswith(local_endpoints.PREFIX):  # an abstract Unix socket: "\0" + its name
                addresses.append((target, socket.AF_UNIX, "\0" + local_endpoints.socket_name(target.endpoint)))
            else:
                host, port = target.endpoint.removeprefix("tcp://").rsplit(":", 1)
                addresses.append((target, socket.AF_INET, (host, int(port))))
        count = 0
        while count % 64 or not (stop.is_set() or time.monotonic() - started > limit):
            if self.rate and count >= self.rate * (time.monotonic() - started):
                time.sleep(0.001)
                continue
            target, family, address = addresses[count % len(addresses)]
            count += 1
            with socket.socket(family) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _SO_LINGER_RESET)
                sock.settimeout(0.5)
                try:
                    sock.connect(address)
                    sock.send(self.rng.randbytes(64))
                except OSError:
                    self.report.failed_connections += 1
                    continue
            if target.server == "scheduler":
                self.report.sent_scheduler += 1
            else:
                self.report.sent_servers += 1

    def _messages(self, stop: Any, started: float, limit: float) -> None:
        poller = zmq.Poller()
        for sender in self.senders:
            poller.register(sender.sock, zmq.POLLOUT)
        rotate = self.mode == CURVE_OFF
        check_at = 0.0
        while True:
            now = time.monotonic()
            if now >= check_at:  # every few milliseconds: is_set() takes a lock
                if stop.is_set() or now - started > limit:
                    return
                check_at = now + 0.005
            sent_now = 0
            if self.rate and self.report.sent_servers + self.report.sent_scheduler >= self.rate * (now - started):
                time.sleep(0.001)  # paced: ahead of the rate asked for
                continue
            for i, sender in enumerate(self.senders):
                for _ in range(64 if not self.rate else 1):
                    frames: Sequence[Any] = sender.frames[sender.index % len(sender.frames)]
                    if sender.sealer is not None and len(frames) <= MAX_FRAMES:
                        frames = sender.sealer.seal(frames)
                    try:
                        sender.sock.send_multipart(frames, zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    sender.index += 1
                    sender.sent += 1
                    sent_now += 1
                    if sender.target.server == "scheduler":
                        self.report.sent_scheduler += 1
                    else:
                        self.report.sent_servers += 1
                    if rotate and sender.sent >= self.rotate:
                        break
                if rotate and sender.sent >= self.rotate:  # a new identity before this one is banned
                    poller.unregister(sender.sock)
                    sender.sock.close(linger=0)
                    self.senders[i] = self._remake(sender.target, i)
                    poller.register(self.senders[i].sock, zmq.POLLOUT)
            if not sent_now:  # every queue is full: wait for room rather than spin
                self.report.full_waits += 1
                poller.poll(5)

    def close(self) -> None:
        for sender in self.senders:
            sender.sock.close(linger=0)
        self.ctx.term()


def _spin(stop: Any, limit: float) -> FloodReport:
    report = FloodReport(SPIN)
    started = time.monotonic()
    while not stop.is_set() and time.monotonic() - started < limit:
        for _ in range(100_000):
            pass
    report.seconds = time.monotonic() - started
    return report


def flooder_main(mode: str, targets: list[Target], secret: bytes, workers: int, servers: int, sockets: int,
                 rotate: int, limit: float, ready: Any, stop: Any, stopped: Any, rate: float = 0.0) -> dict[str, Any]:
    """The flooding process: set up, say ready, flood until `stop`, close every socket, set `stopped`
    (worker 0 leaves the job only then: a server that exits under a flood drops connections while
    the flooder sends); its report."""
    try:
        if mode == SPIN:
            ready.put("ready")
            return _spin(stop, limit).as_dict()
        keys = JobKeys(secret, member_names(workers, servers)) if mode in (STRANGERS, MEMBER) else None
        flood = Flood(mode, targets, keys, sockets, rotate, rate)
        try:
            ready.put("ready")
            return flood.run(stop, limit).as_dict()
        finally:
            flood.close()
    finally:
        stopped.set()


def targets_for(servers: list[tuple[int, str, list[str]]], scheduler: str) -> list[Target]:
    """Every server channel and the scheduler. In member mode server r is told it talks to server r+1
    and the scheduler to itself: names no real member uses on those connections."""
    out = []
    for rank, name, endpoints in servers:
        claim = node_name("server", (rank + 1) % len(servers))
        network, local = local_endpoints.split(endpoints)
        out += [Target(endpoint, name, claim, channel) for group in (network, local)
                for channel, endpoint in enumerate(group)]
    out.append(Target(scheduler, "scheduler", "scheduler"))
    return out
