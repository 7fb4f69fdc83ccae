"""The scheduler's state machine, driven with plain messages and a fake clock."""

from __future__ import annotations

from typing import Any

import pytest

from sluice.scheduler.config import SchedulerConfig
from sluice.scheduler.declaration import table_mismatch
from sluice.scheduler.partition import TensorSpec
from sluice.scheduler.rendezvous import Rendezvous
from sluice.transport.wire import Kind, Message, WireError

CONFIG = SchedulerConfig(heartbeat_interval=1.0, heartbeat_timeout=5.0, rendezvous_timeout=30.0)


def msg(kind: Kind, **meta: Any) -> Message:
    return Message(kind, meta=meta)


def register(machine: Rendezvous, name: str, role: str, rank: int = -1, now: float = 0.0) -> list[Any]:
    endpoints = [f"tcp://127.0.0.1:{1000 + len(machine.nodes)}"] if role == "server" else []
    return machine.on_message(
        name, msg(Kind.REGISTER, role=role, rank=rank, endpoints=endpoints, pid=1, fingerprint="cfg"), now
    )


def formed(workers: int = 2, servers: int = 1) -> Rendezvous:
    machine = Rendezvous(workers, servers, 1 << 20, CONFIG, "cfg", now=0.0, bind_names=False)
    for s in range(servers):
        register(machine, f"s{s}", "server")
    for w in range(workers):
        register(machine, f"w{w}", "worker", rank=workers - 1 - w)
    assert machine.phase == "running"
    return machine


def test_ids_and_ranks_are_assigned_when_all_arrive() -> None:
    machine = Rendezvous(2, 2, 1 << 20, CONFIG, "cfg", now=0.0, bind_names=False)
    assert register(machine, "a", "worker", rank=1) == []
    assert register(machine, "b", "server") == []
    assert register(machine, "c", "server") == []
    outs = register(machine, "d", "worker")
    welcome = {peer: m.meta for peer, m in outs}
    assert {p: (m["role"], m["rank"], m["node_id"]) for p, m in welcome.items()} == {
        "b": ("server", 0, 1), "c": ("server", 1, 2), "d": ("worker", 0, 3), "a": ("worker", 1, 4),
    }
    assert all(m.kind == Kind.WELCOME for _, m in outs)


@pytest.mark.parametrize(
    ("meta", "problem"),
    [
        ({"role": "chef"}, "unknown role"),
        ({"role": "server", "rank": 0, "endpoints": [], "pid": 1, "fingerprint": "cfg"}, "non-empty"),
        ({"role": "worker", "rank": "x", "endpoints": [], "pid": 1, "fingerprint": "cfg"}, "rank"),
    ],
)
def test_malformed_registration_is_rejected(meta: dict[str, Any], problem: str) -> None:
    machine = Rendezvous(1, 1, 1 << 20, CONFIG, "cfg", now=0.0, bind_names=False)
    with pytest.raises(WireError, match=problem):
        machine.on_message("x", Message(Kind.REGISTER, meta=meta), 0.0)


def test_other_configuration_is_refused() -> None:
    machine = Rendezvous(1, 1, 1 << 20, CONFIG, "cfg", now=0.0, bind_names=False)
    outs = machine.on_message(
        "x", msg(Kind.REGISTER, role="worker", rank=0, endpoints=[], pid=1, fingerprint="other"), 0.0
    )
    assert outs[0][1].kind == Kind.ERROR and "different configuration" in outs[0][1].meta["error"]


def test_rendezvous_timeout_counts_who_came() -> None:
    machine = Rendezvous(2, 1, 1 << 20, CONFIG, "cfg", now=0.0, bind_names=False)
    register(machine, "w", "worker")
    assert machine.on_tick(29.0) == []
    outs = machine.on_tick(31.0)
    assert machine.exit_code == 1
    assert "1 of 2 workers and 0 of 1 servers" in outs[0][1].meta["error"]


def test_silent_node_is_declared_lost_to_everyone_else() -> None:
    machine = formed()
    machine.on_message("w0", msg(Kind.HEARTBEAT), 4.0)
    machine.on_message("s0", msg(Kind.HEARTBEAT), 4.0)
    outs = machine.on_tick(5.5)  # w1 last seen at 0.0
    assert sorted(peer for peer, _ in outs) == ["s0", "w0"]
    assert all(m.kind == Kind.NODE_LOST and "worker 0" in m.meta["error"] for _, m in outs)
    assert machine.phase == "failed"


