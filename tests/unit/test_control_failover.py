"""A node between its REJOIN and the standby's takeover sends the standby nothing else; a worker waiting for a
declaration's PLAN sends its DECLARE again each heartbeat_timeout (scheduler/node.py)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from sluice.scheduler.bootstrap import NodeEnv
from sluice.scheduler.config import SchedulerConfig
from sluice.scheduler.node import ControlClient, PeerInfo
from sluice.transport.wire import Kind, Message

STANDBY = "tcp://127.0.0.1:2"


class RecordingTransport:
    """Records what the client sends, and to which scheduler; the unit under test is the client's logic."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, Kind]] = []
        self.scheduler = "tcp://127.0.0.1:1"

    def connect(self, peer: str, endpoints: Any, control: bool = False, tos: int | None = None) -> None:
        pass

    def replace_peer(self, peer: str, endpoints: list[str], control: bool = False, tos: int | None = None) -> None:
        self.scheduler = endpoints[0]

    def send(self, peer: str, channel: int, msg: Message) -> None:
        self.sent.append((self.scheduler, msg.kind))

    def on_failure(self, listener: Any) -> None:
        pass


def test_a_goodbye_asked_before_the_standby_took_over_waits_for_the_takeover_and_goes_once() -> None:
    # before: the BYE went at once to the standby, which refused it as a message it does not take (counted among
    # a hostile peer's), and got it again at the takeover
    transport = RecordingTransport()
    env = NodeEnv(scheduler=transport.scheduler, role="worker", rank=0, workers=2, servers=1, config={},
                  standby=STANDBY)
    config = SchedulerConfig(heartbeat_interval=0.1, heartbeat_timeout=0.5, op_timeout=1.0)
    client = ControlClient(transport, env, config)  # type: ignore[arg-type]
    client.role, client.rank, client.node_id = "worker", 0, 2
    client._fail_over(0.6, STANDBY)
    leaving = threading.Thread(target=client.bye)
    leaving.start()
    time.sleep(0.2)  # the goodbye is asked (a worker with a standby waits for the scheduler's word)
    client.send(Kind.PLAN_ACK, seq=0)  # a message that is not a request: a standby could not take it either
    assert transport.sent == [(STANDBY, Kind.REJOIN)] and leaving.is_alive()
    client.on_message(Message(Kind.WELCOME, sender=0, meta={"rejoined": True}))  # the standby took over
    assert transport.sent == [(STANDBY, Kind.REJOIN), (STANDBY, Kind.BYE)]
    client.on_message(Message(Kind.SHUTDOWN, sender=0))  # it saw this worker leave
    leaving.join(2)
    assert not leaving.is_alive() and client.failure is None


def test_a_server_the_dead_scheduler_readmitted_without_telling_is_told_by_the_standbys_address_book() -> None:
    """The scheduler re-admitted server 0's replacement (ps.recover) and died before its SERVER_BACK went out: the
    standby's WELCOME lists the new endpoints, which the node hands on as that SERVER_BACK (before: it kept the dead
    ones, and its requests to that server waited until op_timeout)."""
    transport, told = RecordingTransport(), []
    env = NodeEnv(scheduler=transport.scheduler, role="worker", rank=0, workers=2, servers=1, config={},
                  standby=STANDBY)
    client = ControlClient(transport, env, SchedulerConfig(), on_message=told.append)  # type: ignore[arg-type]
    client.role, client.rank, client.node_id = "worker", 0, 2
    client.peers = [PeerInfo(1, "server", 0, "server-0", ("tcp://10.0.0.1:1",)),
                    PeerInfo(2, "worker", 0, "worker-0", ())]
    book = [[1, "server", 0, "server-0", ["tcp://10.0.0.1:7"]], [2, "worker", 0, "worker-0", []]]
    client._fail_over(9.0, STANDBY)
    client.on_message(Message(Kind.WELCOME, sender=0, meta={"rejoined": True, "nodes": book}))
    assert [(m.kind, m.meta) for m in told] == [(Kind.SERVER_BACK, {"node_id": 1, "rank": 0, "name": "server-0",
                                                                    "endpoints": ["tcp://10.0.0.1:7"]})]
    told.clear()
    client.peers[0] = PeerInfo(1, "server", 0, "server-0", ("tcp://10.0.0.1:7",))  # as the SERVER_BACK left it
    client.on_message(Message(Kind.WELCOME, sender=0, meta={"rejoined": True, "nodes": book}))
    assert told == []


def _client(transport: RecordingTransport) -> ControlClient:
    env = NodeEnv(scheduler=transport.scheduler, role="worker", rank=0, workers=2, servers=1, config={})
    config = SchedulerConfig(heartbeat_interval=0.05, heartbeat_timeout=0.2, op_timeout=3.0)
    client = ControlClient(transport, env, config)  # type: ignore[arg-type]
    client.role, client.rank, client.node_id = "worker", 0, 2
    return client


@pytest.mark.timeout(10)
def test_a_declaration_whose_plan_does_not_come_is_asked_again_until_it_comes() -> None:
    transport = RecordingTransport()
    client = _client(transport)
    answer: list[object] = []
    waiting = threading.Thread(target=lambda: answer.append(client.declare([["g", [2], "float32", None]])))
    waiting.start()
    time.sleep(0.7)  # about three heartbeat_timeouts
    asked = [kind for _, kind in transport.sent]
    assert 3 <= asked.count(Kind.DECLARE) <= 5 and set(asked) == {Kind.DECLARE}, asked
    plan = [[0, "g", [2], "float32", 0, [[0, 0, 2, 0]]]]
    client.on_message(Message(Kind.PLAN, sender=0, meta={"seq": 0, "tensors": plan, "limits": [1 << 20, 1 << 21]}))
    waiting.join(2)
    assert not waiting.is_alive() and answer and answer[0][0] == plan  # type: ignore[index]
    time.sleep(0.3)
    assert [kind for _, kind in transport.sent].count(Kind.DECLARE) == asked.count(Kind.DECLARE)  # not after it


@pytest.mark.timeout(10)
def test_a_barrier_is_asked_once() -> None:
    """Only a declaration is asked again: the scheduler answers its repeat as the first, which a barrier's need not."""
    transport = RecordingTransport()
    client = _client(transport)
    waiting = threading.Thread(target=client.barrier, args=("b",))
    waiting.start()
    time.sleep(0.5)
    client.on_message(Message(Kind.RELEASE, sender=0, meta={"name": "b"}))
    waiting.join(2)
    assert not waiting.is_alive() and [kind for _, kind in transport.sent] == [Kind.BARRIER]
