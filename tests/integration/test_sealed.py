"""Sealed TCP data connections (transport/zmq_seal.py) with real sockets: what the link shows, what an altered or a
replayed byte stream gets. A relay between two transports on 127.0.0.1 records (and may alter) every byte the
dialler sends and the listener answers; the same runs with CURVE and with no security at all are the controls."""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from sluice.transport.auth import JobKeys
from sluice.transport.config import TransportConfig
from sluice.transport.wire import Message
from sluice.transport.zmq_transport import ZmqTransport
from tests.integration.transport_helpers import CLIENT, SERVER, Inbox, message, warm_up

KEYS = JobKeys(b"a test secret of 32 bytes, fixed", [SERVER, CLIENT])
#: what each payload is made of: it must never cross the link in clear where the link is protected
MARKER = b"plaintext of a tensor, marked: SLUICE-SEALED-TEST "
CHUNK = 256 << 10
RELAYED = 1  # the channel whose connection goes through the relay


class Relay(threading.Thread):
    """Listens on 127.0.0.1; forwards one connection at a time to `target` (a dialler that comes back is taken
    again), recording both directions, and flips the dialler's byte at offset `flip` (if any) on its way."""

    def __init__(self, target: str, flip: int | None = None) -> None:
        super().__init__(daemon=True)
        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        self.target, self.flip = (host, int(port)), flip
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.sent, self.answered = bytearray(), bytearray()
        #: the conversation as it went: (True: the dialler's, False: the listener's, bytes) in order
        self.turns: list[tuple[bool, bytes]] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        self.listener.settimeout(0.1)
        while not self.stopped.is_set():
            with contextlib.suppress(OSError):
                client, _ = self.listener.accept()
                self._forward(client)

    def _forward(self, client: socket.socket) -> None:
        with contextlib.suppress(OSError), client, socket.create_connection(self.target) as server:
            selector = selectors.DefaultSelector()
            selector.register(client, selectors.EVENT_READ, (server, self.sent))
            selector.register(server, selectors.EVENT_READ, (client, self.answered))
            while not self.stopped.is_set():
                for key, _ in selector.select(0.1):
                    other, record = key.data
                    data = bytearray(key.fileobj.recv(1 << 16))  # type: ignore[union-attr]
                    if not data:
                        return
                    at = len(record)
                    if record is self.sent and self.flip is not None and at <= self.flip < at + len(data):
                        data[self.flip - at] ^= 0x01
                    record += data
                    self.turns.append((record is self.sent, bytes(data)))
                    other.sendall(data)

    def replay(self, target: str, within: float = 5.0) -> None:
        """Play the dialler's side of the recorded conversation to `target`, each turn once the listener's
        before it has come (a handshake answered too early is a protocol error), as one who recorded it would."""
        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        answered = True  # past the handshake the listener's answers (acknowledgements) stop: the replay is refused
        with socket.create_connection((host, int(port)), timeout=within) as replay:
            for dialler, data in self.turns:
                if dialler:
                    replay.sendall(data)
                    continue
                left = len(data)
                while answered and left > 0:
                    try:
                        left -= len(replay.recv(left)) or left
                    except TimeoutError:
                        answered = False
                replay.settimeout(0.5)
            time.sleep(0.5)  # what it sent last is read before the connection goes

    def stop(self) -> None:
        self.stopped.set()
        self.listener.close()
        self.join(5)


@pytest.fixture
def made() -> Iterator[Callable[..., ZmqTransport]]:
    transports: list[ZmqTransport] = []

    def make(name: str, config: TransportConfig, handler: Callable[[str, int, Message], None]) -> ZmqTransport:
        transport = ZmqTransport(name, config, handler, KEYS if config.curve else None)
        transports.append(transport)
        return transport

    yield make
    for transport in transports:
        transport.close(flush_seconds=0.2, linger_seconds=0)


def _config(security: str) -> TransportConfig:
    return TransportConfig(shm=False, chunk_bytes=1 << 20, inflight_bytes=4 << 20,
                           curve=security != "none", cipher="curve" if security == "curve" else "aes-gcm")


