"""Peers on one host talk over the listeners' Unix sockets: a ticket proves the name, strangers stay out."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import zmq

from sluice.transport import local_endpoints
from sluice.transport.auth import JobKeys
from sluice.transport.config import TransportConfig
from sluice.transport.wire import Message, encode
from sluice.transport.zmq_transport import ZmqTransport
from tests.integration.transport_helpers import CLIENT, SERVER, Inbox, message, warm_up

pytestmark = pytest.mark.skipif(not local_endpoints.AVAILABLE, reason="local endpoints need Linux")

MEMBERS = [SERVER, CLIENT, "worker-9"]
KEYS = JobKeys(b"a test secret of 32 bytes, fixed", MEMBERS)
CONFIG = TransportConfig(channels=2, inflight_bytes=1 << 20, chunk_bytes=1 << 16, shm=False)


@pytest.fixture
def pair() -> Iterator[tuple[ZmqTransport, ZmqTransport, Inbox, list[str]]]:
    """A listening server and a client connected to it (CURVE on), the server's inbox and its endpoints."""
    inbox = Inbox()
    server = ZmqTransport(SERVER, CONFIG, inbox, KEYS, members=MEMBERS)
    client = ZmqTransport(CLIENT, CONFIG, Inbox(), KEYS, members=MEMBERS)
    endpoints = server.listen()
    client.connect(SERVER, endpoints)
    warm_up(client, SERVER, inbox, 2)
    yield server, client, inbox, endpoints
    client.close(flush_seconds=0.2)
    server.close(flush_seconds=0.2)


@pytest.fixture
def raw(raw_sockets: Callable[[int], zmq.Socket[bytes]]) -> Callable[[str], zmq.Socket[bytes]]:
    """Raw DEALERs under a chosen identity (conftest's raw_sockets closes them)."""
    def make(identity: str) -> zmq.Socket[bytes]:
        sock = raw_sockets(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, identity.encode())
        return sock

    return make


def _ticket(keys: JobKeys, name: str, endpoint: str) -> bytes:
    return keys.local_ticket(name, local_endpoints.domain_of(endpoint).encode())