def test_declare_plans_on_servers_before_workers() -> None:
    machine = formed(workers=2, servers=1)
    table = [["b", [2], "float32", None], ["a", [3], "float32", {"name": "sgd", "lr": 0.1}]]
    assert machine.on_message("w0", msg(Kind.DECLARE, seq=0, tensors=table), 1.0) == []
    outs = machine.on_message("w1", msg(Kind.DECLARE, seq=0, tensors=list(reversed(table))), 1.0)
    assert [(p, m.kind) for p, m in outs] == [("s0", Kind.PLAN)]
    shard = outs[0][1].meta["tensors"]
    assert sorted(t[1] for t in shard) == ["a", "b"]
    outs = machine.on_message("s0", msg(Kind.PLAN_ACK, seq=0), 1.0)
    assert sorted(p for p, _ in outs) == ["w0", "w1"]
    plan = outs[0][1].meta["tensors"]
    # w1 holds rank 0 (formed() hands ranks out in reverse), so its order sets keys and priorities
    assert [(k, name, priority) for k, name, _, _, priority, _ in plan] == [(0, "a", 0), (1, "b", 1)]


def test_a_declaration_asked_again_is_answered_as_the_first_at_every_stage() -> None:
    """A worker sends its DECLARE again while it waits (its PLAN may have been dropped in a brief disconnect)."""
    machine = formed(workers=2, servers=1)
    table = [["a", [3], "float32", None]]
    assert machine.on_message("w0", msg(Kind.DECLARE, seq=0, tensors=table), 1.0) == []
    assert machine.on_message("w0", msg(Kind.DECLARE, seq=0, tensors=table), 2.0) == []  # still waiting for w1
    outs = machine.on_message("w1", msg(Kind.DECLARE, seq=0, tensors=table), 3.0)
    assert [(p, m.kind) for p, m in outs] == [("s0", Kind.PLAN)]  # planned once
    assert machine.on_message("w1", msg(Kind.DECLARE, seq=0, tensors=table), 4.0) == []  # not planned again
    outs = machine.on_message("s0", msg(Kind.PLAN_ACK, seq=0), 5.0)
    assert sorted(p for p, _ in outs) == ["w0", "w1"]
    first = outs[0][1]
    again = machine.on_message("w0", msg(Kind.DECLARE, seq=0, tensors=table), 6.0)
    assert [(p, m.kind, m.meta) for p, m in again] == [("w0", Kind.PLAN, first.meta)]  # the same PLAN, to it alone
    # the next declaration is a new one, and a set's is answered again under its own numbering
    assert machine.on_message("w0", msg(Kind.DECLARE, seq=1, tensors=[["b", [2], "float32", None]]), 7.0) == []
    sets = [machine.on_message(w, msg(Kind.DECLARE, seq=0, tensors=[["s", [2], "float32", None]], ranks=[0, 1]), 8.0)
            for w in ("w0", "w1")]
    assert sets[0] == [] and [m.kind for _, m in sets[1]] == [Kind.PLAN]
    outs = machine.on_message("s0", msg(Kind.PLAN_ACK, seq=-1), 9.0)
    again = machine.on_message("w1", msg(Kind.DECLARE, seq=0, tensors=[["s", [2], "float32", None]], ranks=[0, 1]),
                               10.0)
    assert [(p, m.meta["seq"], m.meta["ranks"]) for p, m in again] == [("w1", 0, [0, 1])]
    assert again[0][1] is outs[0][1]


def test_a_process_sets_declaration_waits_for_its_workers_only_and_is_numbered_apart() -> None:
    machine = formed(workers=3, servers=1)  # w2 is rank 0, w1 rank 1, w0 rank 2
    table = [["set1.g", [4], "float32", None]]
    assert machine.on_message("w0", msg(Kind.DECLARE, seq=0, tensors=table, ranks=[0, 2]), 1.0) == []
    job = machine.on_message("w1", msg(Kind.DECLARE, seq=0, tensors=[["g", [2], "float32", None]]), 1.0)
    assert job == []  # the job's declaration 0 waits for every worker; the set's is another one
    outs = machine.on_message("w2", msg(Kind.DECLARE, seq=0, tensors=table, ranks=[0, 2]), 1.0)
    assert [(p, m.kind, m.meta["seq"]) for p, m in outs] == [("s0", Kind.PLAN, -1)]
    assert outs[0][1].meta["tensors"][0][5] == [0, 2]  # the server counts only the set's ranks
    outs = machine.on_message("s0", msg(Kind.PLAN_ACK, seq=-1), 1.0)
    assert sorted((p, m.meta["seq"], tuple(m.meta["ranks"])) for p, m in outs) == [("w0", 0, (0, 2)),
                                                                                   ("w2", 0, (0, 2))]
    with pytest.raises(WireError, match="ranks must be the sorted, distinct ranks"):
        machine.on_message("w1", msg(Kind.DECLARE, seq=1, tensors=table, ranks=[0, 2]), 1.0)  # not a member


