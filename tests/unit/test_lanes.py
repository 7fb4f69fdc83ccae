"""Direct lanes (transport/lane.py) on real Unix sockets, and a stage's exchange over them (links.py)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time
from typing import Any

import numpy as np
import pytest

from sluice.errors import SluiceError
from sluice.transport import lane as lanes
from sluice.transport.wire import Flag, Kind, Message, WireError, encode
from sluice.worker.pipeline.exchange import Neighbours, StageExchange
from sluice.worker.pipeline.frames import BACKWARD, FORWARD
from sluice.worker.pipeline.layout import StagePlace
from tests.unit.stage_helpers import Recorder

pytestmark = [pytest.mark.timeout(60), pytest.mark.skipif(not lanes.AVAILABLE, reason="lanes need Linux")]


def accepted(listener: lanes.LaneListener, seconds: float = 5.0) -> lanes.Lane:
    deadline = time.monotonic() + seconds
    while (lane := listener.accept()) is None:
        assert time.monotonic() < deadline, "the listener took no connection"
        time.sleep(0.001)
    return lane


def pair() -> tuple[lanes.Lane, lanes.Lane]:
    listener = lanes.LaneListener()
    dialled = lanes.connect(listener.name, listener.secret)
    assert dialled is not None
    return accepted(listener), dialled


def received(lane: lanes.Lane, count: int, seconds: float = 5.0) -> list[Message | WireError]:
    """`count` datagrams from `lane`, their payloads as bytes (to compare)."""
    got = received_raw(lane, count, seconds)
    for item in got:
        if isinstance(item, Message) and item.payload is not None:
            item.payload = bytes(item.payload)
    return got


def received_raw(lane: lanes.Lane, count: int, seconds: float = 5.0) -> list[Message | WireError]:
    """`count` datagrams from `lane` as they came (each payload in memory of its own)."""
    got: list[Message | WireError] = []
    deadline = time.monotonic() + seconds
    while len(got) < count and time.monotonic() < deadline:
        got.extend(lane.receive())
    return got


def tensor_message(priority: int = 0, nbytes: int = 4096, fill: int = 1) -> Message:
    payload = np.full(nbytes, fill, np.uint8)
    return Message(Kind.STAGE_FORWARD, sender=1, key=2, chunk=3, round=4, priority=priority, dtype="uint8",
                   shape=(nbytes,), payload=payload, meta={"x": [1, "a"]})


def test_messages_cross_a_lane_whole_and_checked() -> None:
    a, b = pair()
    sent = [tensor_message(), Message(Kind.STAGE_BACKWARD, sender=0, round=9),
            Message(Kind.STAGE_FORWARD, dtype="uint8", shape=(0,), payload=np.zeros(0, np.uint8))]
    for msg in sent:
        b.send(msg)
    got = received(a, 3)
    assert [(m.kind, m.sender, m.round) for m in got if isinstance(m, Message)] == [
        (Kind.STAGE_FORWARD, 1, 4), (Kind.STAGE_BACKWARD, 0, 9), (Kind.STAGE_FORWARD, -1, 0)]
    first = got[0]
    assert isinstance(first, Message) and first.meta == {"x": [1, "a"]} and first.payload == bytes([1]) * 4096
    last = got[2]
    assert isinstance(last, Message) and last.payload == b"" and last.shape == (0,)
    largest = lanes.piece_bytes()  # the accepting end takes it too (its socket's buffers are raised as well)
    a.send(tensor_message(fill=7, nbytes=largest))
    back = received(b, 1)[0]
    assert isinstance(back, Message) and back.payload == bytes([7]) * largest
    with pytest.raises(ValueError, match="at most"):
        a.send(tensor_message(nbytes=largest + 1))
    assert b.sent[0] == 3 and a.received[0] == 3 and a.sent == [1, b.received[1]] and b.received[0] == 1
    assert a.received[1] == b.sent[1] > 4096 + 2


@pytest.mark.serial
def test_each_payload_arrives_in_memory_of_its_own_aligned_for_any_dtype() -> None:
    a, b = pair()
    for nbytes in (8, 4096, 4097):
        b.send(tensor_message(nbytes=nbytes, fill=3))
    got = received_raw(a, 3)
    arrays = [np.frombuffer(m.payload, np.uint8) for m in got if isinstance(m, Message)]
    assert [x.size for x in arrays] == [8, 4096, 4097] and all(x.ctypes.data % 16 == 0 for x in arrays)
    assert not any(np.shares_memory(x, y) for i, x in enumerate(arrays) for y in arrays[i + 1:])
    assert all((x == 3).all() for x in arrays)
    big = tensor_message(nbytes=64, fill=5)
    big.meta = {"x": "y" * 2000}  # a header over KEPT_HEADER: the payload is copied out of the datagram
    b.send(big)
    kept = received_raw(a, 1)[0]
    assert isinstance(kept, Message) and bytes(kept.payload) == bytes([5]) * 64
    owner = memoryview(kept.payload).obj
    assert isinstance(owner, bytes) and len(owner) == 64  # its own 64 bytes, not the 2 KiB datagram


def test_a_full_lane_queues_without_blocking_and_sends_the_most_urgent_first() -> None:
    a, b = pair()
    started = time.monotonic()
    for index in range(200):  # 12.5 MiB: far more than the socket holds
        b.send(tensor_message(priority=1, nbytes=lanes.piece_bytes(), fill=index % 200))
    assert time.monotonic() - started < 2.0 and b.pending > 0
    b.send(tensor_message(priority=0, nbytes=16, fill=255))  # an urgent one queued behind them
    got: list[Message | WireError] = []
    while len(got) < 201:
        b.flush()
        got += received(a, 1, seconds=1.0)
    assert b.flush() and b.pending == 0
    fills = [m.payload[0] for m in got if isinstance(m, Message)]
    urgent = fills.index(255)
    assert urgent < 200 - b.pending and fills[:urgent] + fills[urgent + 1:] == [i % 200 for i in range(200)]
    assert urgent < 199  # it passed the queued bulk: sent as soon as there was room, not last


def test_the_listener_takes_only_the_connection_that_knows_its_secret() -> None:
    listener = lanes.LaneListener()
    stranger = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    stranger.connect("\0" + listener.name)
    stranger.send(b"0" * lanes.SECRET_HEX)
    deadline = time.monotonic() + 2
    while listener.refused == 0 and time.monotonic() < deadline:
        assert listener.accept() is None
    assert listener.refused == 1
    assert stranger.recv(10) == b""  # shut out
    dialled = lanes.connect(listener.name, listener.secret)
    assert dialled is not None
    lane = accepted(listener)
    dialled.send(tensor_message())
    assert isinstance(received(lane, 1)[0], Message)


SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")


def test_silent_connections_cannot_crowd_out_the_one_with_the_secret() -> None:
    listener = lanes.LaneListener()
    silent = []
    for _ in range(10):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.connect("\0" + listener.name)
        silent.append(sock)
        assert listener.accept() is None
    dialled = lanes.connect(listener.name, listener.secret)
    assert dialled is not None
    accepted(listener)
    assert listener.refused >= 6
    for sock in silent:
        sock.close()


@pytest.mark.skipif(os.geteuid() != 0 or SYSTEM_PYTHON is None,
                    reason="needs root and a python3 in /usr/bin to run a process as another user")
def test_a_process_of_another_user_is_refused_even_with_the_secret() -> None:
    listener = lanes.LaneListener()
    code = ("import socket,sys; s=socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET); "
            f"s.connect('\\0{listener.name}'); s.send(b'{listener.secret}')\n"
            "try: print(s.recv(10))\nexcept ConnectionResetError: print(b'')")
    child = subprocess.Popen([str(SYSTEM_PYTHON), "-c", code], user=65534, stdout=subprocess.PIPE, text=True,
                             cwd="/")
    deadline = time.monotonic() + 10
    while listener.refused == 0 and time.monotonic() < deadline:
        assert listener.accept() is None
        time.sleep(0.01)
    out, _ = child.communicate(timeout=10)
    assert listener.refused == 1 and out.strip() == "b''"


def raw_datagram(header: bytes, count: int, payload: bytes = b"") -> bytes:
    padding = bytes(-(5 + len(header)) % 16)  # the payload starts at a multiple of 16
    return len(header).to_bytes(4, "little") + bytes([count]) + header + padding + payload


def malformed() -> list[tuple[bytes, str]]:
    good = encode(tensor_message(nbytes=8))
    header, payload = bytes(good[0]), bytes(memoryview(good[1]))
    shm = Message(Kind.STAGE_FORWARD, dtype="uint8", shape=(8,), payload=b"x" * 8, flags=Flag.SHM)
    shm.shm = ("seg", 0, 8)
    shm_frames = [bytes(memoryview(f)) for f in encode(shm)]
    return [
        (b"abc", "has no header length"),
        (raw_datagram(header, 3, payload), "declares"),
        (raw_datagram(header, 1, payload), "declares"),
        ((10 ** 6).to_bytes(4, "little") + b"\x02" + header, "declares"),
        (raw_datagram(b"\xc1" * 10, 1), "not valid msgpack"),
        (raw_datagram(header, 2, payload + b"extra"), "payload bytes"),
        (raw_datagram(shm_frames[0], 2, shm_frames[1]), "shared memory"),
        (b"\0" * (lanes.LARGEST + 1), "larger than"),
    ]


def test_malformed_datagrams_are_refused_and_the_lane_keeps_serving() -> None:
    listener = lanes.LaneListener()
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    raw.connect("\0" + listener.name)
    raw.send(listener.secret.encode())
    lane = accepted(listener)
    cases = malformed()
    for datagram, _ in cases:
        raw.send(datagram)
    raw.send(raw_datagram(bytes(encode(tensor_message(nbytes=8))[0]), 2, b"\1" * 8))
    got = received(lane, len(cases) + 1)
    for (_, problem), item in zip(cases, got, strict=False):
        assert isinstance(item, WireError) and problem in str(item), (problem, item)
    assert isinstance(got[-1], Message) and got[-1].payload == b"\1" * 8


def test_a_peer_that_closes_reads_as_closed_and_sending_to_it_does_not_raise() -> None:
    a, b = pair()
    b.send(tensor_message())
    b.close()
    got = received(a, 2, seconds=1.0)
    assert len(got) == 1 and a.closed  # what it sent first still arrives, then the end
    c, d = pair()
    c.close()
    d.send(tensor_message())
    assert d.closed


def test_connect_checks_the_offer_and_says_when_nobody_listens() -> None:
    with pytest.raises(ValueError, match="lane offer"):
        lanes.connect("../etc/passwd", "0" * 32)
    with pytest.raises(ValueError, match="lane offer"):
        lanes.connect("sluice-lane-" + "0" * 32, "short")
    with pytest.raises(ConnectionRefusedError):  # nobody listens there (in this network namespace)
        lanes.connect("sluice-lane-" + "0" * 32, "0" * 32)


# ---------------------------------------------------------------------------- a stage's exchange over lanes
def exchange(rank: int, **kw: Any) -> tuple[StageExchange, Recorder]:
    wire = Recorder()
    ex = StageExchange(wire, StagePlace(rank, 2, 2), Neighbours(["worker-0", "worker-1"], ["h", "h"]),  # type: ignore[arg-type]
                       kw.pop("timeout", 5.0), lambda priority: priority, **kw)
    return ex, wire


def connected() -> tuple[StageExchange, StageExchange, Recorder, Recorder]:
    first, wire0 = exchange(0)
    last, wire1 = exchange(1)
    assert [m.kind for _, _, m in wire0.sent] == [Kind.STAGE_LANE] and wire1.sent == []
    offer = wire0.sent.pop()[2]
    last.on_message("worker-0", offer)
    for ex in (first, last):
        ex.begin(0, 2)
    return first, last, wire0, wire1


def test_neighbours_on_one_host_exchange_over_a_direct_lane_not_the_transport() -> None:
    first, last, wire0, wire1 = connected()
    activations = np.arange(100_000, dtype=np.float32)  # 400 KB: in pieces of a lane's size
    first.send(FORWARD, 0, 1, [(activations, "float32")], 1)
    answered: list[Any] = []

    def last_stage() -> None:
        got = last.receive(FORWARD, 0, 1)
        last.send(BACKWARD, 0, 1, [(got[0].array * 2, "float32")], 0)
        answered.append(got)

    thread = threading.Thread(target=last_stage)
    thread.start()
    back = first.receive(BACKWARD, 0, 1)  # its waits accept the lane and send what waited for it
    thread.join(10)
    assert np.array_equal(answered[0][0].array, activations) and np.array_equal(back[0].array, activations * 2)
    assert wire0.sent == wire1.sent == [] and wire0.refused == wire1.refused == []
    first.close(1.0)
    last.close(1.0)


def received_while_pumping(receiver: StageExchange, sender: StageExchange, micro: int) -> Any:
    """`receiver`'s activations of micro-batch `micro`, while `sender`'s thread (here) pumps its lanes."""
    got: list[Any] = []
    thread = threading.Thread(target=lambda: got.append(receiver.receive(FORWARD, 0, micro)))
    thread.start()
    assert sender.links is not None
    while thread.is_alive():
        sender.links.pump(lambda peer, msg: None, lambda peer, text: None)
        thread.join(0.001)
    return got[0]


def test_a_neighbour_whose_lane_closes_is_named_at_once() -> None:
    first, last, _, _ = connected()
    first.send(FORWARD, 0, 0, [(np.ones(4, np.float32), "float32")], 1)
    assert received_while_pumping(last, first, 0)[0].array.tolist() == [1, 1, 1, 1]
    first.close(1.0)
    started = time.monotonic()
    with pytest.raises(SluiceError, match=r"from stage 0 \(worker 0 on h\): its direct lane closed: it exited"):
        last.receive(FORWARD, 0, 1)
    assert time.monotonic() - started < 1.0


def test_what_a_lane_brings_out_of_place_is_refused_and_counted() -> None:
    first, last, _, _ = connected()
    first.send(FORWARD, 0, 0, [(np.ones(4, np.float32), "float32")], 1)
    received_while_pumping(last, first, 0)
    assert first.links is not None
    lane = first.links.links[1].lane
    assert lane is not None
    lane.send(Message(Kind.STAGE_BACKWARD, sender=0, dtype="uint8", shape=(1,), payload=b"x"))  # the wrong way
    lane.send(Message(Kind.GROUP_DATA, sender=0))
    last.timeout = 0.3
    with pytest.raises(SluiceError, match=r"2 of its messages were refused, the last as: .*GROUP_DATA"):
        last.receive(FORWARD, 0, 1)
    assert last.links is not None and last.links.rejects.total == 2


@pytest.mark.parametrize(("sender", "meta", "problem"), [
    (1, {"lane": "sluice-lane-" + "0" * 32, "secret": "0" * 32}, "not the worker it names"),
    (0, {"lane": "x", "secret": "0" * 32}, "must name a sluice lane"),
    (0, {"lane": "sluice-lane-" + "0" * 32}, "meta must be"),
    (0, "text", "meta must be"),
])
def test_lane_offers_are_checked(sender: int, meta: Any, problem: str) -> None:
    last, wire = exchange(1)
    last.on_message("worker-0", Message(Kind.STAGE_LANE, sender=sender, meta=meta))
    assert len(wire.refused) == 1 and problem in wire.refused[0]


def test_an_offer_twice_or_to_a_stage_without_lanes_is_refused() -> None:
    first, wire0 = exchange(0)
    offer = wire0.sent[0][2]
    last, wire1 = exchange(1)
    last.on_message("worker-0", offer)
    last.on_message("worker-0", offer)
    assert len(wire1.refused) == 1 and "twice" in wire1.refused[0]
    plain, wire2 = exchange(1, direct=False)
    plain.on_message("worker-0", offer)
    assert "no lane" in wire2.refused[0]
    first.on_message("worker-1", Message(Kind.STAGE_LANE, sender=1, meta=offer.meta))  # the first stage offers
    assert "no direct lane from that worker" in wire0.refused[0]


def test_a_lane_that_cannot_connect_is_declined_and_both_sides_use_the_transport() -> None:
    first, wire0 = exchange(0)
    last, wire1 = exchange(1)
    offer = wire0.sent.pop()[2]
    assert offer.meta is not None
    elsewhere = {**offer.meta, "lane": "sluice-lane-" + "0" * 32}  # as if in another network namespace
    last.on_message("worker-0", Message(Kind.STAGE_LANE, sender=0, meta=elsewhere))
    for ex in (first, last):
        ex.begin(0, 2)
    first.send(FORWARD, 0, 0, [(np.ones(4, np.float32), "float32")], 1)  # waits for a lane, for now
    assert wire0.sent == []
    last.send(BACKWARD, 0, 1, [(np.full(4, 2, np.float32), "float32")], 0)  # the connect fails: declined
    assert [m.kind for _, _, m in wire1.sent] == [Kind.STAGE_LANE, Kind.STAGE_BACKWARD]
    assert wire1.sent[0][2].meta is not None and "ConnectionRefusedError" in wire1.sent[0][2].meta["declined"]
    for _, _, msg in wire1.sent:
        first.on_message("worker-1", msg)
    assert first.receive(BACKWARD, 0, 1)[0].array.tolist() == [2, 2, 2, 2]  # its wait sends what waited
    assert [(peer, m.kind) for peer, _, m in wire0.sent] == [("worker-1", Kind.STAGE_FORWARD)]
    last.on_message("worker-0", wire0.sent[0][2])
    assert last.receive(FORWARD, 0, 0)[0].array.tolist() == [1, 1, 1, 1]
    assert wire0.refused == wire1.refused == []
    assert first.links is not None and "worker-1 declined it: ConnectionRefusedError" in first.links.links[1].state()


def test_a_read_takes_at_most_its_limit_so_a_flooding_peer_cannot_hold_the_reader() -> None:
    a, b = pair()
    for _ in range(260):
        b.send(Message(Kind.STAGE_FORWARD, sender=1))
    assert b.pending == 0
    assert len(list(a.receive(limit=256))) == 256
    assert len(list(a.receive(limit=256))) == 4


def test_a_stage_that_cannot_listen_declines_and_both_sides_use_the_transport(monkeypatch: Any) -> None:
    def no_listener() -> None:
        raise OSError(97, "Address family not supported by protocol")

    monkeypatch.setattr(lanes, "LaneListener", no_listener)
    first, wire0 = exchange(0)
    last, wire1 = exchange(1)
    assert [m.kind for _, _, m in wire0.sent] == [Kind.STAGE_LANE]
    last.on_message("worker-0", wire0.sent.pop()[2])
    for ex in (first, last):
        ex.begin(0, 1)
    first.send(FORWARD, 0, 0, [(np.ones(4, np.float32), "float32")], 1)
    last.send(BACKWARD, 0, 0, [(np.ones(4, np.float32), "float32")], 0)
    assert [m.kind for _, _, m in wire0.sent] == [Kind.STAGE_FORWARD]
    assert [m.kind for _, _, m in wire1.sent] == [Kind.STAGE_BACKWARD]
    assert wire0.refused == wire1.refused == []
    assert last.links is not None and "declined it: cannot listen" in last.links.links[0].state()