def _payload(index: int) -> np.ndarray:
    data = (MARKER * (CHUNK // len(MARKER) + 1))[:CHUNK]
    return np.frombuffer(bytes([index]) + data[1:], np.uint8).copy()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("security", ["aes-gcm", "curve", "none"])
def test_the_link_shows_no_payload_and_an_altered_message_is_refused(made: Callable[..., ZmqTransport],
                                                                     security: str) -> None:
    inbox, back = Inbox(), Inbox()
    server = made(SERVER, _config(security), inbox)
    network = [e for e in server.listen() if e.startswith("tcp://")]
    # the fifth 256 KiB message's bytes: past the handshake, the HELLO and the four before it
    relay = Relay(network[RELAYED], flip=4 * CHUNK + CHUNK // 2)
    relay.start()
    client = made(CLIENT, _config(security), back)
    client.connect(SERVER, [*network[:RELAYED], relay.endpoint, *network[RELAYED + 1:]])
    try:
        warm_up(client, SERVER, inbox, 3)
        before = len(inbox.snapshot())
        for index in range(8):
            client.send(SERVER, RELAYED, message(index, payload=_payload(index)))
        for index in range(3):
            server.send(CLIENT, RELAYED, message(100 + index, payload=_payload(100 + index)))
        back.wait_for(3)
        deadline = time.monotonic() + 10
        while len(inbox.snapshot()) < before + 7 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)  # a ninth (there is none) would have come by now
        got = {r.key: r.data for r in inbox.snapshot()[before:]}
    finally:
        relay.stop()
    wire = bytes(relay.sent) + bytes(relay.answered)
    assert len(relay.sent) > 8 * CHUNK and len(relay.answered) > 3 * CHUNK
    stats = server.stats()
    if security == "none":  # the control: the check can fail, and an altered byte goes unnoticed
        assert MARKER in bytes(relay.sent) and MARKER in bytes(relay.answered)
        assert sorted(got) == list(range(8)) and got[4] != _payload(4).tobytes()
        return
    assert [r.data for r in back.snapshot()] == [_payload(100 + i).tobytes() for i in range(3)]
    assert MARKER not in wire, "a payload crossed the link in clear"
    assert all(got[key] == _payload(key).tobytes() for key in got), "an altered payload was taken"
    if security == "curve":  # a bad MAC drops the connection: what was in flight on it is lost, the rest comes
        assert 4 not in got and stats["sealed_connections"] == 0
        return
    assert sorted(got) == [0, 1, 2, 3, 5, 6, 7], "the altered message was taken, or one after it was lost"
    if security == "aes-gcm":
        assert stats["rejected"] == 1 and stats["sealed_connections"] == 3  # one session per channel
        assert client.stats()["sealed_connections"] == 3


@pytest.mark.timeout(60)
def test_a_recorded_connection_replayed_from_the_same_address_gets_nothing_in(
        made: Callable[..., ZmqTransport]) -> None:
    """A stranger that recorded a whole sealed connection (its greeting, ticket and messages) plays it back to
    the listener after the member left, from the member's own address (the ticket checks out): every message is
    older than what the listener opened on that session, so each is refused, and the listener serves on."""
    inbox = Inbox()
    server = made(SERVER, _config("aes-gcm"), inbox)
    network = [e for e in server.listen() if e.startswith("tcp://")]
    relay = Relay(network[RELAYED])
    relay.start()
    client = made(CLIENT, _config("aes-gcm"), Inbox())
    client.connect(SERVER, [*network[:RELAYED], relay.endpoint, *network[RELAYED + 1:]])
    warm_up(client, SERVER, inbox, 3)
    for index in range(3):
        client.send(SERVER, RELAYED, message(index, payload=_payload(index)))
    inbox.wait_for(6)
    client.close(flush_seconds=0.5, linger_seconds=0)
    relay.stop()
    rejected = server.stats()["rejected"]
    relay.replay(network[RELAYED])
    deadline = time.monotonic() + 5
    while server.stats()["rejected"] < rejected + 5 and time.monotonic() < deadline:  # HELLO, warm-up, 3 pushes
        time.sleep(0.05)
    assert server.stats()["rejected"] == rejected + 5, "the replayed messages were not each refused"
    assert len(inbox.snapshot()) == 6, "a replayed message reached the handler"
    newcomer = made(CLIENT, _config("aes-gcm"), Inbox())  # the member's name, in a new process: heard
    newcomer.connect(SERVER, network)
    warm_up(newcomer, SERVER, inbox, 3, key=1 << 20)