def test_table_mismatch_in_words() -> None:
    ref = [TensorSpec("a", (2,), "float32"), TensorSpec("b", (3,), "float32")]
    assert table_mismatch(ref, list(reversed(ref)), 1) is None
    assert "does not declare tensor 'b'" in str(table_mismatch(ref, ref[:1], 1))
    assert "as float16[2]" in str(table_mismatch(ref, [TensorSpec("a", (2,), "float16"), ref[1]], 3))
    assert "'c' that worker 0 does not" in str(table_mismatch(ref, [*ref, TensorSpec("c", (1,), "int8")], 1))


def test_barrier_releases_when_all_arrive_and_bye_ends_the_job() -> None:
    machine = formed()
    assert machine.on_message("w0", msg(Kind.BARRIER, name="x"), 1.0) == []
    outs = machine.on_message("w1", msg(Kind.BARRIER, name="x"), 1.0)
    assert sorted((p, m.kind) for p, m in outs) == [("w0", Kind.RELEASE), ("w1", Kind.RELEASE)]
    # servers and workers hear who left (w0 holds rank 1); the worker leaving is told its goodbye was heard
    outs = machine.on_message("w0", msg(Kind.BYE), 2.0)
    assert [(p, m.kind, m.meta) for p, m in outs] == [("w0", Kind.SHUTDOWN, {}), ("s0", Kind.BYE, {"rank": 1}),
                                                      ("w1", Kind.BYE, {"rank": 1})]
    outs = machine.on_message("w1", msg(Kind.BYE), 2.0)
    assert [(p, m.kind) for p, m in outs] == [("w1", Kind.SHUTDOWN), ("s0", Kind.SHUTDOWN)]
    assert machine.exit_code == 0


def test_a_goodbye_with_an_error_is_passed_on_to_the_others_and_a_malformed_one_refused() -> None:
    machine = formed(workers=3)
    with pytest.raises(WireError, match="a goodbye's error must be a string"):
        machine.on_message("w2", msg(Kind.BYE, error=7), 1.0)
    with pytest.raises(WireError, match="at most 240 characters"):
        machine.on_message("w2", msg(Kind.BYE, error="x" * 241), 1.0)
    outs = machine.on_message("w2", msg(Kind.BYE, error="RuntimeError: boom\x1b[2J"), 2.0)  # w2 holds rank 0
    assert [(p, m.kind, m.meta) for p, m in outs] == [
        ("w2", Kind.SHUTDOWN, {}), ("s0", Kind.BYE, {"rank": 0, "error": "RuntimeError: boom?[2J"}),
        ("w1", Kind.BYE, {"rank": 0, "error": "RuntimeError: boom?[2J"}),
        ("w0", Kind.BYE, {"rank": 0, "error": "RuntimeError: boom?[2J"})]
    assert machine.left_with_error == {0: "RuntimeError: boom?[2J"}
    assert machine.notes[-1] == "worker 0 (node 2, pid 1) has left the job with an error (RuntimeError: boom?[2J)"
    machine.on_message("w1", msg(Kind.BYE), 3.0)
    machine.on_message("w0", msg(Kind.BYE), 3.0)
    assert machine.phase == "done" and machine.exit_code == 0  # the launcher judges by the workers' exit codes


def test_unregistered_peer_is_rejected() -> None:
    machine = formed()
    with pytest.raises(WireError, match="unregistered"):
        machine.on_message("stranger", msg(Kind.HEARTBEAT), 1.0)