@pytest.mark.timeout(30)
def test_a_peer_on_this_host_dials_the_unix_socket_and_its_ticket_binds_its_name(
        pair: tuple[ZmqTransport, ZmqTransport, Inbox, list[str]], raw: Callable[[str], zmq.Socket[bytes]]) -> None:
    server, client, inbox, endpoints = pair
    assert client.stats()["local_peers"] == [SERVER]
    data = np.arange(50_000, dtype=np.uint8)
    client.send(SERVER, 1, message(7, payload=data))
    got = inbox.wait_for(3)[-1]
    assert (got.peer, got.channel, got.key, got.data) == (CLIENT, 1, 7, data.tobytes())
    # a member (it holds the secret) dialling with its own ticket but another member's name: refused per message
    _, local = local_endpoints.split(endpoints)
    sock = raw(CLIENT)
    sock.setsockopt(zmq.PLAIN_USERNAME, b"worker-9")
    sock.setsockopt(zmq.PLAIN_PASSWORD, _ticket(KEYS, "worker-9", local[0]))
    sock.connect(local[0])
    sock.send_multipart(encode(message(8)))
    deadline = time.monotonic() + 5
    while server.stats()["rejected"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.stats()["rejected"] == 1 and len(inbox.snapshot()) == 3


@pytest.mark.timeout(30)
def test_strangers_at_the_unix_socket_are_refused_at_the_door(
        pair: tuple[ZmqTransport, ZmqTransport, Inbox, list[str]], raw: Callable[[str], zmq.Socket[bytes]]) -> None:
    server, _client, inbox, endpoints = pair
    _, local = local_endpoints.split(endpoints)
    other_job = JobKeys(b"another secret, of another job!!", MEMBERS)
    credentials: list[tuple[bytes, bytes] | str | None] = [
        None,  # ZeroMQ's NULL mechanism: no name at all
        "curve",  # a CURVE client that knows the server's public key
        (CLIENT.encode(), _ticket(other_job, CLIENT, local[0])),  # a ticket made with another job's secret
        (CLIENT.encode(), _ticket(KEYS, CLIENT, local[1])),  # a real ticket, for the other channel's socket
        (CLIENT.encode(), b"0" * 64),  # a guess
        (b"stranger", _ticket(KEYS, "stranger", local[0])),  # no member of this job
    ]
    strangers = []
    for shown in credentials:
        sock = raw(CLIENT)
        sock.setsockopt(zmq.RECONNECT_IVL, -1)  # one try each: each refusal is counted once
        if shown == "curve":
            sock.setsockopt(zmq.CURVE_SERVERKEY, KEYS.public_key(SERVER))
            public, secret = zmq.curve_keypair()
            sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
        elif isinstance(shown, tuple):
            sock.setsockopt(zmq.PLAIN_USERNAME, shown[0])
            sock.setsockopt(zmq.PLAIN_PASSWORD, shown[1])
        sock.connect(local[0])
        with contextlib.suppress(zmq.Again):  # refused before its message could be queued: the same outcome
            sock.send_multipart(encode(message(9, payload=np.ones(8, np.uint8))), zmq.NOBLOCK)
        strangers.append(sock)
    deadline = time.monotonic() + 5
    while server.stats()["refused_connections"] < len(credentials) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    stats = server.stats()
    assert stats["refused_connections"] == len(credentials)
    assert len(inbox.snapshot()) == 2  # the warm-up's: nothing of the strangers' got in
    assert all(not sock.poll(0) for sock in strangers)


def test_zap_takes_a_ticket_only_from_a_process_of_our_own_user() -> None:
    domain = local_endpoints.domain_of("ipc://@sluice-" + "ab" * 16 + "-ch0").encode()
    ticket = KEYS.local_ticket(CLIENT, domain)

    def request(uid: int, mechanism: bytes = b"PLAIN", zap_domain: bytes = domain) -> list[bytes]:
        address = f"localhost:{uid}:{uid}:4242".encode()
        return [b"1.0", b"7", zap_domain, address, b"", mechanism, CLIENT.encode(), ticket]

    assert KEYS.zap_reply(request(os.getuid()))[2:5] == [b"200", b"OK", CLIENT.encode()]
    assert KEYS.zap_reply(request(os.getuid() + 1))[2] == b"400"  # the ticket, shown by another user's process
    assert KEYS.zap_reply(request(os.getuid(), zap_domain=b"sluice"))[2] == b"400"  # PLAIN on a network listener
    assert KEYS.zap_reply(request(os.getuid(), mechanism=b"CURVE"))[2] == b"400"  # CURVE on a local one
    no_uid = [b"1.0", b"7", domain, b"", b"", b"PLAIN", CLIENT.encode(), ticket]
    assert KEYS.zap_reply(no_uid)[2] == b"400"  # where the kernel did not say who connected


def test_a_peer_whose_unix_sockets_are_not_here_is_dialled_on_the_network() -> None:
    elsewhere = ["tcp://127.0.0.1:5000", "tcp://127.0.0.1:5001", "ipc://@sluice-" + "0" * 32 + "-ch0",
                 "ipc://@sluice-" + "0" * 32 + "-ch1"]
    assert local_endpoints.choose(elsewhere, 2, "127.0.0.1") == (elsewhere[:2], False)
    assert local_endpoints.choose(["tcp://10.1.2.3:5000", "tcp://10.1.2.3:5001"], 2, "10.9.9.9") == (
        ["tcp://10.1.2.3:5000", "tcp://10.1.2.3:5001"], False)
    with pytest.raises(ValueError, match="not here"):
        local_endpoints.choose(elsewhere[2:], 2, "127.0.0.1")
    received: list[Message] = []
    listener = ZmqTransport(SERVER, CONFIG, lambda peer, channel, msg: received.append(msg), KEYS, members=MEMBERS)
    try:
        endpoints = listener.listen()
        assert local_endpoints.choose(endpoints, 2, "127.0.0.1") == (endpoints[2:], True)
    finally:
        listener.close(flush_seconds=0.1)
    assert not received


@pytest.mark.timeout(30)
def test_what_a_peer_sends_as_it_exits_arrives_and_its_socket_name_taken_later_hears_nothing(
        raw: Callable[[str], zmq.Socket[bytes]]) -> None:
    inbox, server_inbox = Inbox(), Inbox()
    server = ZmqTransport(SERVER, CONFIG, server_inbox, KEYS, members=MEMBERS)
    client = ZmqTransport(CLIENT, CONFIG, inbox, KEYS, members=MEMBERS)
    try:
        endpoints = server.listen()
        client.connect(SERVER, endpoints)
        warm_up(client, SERVER, server_inbox, 2)
        for key in range(20):  # the replies of a peer that then exits at once (a worker at the end of a job)
            server.send(CLIENT, 0, message(key, payload=np.full(64, key, np.uint8)))
        server.close(flush_seconds=2.0)
        got = inbox.wait_for(20, timeout=10)
        assert [r.key for r in got] == list(range(20))
        # another process binds the name that went away: the dialler does not come back to it
        _, local = local_endpoints.split(endpoints)
        squatter = raw("squatter")
        squatter.bind(local[0])
        client.send(SERVER, 0, message(99, payload=np.ones(8, np.uint8)))
        assert not squatter.poll(1500)
    finally:
        client.close(flush_seconds=0.1)
        server.close(flush_seconds=0.1)
