"""The scheduler's side of server recovery (ps.recover) and of its replicas (ps.replicas: each holder gets its
primaries' plans, a server back on its holder's host has the holder release the mirror), with plain messages."""

from __future__ import annotations

from typing import Any

import pytest

from sluice.scheduler.config import SchedulerConfig
from sluice.scheduler.recovery import ServerRecovery
from sluice.scheduler.rendezvous import Rendezvous
from sluice.transport.wire import Kind, Message

CONFIG = SchedulerConfig(heartbeat_interval=1.0, heartbeat_timeout=5.0, rendezvous_timeout=30.0)


def msg(kind: Kind, **meta: Any) -> Message:
    return Message(kind, meta=meta)


def register(machine: Rendezvous, name: str, role: str, rank: int, now: float = 0.0,
             endpoint: str = "tcp://10.0.0.1:1000") -> list[tuple[str, Message]]:
    endpoints = [endpoint] if role == "server" else []
    return machine.on_message(name, msg(Kind.REGISTER, role=role, rank=rank, endpoints=endpoints, pid=7,
                                        fingerprint="cfg"), now)


def formed(recover: bool) -> Rendezvous:
    machine = Rendezvous(2, 2, 1 << 20, CONFIG, "cfg", now=0.0, bind_names=False,
                         recovery=ServerRecovery(recover, timeout=20.0))
    for rank in range(2):
        register(machine, f"server-{rank}", "server", rank)
    for rank in range(2):
        register(machine, f"worker-{rank}", "worker", rank)
    return machine


def declare(machine: Rendezvous, seq: int, name: str) -> list[tuple[str, Message]]:
    outs: list[tuple[str, Message]] = []
    for rank in range(2):
        outs += machine.on_message(f"worker-{rank}", msg(Kind.DECLARE, seq=seq, tensors=[[name, [4096], "float32",
                                                                                            None]]), 1.0)
    return outs


def test_a_replaced_server_is_welcomed_as_before_replanned_then_announced() -> None:
    machine = formed(recover=True)
    plans = [m for peer, m in declare(machine, 1, "a") if peer == "server-1"]
    for server in ("server-0", "server-1"):
        machine.on_message(server, msg(Kind.PLAN_ACK, seq=1), 1.5)
    plans += [m for peer, m in declare(machine, 2, "b") if peer == "server-1"]
    outs = register(machine, "server-1", "server", 1, now=3.0, endpoint="tcp://10.0.0.1:2000")
    assert [(peer, m.kind) for peer, m in outs] == [("server-1", Kind.WELCOME), ("server-1", Kind.PLAN),
                                                    ("server-1", Kind.PLAN)]
    assert (outs[0][1].meta or {})["node_id"] == 2 and (outs[0][1].meta or {})["rank"] == 1
    assert [m.meta for _, m in outs[1:]] == [m.meta for m in plans]
    assert machine.on_message("server-1", msg(Kind.PLAN_ACK, seq=1), 3.1) == []
    back = machine.on_message("server-1", msg(Kind.PLAN_ACK, seq=2), 3.2)
    # the ack of 2 also completes declaration 2 (server-0 acknowledges it next): workers get its plan then
    assert [(peer, m.kind) for peer, m in back] == [("worker-0", Kind.SERVER_BACK), ("worker-1", Kind.SERVER_BACK)]
    assert back[0][1].meta == {"node_id": 2, "rank": 1, "name": "server-1", "endpoints": ["tcp://10.0.0.1:2000"],
                               "incarnation": 1}
    done = machine.on_message("server-0", msg(Kind.PLAN_ACK, seq=2), 3.3)
    assert [(peer, m.kind) for peer, m in done] == [("worker-0", Kind.PLAN), ("worker-1", Kind.PLAN)]
    assert any("registered again (replacement 1); re-sending its 2 plans" in note for note in machine.notes)


def test_a_server_replaced_before_any_plan_is_announced_at_once() -> None:
    machine = formed(recover=True)
    outs = register(machine, "server-0", "server", 0, now=2.0, endpoint="tcp://10.0.0.1:3000")
    assert [(peer, m.kind) for peer, m in outs] == [("server-0", Kind.WELCOME), ("worker-0", Kind.SERVER_BACK),
                                                    ("worker-1", Kind.SERVER_BACK)]


def test_a_replacement_is_told_which_workers_left() -> None:
    """A worker's BYE went to the servers of then; the one replaced after it would wait for its pushes."""
    machine = formed(recover=True)
    bye = machine.on_message("worker-1", msg(Kind.BYE), 1.0)
    assert ("server-0", Kind.BYE) in [(peer, m.kind) for peer, m in bye]
    outs = register(machine, "server-0", "server", 0, now=2.0, endpoint="tcp://10.0.0.1:3000")
    assert [(peer, m.kind, m.meta.get("rank")) for peer, m in outs if peer == "server-0"] == [
        ("server-0", Kind.WELCOME, 0), ("server-0", Kind.BYE, 1)]


