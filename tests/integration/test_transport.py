"""Two real ZmqTransports in one process: ordering, priority under a credit bound, garbage, close."""

from __future__ import annotations

import contextlib
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from sluice.transport import local_endpoints
from sluice.transport.auth import JobKeys
from sluice.transport.config import TransportConfig
from sluice.transport.shm import SHM_MIN_BYTES, Segment
from sluice.transport.wire import Flag, Kind, Message, encode
from sluice.transport.zmq_transport import ZmqTransport
from tests.integration.transport_helpers import CLIENT, SERVER, Inbox, message, warm_up

#: the tests' "job": raw ZeroMQ sockets hold no key of it, so tests that use them turn CURVE off
KEYS = JobKeys(b"a test secret of 32 bytes, fixed", [SERVER, CLIENT])


@pytest.fixture
def transports() -> Iterator[Callable[..., ZmqTransport]]:
    """Makes ZmqTransports and closes every one of them, whatever the test's outcome."""
    made: list[ZmqTransport] = []

    def make(name: str, config: TransportConfig, handler: Callable[[str, int, Message], None],
             members: tuple[str, ...] = ()) -> ZmqTransport:
        transport = ZmqTransport(name, config, handler, KEYS if config.curve else None, members=members)
        made.append(transport)
        return transport

    yield make
    # the last made first (a client before its server): what it still sends (acknowledgements) reaches a
    # listener that is still there, instead of holding its sockets for their linger (2 s) at close
    for transport in reversed(made):
        transport.close(flush_seconds=0.2)




# ------------------------------------------------------------------------------------------ (a) ordering
SIZES = [0, 1, 4096, 65536 + 3, 1 << 20, 17]


def io_thread_names() -> set[str]:
    """The names of this process's ZeroMQ I/O threads (libzmq names them ZMQbg/IO/<n>); a thread that ends
    meanwhile (another test's transport closing) is skipped."""
    names = set()
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            names.add((task / "comm").read_text().strip())
    return {name for name in names if name.startswith("ZMQbg/IO/")}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("shm", "io_threads"), [(False, 1), (True, 1), (False, 3)],
                         ids=["sockets", "shm", "sockets-3-io-threads"])
