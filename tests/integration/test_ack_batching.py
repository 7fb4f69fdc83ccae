"""Credit acknowledgements sent lazily between two real ZmqTransports: few ACKs, and no sender left waiting.

The receiver acknowledges a route once its unacknowledged bytes reach a share of the in-flight bound or
once the oldest is ACK_DELAY_S old, and at once when it cannot know the sender's bound (transport/
zmq_receive.py). Tests that must show that no sender waits for that delay set it to a minute: a sender
that did wait would miss the test's deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from sluice.transport import zmq_receive
from sluice.transport.config import TransportConfig
from sluice.transport.wire import Kind, Message
from sluice.transport.zmq_transport import ZmqTransport
from tests.integration.transport_helpers import CLIENT, SERVER, Inbox, message, warm_up

CHANNEL = 1
LONG_DELAY_S = 60.0


@pytest.mark.parametrize(("inflight", "chunk", "expected"), [
    (0, 0, 1 << 20),  # the defaults (16 MiB, 1 MiB chunks): capped at 1 MiB
    (64 << 10, 32 << 10, 8 << 10),  # 1/8 of the bound
    (1536 << 10, 0, 192 << 10),
    (1 << 20, 1 << 20, 1),  # a chunk fills the bound: every turn acknowledges
    (256 << 10, 0, 1),  # chunks may be 1 MiB: larger than the bound
])
def test_threshold_leaves_a_chunk_of_credit(inflight: int, chunk: int, expected: int) -> None:
    config = TransportConfig(inflight_bytes=inflight, chunk_bytes=chunk)
    threshold = zmq_receive.ack_threshold(config)
    assert threshold == expected
    assert threshold == 1 or threshold <= min(config.inflight_limit // 8, config.inflight_limit - config.chunk_limit)


def inflight(sender: ZmqTransport, to: str, channel: int = CHANNEL) -> int:
    """Payload bytes `sender` sent to `to` on `channel` that are not acknowledged yet (asked on its I/O thread)."""
    def read() -> int:
        queue = sender._sender.queues.get((to, channel))
        return 0 if queue is None else queue.inflight

    return int(sender._call(read))


def wait_for_credit(sender: ZmqTransport, to: str, seconds: float) -> float:
    """Seconds until all of `sender`'s credit to `to` came back; fails after `seconds`."""
    started = time.monotonic()
    while inflight(sender, to):
        if time.monotonic() - started > seconds:
            raise AssertionError(f"{inflight(sender, to)} bytes still unacknowledged after {seconds} s")
        time.sleep(0.001)
    return time.monotonic() - started


Pair = Callable[[TransportConfig], tuple[ZmqTransport, ZmqTransport, Inbox]]


@pytest.fixture
def pair() -> Iterator[Pair]:
    """Makes a listening server and a client connected to it, every channel up (returns both and the
    server's inbox); closes them whatever the test's outcome."""
    made: list[ZmqTransport] = []

    def make(config: TransportConfig) -> tuple[ZmqTransport, ZmqTransport, Inbox]:
        inbox = Inbox()
        server = ZmqTransport(SERVER, config, inbox)
        made.append(server)
        client = ZmqTransport(CLIENT, config, Inbox())
        made.append(client)
        client.connect(SERVER, server.listen())
        warm_up(client, SERVER, inbox, config.channels)
        return server, client, inbox

    yield make
    for transport in made:
        transport.close(flush_seconds=0.2)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shm", [False, True], ids=["sockets", "shm"])
def test_small_messages_share_acknowledgements(pair: Pair, shm: bool) -> None:
    """Small messages a fraction of a millisecond apart (each one alone in the receiver's turn, so one
    ACK each before) are acknowledged a few at a time, and the last credit comes back on its own."""
    server, client, inbox = pair(TransportConfig(channels=2, shm=shm, curve=False))
    start = len(inbox.snapshot())
    acks_before = sum(server.stats()["acks_sent"])
    count = 200
    payload = (np.arange(32 << 10 if shm else 1 << 10) % 251).astype(np.uint8)  # through the ring with shm
    for key in range(count):
        client.send(SERVER, CHANNEL, message(key, payload=payload))
        time.sleep(0.0005)
    got = inbox.wait_for(start + count)[start:]
    assert [r.key for r in got] == list(range(count)) and all(r.data == payload.tobytes() for r in got)
    # nothing else happens now: the delayed acknowledgement must still go out, within its delay
    waited = wait_for_credit(client, SERVER, 2.0)
    acks = sum(server.stats()["acks_sent"]) - acks_before
    assert 1 <= acks <= count // 4, f"{acks} acknowledgements for {count} messages"
    assert waited < 1.0


@pytest.mark.timeout(60)
def test_each_acknowledged_message_is_timed_from_its_socket_to_its_credit(pair: Pair) -> None:
    """The sender counts every payload message its peer acknowledged, and the seconds each took from its
    socket to the credit it got back (the network agent's measure of the path to that peer)."""
    _server, client, inbox = pair(TransportConfig(channels=2, shm=False, curve=False))
    start = len(inbox.snapshot())
    metrics = client._sender._metrics
    wait_for_credit(client, SERVER, 5.0)  # the warm-up's messages acknowledged first
    acks_before = client._call(lambda: metrics.peer_acks.get(SERVER, 0))
    seconds_before = client._call(lambda: metrics.peer_ack_s.get(SERVER, 0.0))
    bytes_before = client._call(lambda: metrics.peer_acked_bytes.get(SERVER, 0))
    count = 50
    began = time.monotonic()
    for key in range(count):
        client.send(SERVER, CHANNEL, message(key, payload=np.ones(16 << 10, np.uint8)))
    inbox.wait_for(start + count)
    wait_for_credit(client, SERVER, 5.0)
    took = time.monotonic() - began
    acks = client._call(lambda: metrics.peer_acks.get(SERVER, 0)) - acks_before
    seconds = client._call(lambda: metrics.peer_ack_s.get(SERVER, 0.0)) - seconds_before
    assert acks == count
    assert 0 < seconds / acks <= took
    # every payload byte acknowledged (what got through), the frames' headers not counted
    acked = client._call(lambda: metrics.peer_acked_bytes.get(SERVER, 0))
    assert acked - bytes_before == count * (16 << 10)
    # an acknowledgement of more than was in flight (a peer's number) counts no more than that: here nothing
    client._call(lambda: client._sender.credit((SERVER, CHANNEL), 1 << 40))
    assert client._call(lambda: metrics.peer_acked_bytes.get(SERVER, 0)) == acked
    assert not any(client._call(lambda: list(client._sender._unacked.get((SERVER, CHANNEL), []))))