def test_without_recovery_a_second_registration_is_refused() -> None:
    machine = formed(recover=False)
    outs = register(machine, "server-1", "server", 1, now=2.0)
    assert [(peer, m.kind) for peer, m in outs] == [("server-1", Kind.ERROR)]
    assert "already formed" in (outs[0][1].meta or {})["error"]


def test_a_worker_cannot_come_back_as_a_server() -> None:
    machine = formed(recover=True)
    outs = register(machine, "worker-1", "server", 1, now=2.0)
    assert [m.kind for _, m in outs] == [Kind.ERROR]


def test_a_silent_server_gets_recover_timeout_more_before_the_job_fails() -> None:
    machine = formed(recover=True)
    for t in (1.0, 2.0, 6.0, 10.0, 20.0):
        for peer in ("server-0", "worker-0", "worker-1"):
            machine.on_message(peer, msg(Kind.HEARTBEAT), t)
        assert machine.on_tick(t) == []
    assert any("server 1 (node 2, pid 7) is silent; waiting up to 20 s for its replacement" in n for n in machine.notes)
    for peer in ("server-0", "worker-0", "worker-1"):
        machine.on_message(peer, msg(Kind.HEARTBEAT), 25.5)
    outs = machine.on_tick(25.5)
    assert machine.phase == "failed" and outs[0][1].kind == Kind.NODE_LOST
    assert "nor was it replaced within ps.recover_timeout = 20 s" in machine.error


def test_without_recovery_a_silent_server_fails_the_job_at_the_heartbeat_timeout() -> None:
    machine = formed(recover=False)
    for peer in ("server-0", "worker-0", "worker-1"):
        machine.on_message(peer, msg(Kind.HEARTBEAT), 5.5)
    machine.on_tick(5.5)
    assert machine.phase == "failed" and "server 1" in machine.error


def formed_with_replicas(hosts: tuple[str, ...], replicas: int = 1) -> Rendezvous:
    machine = Rendezvous(2, len(hosts), 1 << 20, CONFIG, "cfg", now=0.0, bind_names=False,
                         recovery=ServerRecovery(True, timeout=20.0, replicas=replicas))
    for rank, host in enumerate(hosts):
        register(machine, f"server-{rank}", "server", rank, endpoint=f"tcp://{host}:1000")
    for rank in range(2):
        register(machine, f"worker-{rank}", "worker", rank)
    return machine


def meta(message: Message) -> dict[str, Any]:
    return message.meta or {}


@pytest.mark.timeout(10)
def test_each_holder_gets_its_primarys_part_of_the_plan() -> None:
    plans = dict(declare(formed_with_replicas(("10.0.0.1", "10.0.0.2")), 1, "a"))
    assert meta(plans["server-0"])["mirrors"] == {"1": meta(plans["server-1"])["tensors"]}
    assert meta(plans["server-1"])["mirrors"] == {"0": meta(plans["server-0"])["tensors"]}
    same_host = dict(declare(formed_with_replicas(("10.0.0.1", "10.0.0.1")), 1, "a"))
    assert "mirrors" not in meta(same_host["server-0"])  # no other host: no mirror


@pytest.mark.timeout(10)
def test_a_server_back_on_its_holders_host_has_the_holder_release_the_mirror() -> None:
    machine = formed_with_replicas(("10.0.0.1", "10.0.0.2"))
    declare(machine, 1, "a")
    for server in ("server-0", "server-1"):
        machine.on_message(server, Message(Kind.PLAN_ACK, meta={"seq": 1}), 1.5)
    outs = register(machine, "server-1", "server", 1, now=3.0, endpoint="tcp://10.0.0.1:2000")
    assert [(peer, m.kind) for peer, m in outs][:3] == [("server-1", Kind.WELCOME), ("server-0", Kind.MIRROR_RELEASE),
                                                        ("server-1", Kind.PLAN)]
    assert meta(outs[1][1]) == {"rank": 1}
    back = machine.on_message("server-1", Message(Kind.PLAN_ACK, meta={"seq": 1}), 3.1)
    assert [(peer, m.kind) for peer, m in back] == [("worker-0", Kind.SERVER_BACK), ("worker-1", Kind.SERVER_BACK),
                                                     ("server-0", Kind.SERVER_BACK)]
    # a restart on its own host releases nothing: its own file is there
    again = register(machine, "server-0", "server", 0, now=4.0, endpoint="tcp://10.0.0.1:3000")
    assert Kind.MIRROR_RELEASE not in [m.kind for _, m in again]