@pytest.mark.parametrize("protocol", ["tcp", "local", "ipc"])
@pytest.mark.parametrize("direction", ["dealer-to-router", "router-to-dealer"])
def test_messages_arrive_intact_and_fifo_per_channel(
    transports: Callable[..., ZmqTransport], protocol: str, direction: str, shm: bool, io_threads: int
) -> None:
    """tcp: the client dials the TCP ports (as a peer on another host would); local: it is given every endpoint
    and dials the Unix sockets; ipc: the server listens on those alone (transport.protocol = ipc)."""
    # CURVE on (the default): with 3 I/O threads, channel 0 is encrypted and decrypted on a thread of its own
    config = TransportConfig(channels=3, inflight_bytes=1 << 20, chunk_bytes=1 << 16, shm=shm, io_threads=io_threads,
                             protocol="ipc" if protocol == "ipc" else "tcp")
    server_inbox, client_inbox = Inbox(), Inbox()
    server = transports(SERVER, config, server_inbox)
    client = transports(CLIENT, config, client_inbox)
    wanted, deadline = {f"ZMQbg/IO/{n}" for n in range(io_threads)}, time.monotonic() + 5.0
    while not wanted <= io_thread_names() and time.monotonic() < deadline:  # each thread names itself as it starts
        time.sleep(0.01)
    assert wanted <= io_thread_names()
    endpoints = server.listen()
    network, local = local_endpoints.split(endpoints)
    assert len(local) == 3 and len(set(endpoints)) == len(endpoints)
    assert len(network) == (0 if protocol == "ipc" else 3)
    assert all(e.startswith("tcp://127.0.0.1:") and not e.endswith(":0") for e in network)
    client.connect(SERVER, network if protocol == "tcp" else endpoints)
    assert client.stats()["local_peers"] == ([] if protocol == "tcp" else [SERVER])
    warm_up(client, SERVER, server_inbox, 3)
    sender, receiver, to, inbox = client, server, SERVER, server_inbox
    if direction == "router-to-dealer":
        sender, receiver, to, inbox = server, client, CLIENT, client_inbox

    already = len(inbox.snapshot())
    rng = np.random.default_rng(7)
    sent: dict[int, list[tuple[int, bytes | None]]] = {0: [], 1: [], 2: []}
    keep: list[np.ndarray] = []  # payloads travel zero-copy: keep them alive and unchanged
    count = 240
    for key in range(count):
        channel = key % 3
        size = SIZES[(key // 3) % len(SIZES)]
        if size == 0:
            sender.send(to, channel, message(key))
            sent[channel].append((key, None))
        else:
            data = rng.integers(0, 256, size, dtype=np.uint8)
            keep.append(data)
            sender.send(to, channel, message(key, payload=data))
            sent[channel].append((key, data.tobytes()))
    got = inbox.wait_for(already + count, timeout=40)[already:]
    assert len(got) == count
    for channel in range(3):
        arrived = [(r.key, r.data) for r in got if r.channel == channel]
        assert [k for k, _ in arrived] == [k for k, _ in sent[channel]], f"channel {channel} out of order"
        assert arrived == sent[channel], f"channel {channel}: a payload changed on the way"
    peer = CLIENT if direction == "dealer-to-router" else SERVER
    assert {r.peer for r in got} == {peer}
    assert all(r.kind == Kind.PUSH for r in got)
    # large payloads go through shared memory exactly when it is enabled, once the receiver has mapped the
    # channel's ring (announced with the first large one, which travels inline, as the next few may)
    for channel in range(3):
        large = [r for r in got if r.channel == channel and r.data is not None and len(r.data) >= SHM_MIN_BYTES]
        through_shm = [bool(r.flags & Flag.SHM) for r in large]
        assert not any(through_shm[:1]), "a segment was used before its receiver mapped it"
        if shm:
            assert through_shm[len(through_shm) // 2 :] == [True] * (len(through_shm) - len(through_shm) // 2)
            assert through_shm == sorted(through_shm), "once mapped, the ring is always used"
        else:
            assert not any(through_shm)
        assert not any(r.flags & Flag.SHM for r in got if r.channel == channel and r not in large)
    payload_bytes = sum(len(d) for ch in sent.values() for _, d in ch if d is not None)
    deadline = time.monotonic() + 10
    while sum(sender.stats()["sent_bytes"]) < payload_bytes and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sum(sender.stats()["sent_bytes"]) == payload_bytes
    assert sum(receiver.stats()["received_bytes"]) == payload_bytes


# ------------------------------------------------------------------------------------------ (b) priority
@pytest.mark.timeout(60)
@pytest.mark.parametrize("shm", [False, True], ids=["sockets", "shm"])
@pytest.mark.parametrize(("bound", "chunk"), [(256 * 1024, 64 * 1024), (200 * 1024, 64 * 1024), (64 * 1024, 64 * 1024)])
def test_urgent_chunk_overtakes_the_backlog_on_the_same_channel(
    transports: Callable[..., ZmqTransport], bound: int, chunk: int, shm: bool
) -> None:
    """The requirement: a high-priority chunk queued behind many low-priority chunks on one channel
    is sent after at most the in-flight bound. The receiver is slow, so the backlog builds up at the
    sender. The urgent chunk is sent once the first low chunk has arrived, and that first one is held
    by the receiver until then, so no credit comes back in between (no dependence on scheduling)."""
    channel, lows = 1, 50
    gate = threading.Event()
    first_low_seen = threading.Event()

    def slow(peer: str, ch: int, msg: Message) -> None:
        if ch != channel or msg.key >= 1 << 30:
            return
        if msg.priority == 9 and not first_low_seen.is_set():
            first_low_seen.set()
            assert gate.wait(10), "the test did not release the receiver"
        time.sleep(0.003)

    inbox = Inbox(delay=slow)
    config = TransportConfig(channels=2, inflight_bytes=bound, chunk_bytes=chunk, shm=shm)
    server = transports(SERVER, config, inbox)
    client = transports(CLIENT, config, Inbox())
    client.connect(SERVER, server.listen())
    warm_up(client, SERVER, inbox, 2)
    start = len(inbox.snapshot())

    payloads = [np.full(chunk, i % 251, np.uint8) for i in range(lows + 1)]
    for i in range(lows):
        client.send(SERVER, channel, message(i, 9, payloads[i]))
    assert first_low_seen.wait(10), "no low-priority chunk arrived"
    # now the sender has a backlog: some lows in flight (unacknowledged), the rest in its queue
    client.send(SERVER, channel, message(1000, 0, payloads[lows]))
    gate.set()

    got = inbox.wait_for(start + lows + 1, timeout=40)[start:]
    keys = [r.key for r in got]
    assert sorted(keys) == [*range(lows), 1000]
    ahead = keys.index(1000)
    limit = math.ceil(bound / chunk) + 1
    assert ahead <= limit, f"the urgent chunk arrived after {ahead} low-priority chunks (limit {limit})"
    assert ahead >= 1, "the first low chunk had arrived before the urgent one was sent"
    assert [k for k in keys if k != 1000] == list(range(lows)), "low-priority chunks must stay FIFO"
    assert got[ahead].data == payloads[lows].tobytes()


# ------------------------------------------------------------------------------------------ (c) garbage
def _header(**fields: object) -> bytes:
    values: dict[str, object] = {
        "version": 1, "kind": int(Kind.PUSH), "sender": 1, "key": 5, "chunk": 0, "round": 1,
        "priority": 0, "dtype": "float32", "shape": [4], "nbytes": 16, "flags": 0, "meta": None,
    }
    values.update(fields)
    return bytes(msgpack.packb(list(values.values())))


def garbage(rng: random.Random, segment: str) -> list[list[bytes]]:
    """Malformed messages; `segment` names a real shared-memory segment of 4096 bytes."""
    valid = _header()
    shm = int(Flag.SHM)
    return [
        [_header(flags=shm), b"\xc1"],
        [_header(flags=shm), bytes(msgpack.packb(["../../../etc/passwd", 0]))],
        [_header(flags=shm), bytes(msgpack.packb(["sluice-1-0-00000000", 0]))],
        [_header(flags=shm), bytes(msgpack.packb([segment, 4090]))],
        [_header(flags=shm), bytes(msgpack.packb([segment, 1 << 61]))],
        [_header(flags=shm), bytes(msgpack.packb([segment, -16]))],
        [_header(version=2), bytes(16)],
        [valid[: len(valid) // 2], bytes(16)],
        [valid[:1]],
        [rng.randbytes(40)],
        [rng.randbytes(7), rng.randbytes(300)],
        [rng.randbytes(1 << 20)],
        [b""],
        [b"", b""],
        [_header(nbytes=20), bytes(16)],
        [_header(), bytes(17)],
        [_header(dtype="complex64"), bytes(16)],
        [_header(nbytes=1 << 40, shape=[1 << 38]), bytes(16)],
        [_header(), bytes(16), bytes(16)],
        [_header(dtype="", shape=[], nbytes=0), bytes(16)],
        [_header()],
        [_header(kind=99), bytes(16)],
        [_header(key=-1), bytes(16)],
        [_header(meta=[1]), bytes(16)],
        [_header(meta={"x": 1})[:-3]],
        [b"\xdd\xff\xff\xff\xff"],
    ]


@pytest.mark.timeout(60)
def test_garbage_from_a_raw_dealer_does_not_break_a_listener(
    transports: Callable[..., ZmqTransport],
    raw_sockets: Callable[[int], zmq.Socket[bytes]],
    caplog: pytest.LogCaptureFixture,
    request: pytest.FixtureRequest,
) -> None:
    caplog.set_level(logging.WARNING, logger="sluice.transport")
    config = TransportConfig(channels=2, inflight_bytes=1 << 20, chunk_bytes=1 << 16, curve=False)
    server_inbox, client_inbox = Inbox(), Inbox()
    server = transports(SERVER, config, server_inbox)
    client = transports(CLIENT, config, client_inbox)
    endpoints = server.listen()
    client.connect(SERVER, endpoints)
    warm_up(client, SERVER, server_inbox, 2)

    attackers = []
    for index, endpoint in enumerate(endpoints):
        sock = raw_sockets(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"attacker-{index}".encode())
        sock.connect(endpoint)
        attackers.append(sock)
    rng = random.Random(3)
    rounds = 3  # 78 malformed messages from each: below the ban (test_a_stranger_sending_only_garbage_is_cut_off)
    segment = Segment(4096)
    request.addfinalizer(segment.unlink)
    bad = garbage(rng, segment.name)
    keep = [np.arange(4, dtype=np.uint8) + i for i in range(rounds * 2)]
    for r in range(rounds):
        for sock in attackers:
            for frames in bad:
                sock.send_multipart(frames)
        # a proper peer keeps talking in between
        client.send(SERVER, 0, message(100 + r, payload=keep[2 * r]))
        client.send(SERVER, 1, message(200 + r, payload=keep[2 * r + 1]))
    # a well-formed message from each raw socket, after all its garbage on the same connection
    for index, sock in enumerate(attackers):
        sock.send_multipart(encode(message(900 + index)))
    expected = 2 + 2 * rounds + len(attackers)
    got = server_inbox.wait_for(expected, timeout=30)
    assert len(got) == expected
    from_client = [(r.channel, r.key) for r in got if r.peer == CLIENT]
    assert [k for c, k in from_client if c == 0] == [1 << 30, *range(100, 100 + rounds)]
    assert [k for c, k in from_client if c == 1] == [(1 << 30) + 1, *range(200, 200 + rounds)]
    # one raw socket on each TCP port and each local Unix socket
    assert sorted((r.peer, r.key) for r in got if r.peer != CLIENT) == [(f"attacker-{i}", 900 + i) for i in range(4)]

    # every one counted; each kind of reason logged, but not one line per message
    assert server.stats()["rejected"] == rounds * len(attackers) * len(bad)
    dropped = [rec for rec in caplog.records if "dropped a message" in rec.getMessage()]
    assert len(dropped) < len(bad)
    assert {rec.levelno for rec in dropped} == {logging.WARNING}
    text = "\n".join(rec.getMessage() for rec in dropped)
    for reason in [
        "version", "not valid msgpack", "declares", "dtype", "'nbytes'", "frames", "message kind",
        "descriptor is not valid msgpack", "was not announced by 'attacker-", "'offset'",
    ]:
        assert reason in text, reason

    # the listener still answers its proper peer (ROUTER -> DEALER), on both channels
    client_start = len(client_inbox.snapshot())
    for channel in range(2):
        server.send(CLIENT, channel, message(300 + channel, payload=np.ones(8, np.uint8)))
    back = client_inbox.wait_for(client_start + 2)[client_start:]
    assert sorted((r.channel, r.key, r.data) for r in back) == [(0, 300, bytes([1] * 8)), (1, 301, bytes([1] * 8))]


# ------------------------------------------------------------------------------------------ (d) close
@pytest.mark.timeout(30)
def test_close_is_prompt_and_late_sends_do_not_raise(transports: Callable[..., ZmqTransport]) -> None:
    config = TransportConfig(channels=2, inflight_bytes=1 << 20, chunk_bytes=1 << 16)
    inbox = Inbox()
    server = transports(SERVER, config, inbox)
    client = transports(CLIENT, config, Inbox())
    client.connect(SERVER, server.listen())
    warm_up(client, SERVER, inbox, 2)
    for transport in (client, server):
        start = time.monotonic()
        transport.close()
        assert time.monotonic() - start < 5.0
        transport.send(SERVER, 0, message(1, payload=np.zeros(4, np.uint8)))
        transport.send(CLIENT, 1, message(2))
        transport.send("nobody", 0, message(3))
        start = time.monotonic()
        transport.close()  # a second close is harmless
        assert time.monotonic() - start < 5.0


@pytest.mark.timeout(30)
def test_close_with_a_backlog_that_cannot_drain_is_prompt(
    transports: Callable[..., ZmqTransport], raw_sockets: Callable[[int], zmq.Socket[bytes]]
) -> None:
    """A peer that takes messages but never acknowledges them: the credit runs out, the backlog stays
    in the queue, and close gives up after its flush time."""
    silent = raw_sockets(zmq.ROUTER)
    silent.bind("tcp://127.0.0.1:0")
    endpoint = silent.getsockopt_string(zmq.LAST_ENDPOINT)
    client = transports(CLIENT, TransportConfig(channels=1, inflight_bytes=64 * 1024, chunk_bytes=1 << 16, curve=False),
                        Inbox())
    client.connect("silent", [endpoint])
    data = np.zeros(64 * 1024, np.uint8)
    for key in range(20):
        client.send("silent", 0, message(key, payload=data))
    frames = silent.recv_multipart()  # the first chunk arrives; no ack goes back
    assert frames[0] == CLIENT.encode()
    start = time.monotonic()
    client.close(flush_seconds=0.5)
    elapsed = time.monotonic() - start
    assert 0.3 < elapsed < 5.0
    client.send("silent", 0, message(99, payload=data))


@pytest.mark.timeout(30)
def test_withdraw_takes_back_only_what_has_not_begun_to_leave(
    transports: Callable[..., ZmqTransport], raw_sockets: Callable[[int], zmq.Socket[bytes]]
) -> None:
    """A switch of the aggregation trees inside a round takes queued pushes back (worker/midround.py): behind a
    peer that never acknowledges, the first message left and the rest wait; those picked come back, in order."""
    silent = raw_sockets(zmq.ROUTER)
    silent.bind("tcp://127.0.0.1:0")
    client = transports(CLIENT, TransportConfig(channels=1, inflight_bytes=64 * 1024, chunk_bytes=1 << 16, curve=False),
                        Inbox())
    client.connect("silent", [silent.getsockopt_string(zmq.LAST_ENDPOINT)])
    data = np.zeros(64 * 1024, np.uint8)
    sent = [message(key, payload=data) for key in range(20)]
    for msg in sent:
        client.send("silent", 0, msg)
    while silent.poll(5000) and msgpack.unpackb(silent.recv_multipart()[1])[1] != Kind.PUSH:
        pass  # what the transport says first, then the first push: the credit is spent, no acknowledgement comes
    even = client.withdraw(lambda peer, channel, msg: msg.key % 2 == 0)
    assert [(peer, channel, msg.key) for peer, channel, msg in even] == [("silent", 0, k) for k in range(2, 20, 2)]
    assert all(msg is sent[msg.key] for _, _, msg in even)  # the same messages, to send again or not
    rest = client.withdraw(lambda peer, channel, msg: True)
    assert [msg.key for _, _, msg in rest] == list(range(1, 20, 2))
    assert client.withdraw(lambda peer, channel, msg: True) == []
    while silent.poll(300):  # no other push left meanwhile (the transport's own messages may)
        assert msgpack.unpackb(silent.recv_multipart()[1])[1] != Kind.PUSH


@pytest.mark.timeout(30)
def test_close_with_an_unreachable_peer_is_prompt(
    transports: Callable[..., ZmqTransport], raw_sockets: Callable[[int], zmq.Socket[bytes]]
) -> None:
    gone = raw_sockets(zmq.ROUTER)
    gone.bind("tcp://127.0.0.1:0")
    endpoint = gone.getsockopt_string(zmq.LAST_ENDPOINT)
    gone.close(linger=0)  # nobody listens there any more
    client = transports(CLIENT, TransportConfig(channels=2, curve=False), Inbox())
    client.connect("gone", [endpoint, endpoint])
    for key in range(10):
        client.send("gone", key % 2, message(key, payload=np.zeros(1024, np.uint8)))
    start = time.monotonic()
    client.close()
    assert time.monotonic() - start < 5.0
    client.send("gone", 0, message(99))


# ------------------------------------------------------------------------------------------ (d) receiving hop
@pytest.mark.timeout(60)
def test_a_busy_receiver_handles_urgent_messages_before_its_backlog(
    transports: Callable[..., ZmqTransport], raw_sockets: Callable[[int], zmq.Socket[bytes]]
) -> None:
    """The receiving hop keeps priorities: while the handler is busy a backlog builds up in the
    socket; an urgent message that arrives behind it, on the same channel and from a plain FIFO
    sender (a raw DEALER, so no sender-side queue reorders anything), is handled first."""
    lows = 40
    busy, release = threading.Event(), threading.Event()

    def slow_blocker(peer: str, channel: int, msg: Message) -> None:
        if msg.key == 999:
            busy.set()
            assert release.wait(10), "the test did not release the receiver"

    inbox = Inbox(delay=slow_blocker)
    server = transports(SERVER, TransportConfig(channels=1, inflight_bytes=1 << 20, chunk_bytes=1 << 16, curve=False),
                        inbox)
    sender = raw_sockets(zmq.DEALER)
    sender.setsockopt(zmq.IDENTITY, b"fifo-sender")
    sender.connect(server.listen()[0])
    sender.send_multipart(encode(message(999, 5)))
    assert busy.wait(10), "the blocker did not arrive"
    for i in range(lows):
        sender.send_multipart(encode(message(i, 9)))
    sender.send_multipart(encode(message(1000, 0)))
    time.sleep(0.3)  # ZeroMQ's own thread takes the backlog and the urgent message in meanwhile
    release.set()
    keys = [r.key for r in inbox.wait_for(lows + 2)[1:]]
    assert keys[0] == 1000, f"the urgent message was handled after {keys.index(1000)} bulk messages"
    assert keys[1:] == list(range(lows)), "equal priorities stay FIFO"


# ------------------------------------------------------------------------------------------ (e) last resort
@pytest.mark.timeout(30)
def test_the_io_thread_survives_any_exception_and_says_so_once_per_kind(
    transports: Callable[..., ZmqTransport], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug anywhere a received message reaches (decoding, the handler) costs that message only: it
    is dropped, counted and logged with its traceback (once per kind of failure), and the thread serves on."""
    import sluice.transport.zmq_receive as zmq_receive

    caplog.set_level(logging.WARNING, logger="sluice.transport")
    real_decode = zmq_receive.decode

    def decode_with_a_bug(frames: Any, max_header: int) -> Message:
        msg = real_decode(frames, max_header)
        if msg.key == 666:
            raise RecursionError("a bug while decoding")
        return msg

    monkeypatch.setattr(zmq_receive, "decode", decode_with_a_bug)
    received: list[int] = []

    def handler(peer: str, channel: int, msg: Message) -> None:
        if msg.key == 777:
            raise KeyError("a bug in the handler")
        received.append(msg.key)

    config = TransportConfig(channels=1, inflight_bytes=1 << 20, chunk_bytes=1 << 16)
    server = transports(SERVER, config, handler)
    client = transports(CLIENT, config, Inbox())
    client.connect(SERVER, server.listen())
    for key in [1, 666, 2, 777, 3, 666, 777, 4]:
        client.send(SERVER, 0, message(key))
    deadline = time.monotonic() + 10
    while len(received) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert received == [1, 2, 3, 4]
    assert server.stats()["rejected"] == 4
    failures = [rec for rec in caplog.records if "could not be processed" in rec.getMessage()
                or "failed (KeyError)" in rec.getMessage()]
    assert len(failures) == 2, [rec.getMessage() for rec in failures]  # each kind once, with its traceback
    assert all(rec.exc_info is not None for rec in failures)
    assert "RecursionError" in failures[0].getMessage() and "KeyError" in failures[1].getMessage()


@pytest.mark.timeout(30)
def test_a_stranger_sending_only_garbage_is_cut_off(
    transports: Callable[..., ZmqTransport], raw_sockets: Callable[[int], zmq.Socket[bytes]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Without CURVE, a stranger whose messages are (almost) all refused is banned after 100: its
    later messages are dropped unread and its TCP connection is shut; a proper peer is unaffected."""
    caplog.set_level(logging.WARNING, logger="sluice.transport")
    config = TransportConfig(channels=1, inflight_bytes=1 << 20, chunk_bytes=1 << 16, curve=False)
    inbox = Inbox()
    server = transports(SERVER, config, inbox)
    client = transports(CLIENT, config, Inbox())
    endpoint = server.listen()[0]
    client.connect(SERVER, [endpoint])
    warm_up(client, SERVER, inbox, 1)
    stranger = raw_sockets(zmq.DEALER)
    stranger.setsockopt(zmq.IDENTITY, b"stranger")
    monitor = stranger.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    stranger.connect(endpoint)
    for _ in range(150):
        stranger.send_multipart([b"\xc1 not msgpack"])
    stranger.send_multipart(encode(message(5)))  # well-formed, but from a banned peer
    deadline = time.monotonic() + 10
    while server.stats()["rejected"] < 151 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.stats()["rejected"] == 151  # 100 refused, then 51 dropped unread
    assert monitor.poll(5000), "the stranger's connection was not shut"
    monitor.close()
    assert "'stranger' sent 100 malformed or forged messages and little else" in caplog.text
    assert [r.key for r in inbox.snapshot() if r.peer == "stranger"] == []
    client.send(SERVER, 0, message(6))
    assert [r.key for r in inbox.wait_for(2)] == [1 << 30, 6]


@pytest.mark.timeout(60)
def test_a_flood_of_fresh_identities_cannot_push_out_a_members_route(
    transports: Callable[..., ZmqTransport], raw_sockets: Callable[[int], zmq.Socket[bytes]],
) -> None:
    """Without CURVE, 4,200 strangers, each under a new name, send well-formed messages: the routes
    the listener keeps for strangers are bounded, and its member's route survives (replies still go)."""
    config = TransportConfig(channels=1, inflight_bytes=1 << 20, chunk_bytes=1 << 16, curve=False)
    inbox, client_inbox = Inbox(), Inbox()
    server = transports(SERVER, config, inbox, members=(SERVER, CLIENT))
    client = transports(CLIENT, config, client_inbox, members=(SERVER, CLIENT))
    endpoint = server.listen()[0]
    client.connect(SERVER, [endpoint])
    warm_up(client, SERVER, inbox, 1)
    names = 4200  # more than the 4,096 strangers routes are kept for
    # a batch at a time: each socket holds a few descriptors, and no more connect at once than the
    # listener's accept backlog (ZMQ_BACKLOG, 100) holds; the kernel retries the rest a second later
    per_batch = 100
    sockets = []
    for batch in range(names // per_batch):
        for i in range(per_batch):
            sock = raw_sockets(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, f"fresh-{batch}-{i}".encode())
            sock.connect(endpoint)
            sock.send_multipart(encode(message(7)))
            sockets.append(sock)
        inbox.wait_for(1 + (batch + 1) * per_batch, timeout=30)
        for sock in sockets:
            sock.close(linger=0)
        sockets.clear()
    assert len(server._receiver.peers.strangers) <= 4096 and CLIENT in server._receiver.peers.router_idents
    server.send(CLIENT, 0, message(8))
    assert [r.key for r in client_inbox.wait_for(1, timeout=10)] == [8]


@pytest.mark.timeout(30)
def test_an_io_thread_that_dies_tells_its_listeners(transports: Callable[..., ZmqTransport]) -> None:
    """What kills the I/O thread (here an error injected into one of its steps) reaches every listener,
    with the cause, at once; a listener that comes later hears it on registering."""
    transport = transports(CLIENT, TransportConfig(channels=1, curve=False), Inbox())
    heard: list[str] = []
    transport.on_failure(heard.append)

    def broken() -> None:
        raise RuntimeError("an injected fault")

    transport._receiver.announce = broken  # type: ignore[method-assign]
    transport.send("nobody", 0, message(1))  # wakes the I/O thread, which runs its steps
    deadline = time.monotonic() + 10
    while not heard and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(heard) == 1 and "I/O thread stopped on RuntimeError: an injected fault" in heard[0], heard
    late: list[str] = []
    transport.on_failure(late.append)
    assert late == heard