@pytest.mark.timeout(60)
def test_closing_receiver_does_not_wait_for_a_peer_that_left_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """A receiver holding credit owed to a peer that already closed leaves at once: it sends no last
    acknowledgement, which ZeroMQ would keep for the peer's return, holding the close for the whole linger
    (2 s: the second worker of every job took that long to exit)."""
    monkeypatch.setattr(zmq_receive, "ACK_DELAY_S", LONG_DELAY_S)
    config = TransportConfig(channels=2, shm=False, curve=False)
    inbox = Inbox()
    server = ZmqTransport(SERVER, config, Inbox())
    client = ZmqTransport(CLIENT, config, inbox)
    try:
        client.connect(SERVER, server.listen())
        client.send(SERVER, CHANNEL, message(0))  # the server learns the client's identity
        time.sleep(0.1)
        server.send(CLIENT, CHANNEL, message(1, payload=np.ones(1024, np.uint8)))
        inbox.wait_for(1)
        server.close(flush_seconds=0.2)
        started = time.monotonic()
        client.close(flush_seconds=0.5, linger_seconds=2.0)
        assert time.monotonic() - started < 1.0
    finally:
        server.close(flush_seconds=0.1)
        client.close(flush_seconds=0.1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shm", [False, True], ids=["sockets", "shm"])
def test_small_credit_moves_a_large_transfer_without_waiting_for_the_delay(
    pair: Pair, monkeypatch: pytest.MonkeyPatch, shm: bool
) -> None:
    """A 64 KiB bound (2 chunks) and messages of 1 byte to a chunk, inline and through the ring: the
    threshold alone must return the credit, or the first window would wait a minute."""
    monkeypatch.setattr(zmq_receive, "ACK_DELAY_S", LONG_DELAY_S)
    chunk = 32 << 10
    config = TransportConfig(channels=2, inflight_bytes=2 * chunk, chunk_bytes=chunk, shm=shm, curve=False)
    server, client, inbox = pair(config)
    start = len(inbox.snapshot())
    rng = np.random.default_rng(3)
    payloads = [rng.integers(0, 256, int(n), dtype=np.uint8) for n in rng.integers(1, chunk + 1, 1024)]
    started = time.monotonic()
    for key, payload in enumerate(payloads):
        client.send(SERVER, CHANNEL, message(key, payload=payload))
    got = inbox.wait_for(start + len(payloads), timeout=30)[start:]
    elapsed = time.monotonic() - started
    assert [r.data for r in got] == [p.tobytes() for p in payloads]
    total = sum(p.nbytes for p in payloads)
    assert sum(server.stats()["acks_sent"]) < len(payloads), "small messages should share acknowledgements"
    print(f"{total / 2**20:.1f} MiB in {len(payloads)} messages, 64 KiB credit: {elapsed:.2f} s")


@pytest.mark.timeout(60)
def test_calibration_probes_get_their_credit_at_once(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A calibration lowers the prober's bound to one chunk while the server keeps the default (its
    threshold is then 16 times that chunk): probes are acknowledged at once all the same."""
    monkeypatch.setattr(zmq_receive, "ACK_DELAY_S", LONG_DELAY_S)
    _, client, inbox = pair(TransportConfig(channels=2, curve=False))
    start = len(inbox.snapshot())
    chunk = 64 << 10
    client.set_inflight(chunk)
    payload = client.alloc(chunk, np.dtype(np.uint8))  # registered, as the calibration's buffer is
    probes = 64
    for seq in range(probes):
        client.send(SERVER, CHANNEL, Message(Kind.PROBE, sender=1, round=seq + 1, priority=1 << 20, dtype="uint8",
                                             shape=(chunk,), payload=payload))
    got = inbox.wait_for(start + probes, timeout=20)[start:]
    assert [r.kind for r in got] == [Kind.PROBE] * probes


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shm", [False, True], ids=["sockets", "shm"])
def test_once_bounds_are_set_a_smaller_sender_bound_is_served_at_once(
    pair: Pair, monkeypatch: pytest.MonkeyPatch, shm: bool
) -> None:
    """A worker between its calibration and its plan keeps its own proposal: here the receiver's is
    16 MiB (a threshold of 1 MiB, were it delayed) and the sender's 64 KiB."""
    monkeypatch.setattr(zmq_receive, "ACK_DELAY_S", LONG_DELAY_S)
    server, client, inbox = pair(TransportConfig(channels=2, shm=shm, curve=False))
    server.set_inflight(16 << 20)
    client.set_inflight(64 << 10)
    start = len(inbox.snapshot())
    payload = np.ones(16 << 10, np.uint8)
    count = 256
    for key in range(count):
        client.send(SERVER, CHANNEL, message(key, payload=payload))
    inbox.wait_for(start + count, timeout=20)
    wait_for_credit(client, SERVER, 5.0)