@pytest.mark.timeout(10)
def test_with_two_replicas_the_welcomes_name_the_mirrors_and_a_moved_server_holds_none() -> None:
    """Three servers on three hosts, ps.replicas = 2. Server 2's host is lost: it comes back on server 0's host
    (its first holder), which releases it; from then on it is held by server 1 only and holds nothing. Then server
    0's host is lost: server 0 comes back on server 1's, the one holder of it left."""
    a, b, c = "10.0.0.1", "10.0.0.2", "10.0.0.3"
    machine = Rendezvous(2, 3, 1 << 20, CONFIG, "cfg", now=0.0, bind_names=False,
                         recovery=ServerRecovery(True, timeout=20.0, replicas=2))
    welcomes: dict[str, Message] = {}
    for rank, host in enumerate((a, b, c)):
        welcomes.update(register(machine, f"server-{rank}", "server", rank, endpoint=f"tcp://{host}:1000"))
    for rank in range(2):
        welcomes.update(register(machine, f"worker-{rank}", "worker", rank))
    assert {name: meta(m).get("mirror") for name, m in welcomes.items()} == {
        "server-0": {"holders": [1, 2], "holds": [1, 2]}, "server-1": {"holders": [2, 0], "holds": [0, 2]},
        "server-2": {"holders": [0, 1], "holds": [0, 1]}, "worker-0": None, "worker-1": None}
    plans = dict(declare(machine, 1, "a"))
    assert sorted(meta(plans["server-0"])["mirrors"]) == ["1", "2"]
    for server in ("server-0", "server-1", "server-2"):
        machine.on_message(server, Message(Kind.PLAN_ACK, meta={"seq": 1}), 1.5)
    outs = register(machine, "server-2", "server", 2, now=3.0, endpoint=f"tcp://{a}:2000")
    assert [(peer, m.kind) for peer, m in outs][:2] == [("server-2", Kind.WELCOME), ("server-0", Kind.MIRROR_RELEASE)]
    assert meta(outs[0][1])["mirror"] == {"holders": [1], "holds": []}
    machine.on_message("server-2", Message(Kind.PLAN_ACK, meta={"seq": 1}), 3.1)
    plans = dict(declare(machine, 2, "b"))
    assert sorted(meta(plans["server-0"])["mirrors"]) == ["1"] and sorted(meta(plans["server-1"])["mirrors"]) == [
        "0", "2"] and "mirrors" not in meta(plans["server-2"])
    for server in ("server-0", "server-1", "server-2"):
        machine.on_message(server, Message(Kind.PLAN_ACK, meta={"seq": 2}), 3.5)
    outs = register(machine, "server-0", "server", 0, now=4.0, endpoint=f"tcp://{b}:2000")
    assert [(peer, m.kind) for peer, m in outs][:2] == [("server-0", Kind.WELCOME), ("server-1", Kind.MIRROR_RELEASE)]
    assert meta(outs[0][1])["mirror"] == {"holders": [], "holds": []}


def test_a_replaced_aggregator_gets_its_plans_and_the_routings_in_use_then_is_announced() -> None:
    from sluice.scheduler.hierarchy.routes import Route, Routing

    machine = Rendezvous(2, 1, 1 << 20, CONFIG, "cfg", now=0.0, bind_names=False, aggregators=1,
                         recovery=ServerRecovery(True, timeout=20.0))
    register(machine, "server-0", "server", 0)
    machine.on_message("aggregator-0", msg(Kind.REGISTER, role="aggregator", rank=0, endpoints=["tcp://10.0.0.2:1"],
                                           pid=7, fingerprint="cfg"), 0.0)
    for rank in range(2):
        register(machine, f"worker-{rank}", "worker", rank)
    trees = (Route(1.0, {"worker-0": "aggregator-0", "worker-1": "aggregator-0"}),)
    machine.propose_routes(list(trees))
    machine.on_message("aggregator-0", msg(Kind.ROUTES_ACK, epoch=1), 0.5)
    for rank in range(2):
        machine.on_message(f"worker-{rank}", msg(Kind.ROUTES_ACK, epoch=1, rounds=[]), 0.6)
    first = [m for peer, m in declare(machine, 1, "a") if peer == "aggregator-0"]
    for node in ("server-0", "aggregator-0"):
        machine.on_message(node, msg(Kind.PLAN_ACK, seq=1), 1.5)
    # silent past the heartbeat timeout: with recovery an aggregator is waited for, as a server is
    assert machine.on_tick(6.0) == [] and machine.phase == "running"
    outs = machine.on_message("aggregator-0", msg(Kind.REGISTER, role="aggregator", rank=0,
                                                  endpoints=["tcp://10.0.0.2:2"], pid=8, fingerprint="cfg"), 7.0)
    assert [(peer, m.kind) for peer, m in outs] == [("aggregator-0", Kind.WELCOME), ("aggregator-0", Kind.PLAN),
                                                    ("aggregator-0", Kind.ROUTES)]
    assert outs[1][1].meta == first[0].meta
    assert outs[2][1].meta == {"routes": Routing(1, trees).encode(), "again": True}
    back = machine.on_message("aggregator-0", msg(Kind.PLAN_ACK, seq=1), 7.1)
    assert [(peer, m.kind) for peer, m in back] == [("worker-0", Kind.AGGREGATOR_BACK),
                                                    ("worker-1", Kind.AGGREGATOR_BACK)]
    node_id = (outs[0][1].meta or {})["node_id"]  # its old id
    assert back[0][1].meta == {"node_id": node_id, "rank": 0, "name": "aggregator-0",
                               "endpoints": ["tcp://10.0.0.2:2"], "incarnation": 1}
