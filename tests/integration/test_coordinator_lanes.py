"""The coordinator's direct lanes (worker/collective/coord_lanes.py) over real transports and real Unix sockets."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest

from sluice.transport import lane as lanes
from sluice.transport.base import Transport, open_transport
from sluice.transport.config import TransportConfig
from sluice.transport.wire import Kind, Message
from sluice.worker.collective.coord_lanes import MAX_EARLY, CoordinatorLanes
from testbed.light_ranks import Plan, run

pytestmark = pytest.mark.skipif(not lanes.AVAILABLE, reason="direct lanes need Linux")

NAMES = ["worker-0", "worker-1"]
CONFIG = TransportConfig(channels=1, curve=False, shm=False, marks=False, chunk_bytes=64 << 10,
                         inflight_bytes=1 << 20)


@dataclass
class Side:
    """One rank: its transport, and what reached it (neighbour, message, came over the lane)."""

    transport: Transport
    endpoints: list[str]
    got: list[tuple[int, Message, bool]] = field(default_factory=list)
    lanes: CoordinatorLanes | None = None
    raw: list[Message] = field(default_factory=list)  # what its transport brought, when it runs no lanes

    def deliver(self, rank: int, msg: Message, on_lane: bool) -> None:
        self.got.append((rank, msg, on_lane))


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


@pytest.fixture
def sides() -> Iterator[list[Side]]:
    """Rank 0 (the parent) and rank 1 (its child, which dials it), each a transport; no lanes yet."""
    made: list[Side] = []

    def handler(rank: int) -> Callable[[str, int, Message], None]:
        def handle(peer: str, _channel: int, msg: Message) -> None:
            side = made[rank]
            if side.lanes is None:
                side.raw.append(msg)
            elif (why := side.lanes.arrive(1 - rank, msg, on_lane=False)) is not None:
                side.transport.refuse(peer, why)
        return handle

    for rank in range(2):
        transport = open_transport(NAMES[rank], CONFIG, handler(rank), members=NAMES)
        made.append(Side(transport, transport.listen()))
    made[1].transport.connect(NAMES[0], made[0].endpoints)
    made[1].transport.send(NAMES[0], 0, Message(Kind.COORD_UP, meta={"hello": True}))  # rank 0 learns its route
    wait_until(lambda: len(made[0].raw) == 1)
    made[0].raw.clear()
    yield made
    for side in made:
        if side.lanes is not None:
            side.lanes.close(0.2)
        side.transport.close(0.2, 0.2)


def start(side: Side, rank: int) -> CoordinatorLanes:
    kind = Kind.COORD_DOWN if rank == 0 else Kind.COORD_UP
    side.lanes = CoordinatorLanes(side.transport, rank, -1, {1 - rank: (NAMES[1 - rank], kind)},
                                  {0} if rank == 1 else set(), side.deliver)
    side.lanes.start()
    return side.lanes


def numbered(kind: Kind, i: int, nbytes: int) -> Message:
    return Message(kind, meta={"i": i}, dtype="uint8", shape=(nbytes,), payload=np.full(nbytes, i % 256, np.uint8))


@pytest.mark.timeout(30)
def test_each_direction_keeps_its_order_while_messages_too_large_for_a_lane_go_through_the_transport(
        sides: list[Side]) -> None:
    parent, child = start(sides[0], 0), start(sides[1], 1)
    for lanes_ in (parent, child):
        lanes_.piece = 1024  # a message over 1 KiB goes through the transport
    sizes = [100, 2000, 100, 100, 3000, 5000, 100, 0, 2000, 100] * 6
    for i, nbytes in enumerate(sizes):  # the first ones go before the lane is up
        child.send(0, numbered(Kind.COORD_UP, i, nbytes))
        parent.send(1, numbered(Kind.COORD_DOWN, i, nbytes))
        if i % 10 == 9:
            time.sleep(0.02)
    for side in sides:
        wait_until(lambda side=side: len(side.got) == len(sizes))
        assert [msg.meta["i"] for _, msg, _ in side.got] == list(range(len(sizes)))  # type: ignore[index]
        assert all(bytes(msg.payload or b"") == bytes([i % 256]) * nbytes
                   for (_, msg, _), (i, nbytes) in zip(side.got, enumerate(sizes), strict=True))
        paths = [(on_lane, msg.nbytes <= 1024) for _, msg, on_lane in side.got]
        assert (True, False) not in paths, paths  # none larger than a lane's piece came over it
        first = paths.index((True, True))  # the lane came up, and after it messages went both ways
        assert (False, False) in paths[first:], paths
    assert parent.rejects.total == child.rejects.total == 0
    assert sides[0].transport.stats()["rejected"] == sides[1].transport.stats()["rejected"] == 0


@pytest.mark.timeout(30)
def test_what_a_full_lane_holds_back_leaves_once_its_reader_catches_up(sides: list[Side]) -> None:
    parent, child = start(sides[0], 0), start(sides[1], 1)
    wait_until(lambda: child._pairs[0].lane is not None)
    child.send(0, numbered(Kind.COORD_UP, 0, 10))
    wait_until(lambda: any(on_lane for _, _, on_lane in sides[0].got))  # the lane is up and in use
    reading = threading.Event()
    deliver = sides[0].deliver

    def stalled(rank: int, msg: Message, on_lane: bool) -> None:  # the parent's lane thread busy elsewhere
        reading.wait(10.0)
        deliver(rank, msg, on_lane)

    sides[0].lanes._deliver = stalled  # type: ignore[union-attr]
    count = 64  # 16 MiB: more than the socket's buffer, so some wait in the child's queue
    for i in range(1, count + 1):
        child.send(0, numbered(Kind.COORD_UP, i, 256 << 10))
    assert child._pairs[0].lane is not None and child._pairs[0].lane.pending > 0
    reading.set()  # the child then sends nothing more: its lane thread alone must send what it holds
    wait_until(lambda: len(sides[0].got) == count + 1)
    assert [msg.meta["i"] for _, msg, _ in sides[0].got] == list(range(count + 1))  # type: ignore[index]
    assert parent.rejects.total == child.rejects.total == 0


@pytest.mark.timeout(30)
def test_an_offer_that_cannot_connect_is_declined_and_both_keep_to_the_transport(sides: list[Side]) -> None:
    parent = start(sides[0], 0)
    # rank 1 offers a lane nobody listens on (another network namespace's, as it were)
    unheard = Message(Kind.COORD_UP, meta={"lane": "sluice-lane-" + "0" * 32, "secret": "1" * 32})
    sides[1].transport.send(NAMES[0], 0, unheard)
    wait_until(lambda: any(m.meta and "declined" in m.meta for m in sides[1].raw))
    declined = next(m for m in sides[1].raw if m.meta and "declined" in m.meta)
    assert declined.kind == Kind.COORD_DOWN and "ConnectionRefusedError" in declined.meta["declined"]  # type: ignore
    parent.send(1, numbered(Kind.COORD_DOWN, 7, 10))
    wait_until(lambda: any(m.meta == {"i": 7} for m in sides[1].raw))  # no path mark before it: no lane
    assert [m.meta for m in sides[1].raw] == [declined.meta, {"i": 7}]
    sides[1].transport.send(NAMES[0], 0, numbered(Kind.COORD_UP, 8, 10))
    wait_until(lambda: len(sides[0].got) == 1)
    assert sides[0].got[0][1].meta == {"i": 8} and not sides[0].got[0][2]


@pytest.mark.timeout(30)
def test_what_a_lane_peer_sends_wrong_is_refused_and_counted_and_the_lane_serves_on(sides: list[Side]) -> None:
    child = start(sides[1], 1)  # it offers; rank 0 here is a bare transport that connects with the secret
    wait_until(lambda: any(m.meta and "lane" in m.meta for m in sides[0].raw))
    offer = next(m for m in sides[0].raw if m.meta and "lane" in m.meta)
    rogue = None
    while rogue is None:
        rogue = lanes.connect(offer.meta["lane"], offer.meta["secret"])  # type: ignore[index]
    wait_until(lambda: child._pairs[0].lane is not None)
    raw = socket.socket(fileno=rogue.fileno())
    raw.send(b"\xff" * 40)  # not a wire message
    rogue.send(Message(Kind.COORD_UP, meta={"i": 0}))  # what a child sends, not its parent
    rogue.send(Message(Kind.COORD_DOWN, meta={"lane": "x", "secret": "y"}))  # an offer over the lane itself
    for i in range(MAX_EARLY + 1):  # ahead of the mark that says the lane is in use: kept, up to a bound
        rogue.send(Message(Kind.COORD_DOWN, meta={"i": i}))
        while not rogue.flush():
            time.sleep(0.001)
    wait_until(lambda: child.rejects.total == 4)
    assert sides[1].got == []
    sides[0].transport.send(NAMES[1], 0, Message(Kind.COORD_DOWN, meta={"path": "lane"}))
    wait_until(lambda: len(sides[1].got) == MAX_EARLY)
    assert [m.meta for _, m, _ in sides[1].got] == [{"i": i} for i in range(MAX_EARLY)]
    assert all(on_lane for _, _, on_lane in sides[1].got)
    rogue.send(Message(Kind.COORD_DOWN, meta={"path": "lane"}))  # the lane is in use already: a wrong mark
    wait_until(lambda: child.rejects.total == 5)
    rogue.send(Message(Kind.COORD_DOWN, meta={"i": -1}))
    wait_until(lambda: len(sides[1].got) == MAX_EARLY + 1)
    assert sides[1].got[-1][1].meta == {"i": -1} and sides[1].got[-1][2]
    raw.detach()
    rogue.close()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_ranks_of_one_host_decide_over_lanes_and_other_hosts_through_the_transport_in_one_order() -> None:
    hosts = tuple(f"h{r % 3}" for r in range(12))
    reports = run(Plan(ranks=12, arity=2, steps=3, ops=30, hosts=hosts, timeout=30, lanes=True))
    assert {r.error for r in reports} == {None} and all(r.steps_done == 3 for r in reports)
    assert all(r.decisions == reports[0].decisions for r in reports)
    assert sum(r.steady["received_on_lanes"] for r in reports) > 0
    assert all(r.steady["refused"] == 0 for r in reports)