def _declare_with(machine: Rendezvous, proposals: dict[str, Any]) -> list[Any]:
    table = [["w", [1 << 20], "float32", None]]
    outs: list[Any] = []
    for peer, limits in proposals.items():
        extra = {"limits": limits} if limits is not None else {}
        outs = machine.on_message(peer, msg(Kind.DECLARE, seq=0, tensors=table, **extra), 1.0)
    return outs


@pytest.mark.parametrize(
    ("configured", "proposals", "limits", "chunks"),
    [
        # (chunk, in-flight) configured (0: calibrate) -> what the workers propose -> settled limits, chunks of "w"
        ((0, 0), {"w0": [1 << 17, 1 << 18], "w1": [1 << 20, 1 << 21]}, [1 << 17, 1 << 21], 32),
        ((0, 0), {"w0": None, "w1": None}, [1 << 20, 16 << 20], 4),  # nobody calibrated: the defaults
        ((1 << 16, 0), {"w0": [1 << 20, 1 << 21], "w1": [1 << 20, 1 << 21]}, [1 << 16, 1 << 21], 64),
        ((0, 1 << 19), {"w0": [1 << 18, 1 << 21], "w1": [1 << 18, 1 << 21]}, [1 << 18, 1 << 19], 16),
    ],
)
def test_the_first_declaration_settles_chunk_size_and_inflight_bound(
    configured: tuple[int, int], proposals: dict[str, Any], limits: list[int], chunks: int
) -> None:
    machine = Rendezvous(2, 1, configured[0], CONFIG, "cfg", now=0.0, inflight_bytes=configured[1],
                         bind_names=False)
    register(machine, "s0", "server")
    register(machine, "w0", "worker")
    register(machine, "w1", "worker")
    outs = _declare_with(machine, proposals)
    assert outs[0][1].meta["limits"] == limits
    assert len(outs[0][1].meta["tensors"][0][4]) == chunks  # 4 MiB of float32 in chunks of the settled size
    assert machine.notes and f"chunk size {limits[0] >> 10} KiB" in machine.notes[0]
    workers = machine.on_message("s0", msg(Kind.PLAN_ACK, seq=0), 1.0)
    assert all(m.meta["limits"] == limits for _, m in workers)


def test_later_proposals_do_not_change_the_settled_limits() -> None:
    machine = Rendezvous(1, 1, 0, CONFIG, "cfg", now=0.0, bind_names=False)
    register(machine, "s0", "server")
    register(machine, "w0", "worker")
    first = msg(Kind.DECLARE, seq=0, tensors=[["a", [4], "float32", None]], limits=[1 << 17, 1 << 18])
    machine.on_message("w0", first, 1.0)
    machine.on_message("s0", msg(Kind.PLAN_ACK, seq=0), 1.0)
    later = msg(Kind.DECLARE, seq=1, tensors=[["b", [4], "float32", None]], limits=[1 << 20, 1 << 22])
    outs = machine.on_message("w0", later, 1.0)
    assert outs[0][1].meta["limits"] == [1 << 17, 1 << 18]


@pytest.mark.parametrize("bad", [[1], [1 << 20], "x", [1 << 20, 0], [100, 1 << 20], [1.5, 2], [True, 1 << 20]])
def test_malformed_limits_are_rejected(bad: Any) -> None:
    machine = formed(workers=1, servers=1)
    with pytest.raises(WireError, match="limits"):
        machine.on_message("w0", msg(Kind.DECLARE, seq=0, tensors=[["a", [4], "float32", None]], limits=bad), 1.0)


def test_a_node_registers_only_under_its_own_name() -> None:
    """With CURVE the connection's name is proven by its key: worker-1 cannot register as worker 0, and
    a stranger's connection cannot register as anyone; the real worker 0 is still admitted."""
    machine = Rendezvous(2, 1, 1 << 20, CONFIG, "cfg", now=0.0)
    register(machine, "server-0", "server", rank=0)
    with pytest.raises(WireError, match="REGISTER as worker 0 from a connection named 'worker-1'"):
        register(machine, "worker-1", "worker", rank=0)
    with pytest.raises(WireError, match="from a connection named 'stranger'"):
        register(machine, "stranger", "worker", rank=1)
    register(machine, "worker-0", "worker", rank=0)
    outs = register(machine, "worker-1", "worker", rank=1)
    assert machine.phase == "running"
    assert sorted(peer for peer, _ in outs) == ["server-0", "worker-0", "worker-1"]
