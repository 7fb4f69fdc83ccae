"""A standby scheduler rebuilt from the nodes' REJOINs (scheduler.standby), driven with plain messages: failover."""

from __future__ import annotations

from typing import Any

import pytest

from sluice.scheduler.config import SchedulerConfig
from sluice.scheduler.recovery import ServerRecovery
from sluice.scheduler.rejoin import Recall
from sluice.scheduler.rendezvous import Out, Rendezvous
from sluice.transport.wire import Kind, Message, WireError

CONFIG = SchedulerConfig(heartbeat_interval=1.0, heartbeat_timeout=5.0, rendezvous_timeout=30.0)
WORKERS, SERVERS = 3, 2
ENDPOINTS = {"server-0": ["tcp://10.0.0.1:1"], "server-1": ["tcp://10.0.0.2:1"]}
SCHEDULER = "tcp://10.0.0.9:4000"  # the primary's endpoint: the job's name in the registries


def msg(kind: Kind, **meta: Any) -> Message:
    return Message(kind, meta=meta)


def tensors(*names: str) -> list[Any]:
    return [[name, [64, 33], "float32", None] for name in names]


class Job:
    """A primary scheduler with its nodes' memories (what each would tell a standby)."""

    def __init__(self) -> None:
        self.machine = Rendezvous(WORKERS, SERVERS, 4096, CONFIG, "cfg", now=0.0, recovery=ServerRecovery(True))
        self.recall = {f"worker-{r}": Recall() for r in range(WORKERS)}
        self.ids: dict[str, int] = {}
        self.last: dict[str, Message] = {}
        for name in [*ENDPOINTS, *self.recall]:
            role, rank = name.split("-")
            outs = self.machine.on_message(name, msg(Kind.REGISTER, role=role, rank=int(rank),
                                                     endpoints=ENDPOINTS.get(name, []), pid=7, fingerprint="cfg"), 0)
        self.ids = {peer: m.meta["node_id"] for peer, m in outs}

    def deliver(self, outs: list[Out], seqs: dict[int, tuple[int, list[int] | None, list[Any]]]) -> None:
        for peer, m in outs:
            if m.kind == Kind.PLAN and peer in self.recall:
                seq, ranks, table = seqs[int(peer.split("-")[1])]
                self.recall[peer].planned(m, seq, ranks, table)
            elif peer in self.recall:
                self.recall[peer].on_message(m)

    def declare(self, seq: int, table: list[Any], ranks: list[int] | None = None) -> list[Out]:
        members = ranks if ranks is not None else list(range(WORKERS))
        outs: list[Out] = []
        for rank in members:
            extra = {"ranks": ranks} if ranks is not None else {}
            outs += self.machine.on_message(f"worker-{rank}", msg(Kind.DECLARE, seq=seq, tensors=table, **extra), 1)
        key = next(m.meta["seq"] for p, m in outs if p == "server-0")
        for server in ENDPOINTS:
            outs += self.machine.on_message(server, msg(Kind.PLAN_ACK, seq=key), 1)
        self.deliver(outs, dict.fromkeys(members, (seq, ranks, table)))
        return outs

    def rejoin(self, name: str, **changes: Any) -> Message:
        role, rank = name.split("-")
        recall = self.recall.get(name, Recall())
        meta = recall.rejoin_meta(role, int(rank), self.ids[name], ENDPOINTS.get(name, []), 7, "cfg",
                                  SCHEDULER) | changes
        return msg(Kind.REJOIN, **meta)


def served(job: Job) -> Job:
    job.declare(0, tensors("a", "b"))
    job.declare(0, tensors("c"), ranks=[0, 1])  # a process set's: key -1 on the servers
    job.last = {p: m for p, m in job.declare(1, tensors("d")) if m.kind == Kind.PLAN}
    return job


def standby() -> Rendezvous:
    return Rendezvous(WORKERS, SERVERS, 4096, CONFIG, "cfg", now=0.0, standby=True, recovery=ServerRecovery(True))


def take_over(job: Job, machine: Rendezvous, names: list[str], now: float = 10.0) -> list[Out]:
    outs: list[Out] = []
    for name in names:
        outs += machine.on_message(name, job.rejoin(name), now)
    return outs


def test_failover_standby_rebuilds_the_plans_loads_and_keys_of_the_scheduler() -> None:
    job = served(Job())
    machine = standby()
    names = [*ENDPOINTS, *job.recall]
    outs = take_over(job, machine, names[:-1])
    assert machine.phase == "standby" and {m.kind for _, m in outs} == {Kind.HEARTBEAT_ACK}
    outs = take_over(job, machine, names[-1:])
    welcomes = {peer: m.meta for peer, m in outs if m.kind == Kind.WELCOME}
    assert machine.phase == "running" and set(welcomes) == set(names)
    assert all(w["rejoined"] is True and w["node_id"] == job.ids[p] for p, w in welcomes.items())
    primary = job.machine
    assert machine._planned == primary._planned and machine._loads == primary._loads
    assert machine._set_seqs == primary._set_seqs and machine.limits == primary.limits
    assert machine.recovery.plans == primary.recovery.plans
    # the next declaration plans as the scheduler would have planned it
    after_standby = [m.meta for p, m in _declare(machine, 2, tensors("e")) if p in ENDPOINTS]
    after_primary = [m.meta for p, m in _declare(primary, 2, tensors("e")) if p in ENDPOINTS]
    assert after_standby == after_primary and after_standby


def _declare(machine: Rendezvous, seq: int, table: list[Any]) -> list[Out]:
    outs: list[Out] = []
    for rank in range(WORKERS):
        outs += machine.on_message(f"worker-{rank}", msg(Kind.DECLARE, seq=seq, tensors=table), 20)
    return outs


def test_failover_answers_what_a_worker_missed_before_the_takeover() -> None:
    job = served(Job())
    job.recall["worker-0"].released.append("epoch-1")  # released on worker 0 only, then the scheduler died
    machine = standby()
    take_over(job, machine, [*ENDPOINTS, *job.recall])
    outs = machine.on_message("worker-2", msg(Kind.DECLARE, seq=1, tensors=tensors("d")), 11)
    assert [(p, m.kind, m.meta) for p, m in outs] == [("worker-2", Kind.PLAN, job.last["worker-2"].meta)]
    assert outs[0][1].meta["order"] == 2 and outs[0][1].meta["key"] == 1
    outs = machine.on_message("worker-1", msg(Kind.BARRIER, name="epoch-1"), 11)
    assert [(p, m.kind) for p, m in outs] == [("worker-1", Kind.RELEASE)]
    assert machine.on_message("worker-1", msg(Kind.BARRIER, name="epoch-2"), 11) == []
    # worker 0 passed epoch-1 before the takeover: its next barrier of that name waits for every worker
    assert machine.on_message("worker-0", msg(Kind.BARRIER, name="epoch-1"), 11) == []
    outs = machine.on_message("worker-2", msg(Kind.BARRIER, name="epoch-1"), 11)
    assert [(p, m.kind) for p, m in outs] == [("worker-2", Kind.RELEASE)]  # it missed the release too
    assert machine.on_message("worker-1", msg(Kind.BARRIER, name="epoch-1"), 11) == []
    outs = machine.on_message("worker-2", msg(Kind.BARRIER, name="epoch-1"), 11)
    assert sorted(p for p, m in outs if m.kind == Kind.RELEASE) == ["worker-0", "worker-1", "worker-2"]


def test_failover_waits_for_every_node_but_the_workers_gone_and_names_the_missing() -> None:
    job = served(Job())
    job.recall["worker-0"].gone.add(2)
    machine = standby()
    outs = take_over(job, machine, ["server-0", "server-1", "worker-0", "worker-1"])
    assert machine.phase == "running" and "worker-2" in machine.byes
    lost = standby()
    take_over(Job(), lost, ["server-0", "worker-0", "worker-1", "worker-2"], now=10.0)
    assert lost.phase == "standby" and lost.on_tick(14.0) == []
    outs = lost.on_tick(15.5)
    assert lost.phase == "failed" and "server-1 did not rejoin the standby" in outs[0][1].meta["error"]


@pytest.mark.parametrize(("name", "changes", "problem"), [
    ("worker-0", {"rank": 1}, "from a connection named"),
    ("worker-0", {"fingerprint": "other"}, "different configuration"),
    ("worker-0", {"node_id": 99}, "not in 1..5"),
    ("worker-0", {"declarations": [[0, 0, 0, None]]}, "must be \\[order, key, seq, ranks, tensors\\]"),
    ("worker-0", {"declarations": [[0, 0, 0, [7], []]]}, "ranks must be a list of ints in 0..2"),
    ("server-0", {"declarations": [[0, 0, 0, None, []]]}, "server's REJOIN names 1 declarations"),
    ("worker-0", {"gone": ["x"]}, "gone workers"),
    ("worker-0", {"limits": [1, 2]}, "limits must be"),
    ("worker-0", {"released": [1]}, "released barriers"),
    ("worker-0", {"job": ""}, "job must name the scheduler's endpoint"),
    ("worker-0", {"job": "x" * 201}, "job must name the scheduler's endpoint"),
    ("worker-0", {"job": 7}, "job"),
    # a survivor's connection from before its job re-formed in place, at the next generation's standby
    ("worker-0", {"generation": 1}, "rejoins from generation 1 of the job; this standby serves generation 0"),
    ("worker-0", {"generation": "0"}, "generation"),
])
def test_failover_standby_refuses_a_malformed_rejoin(name: str, changes: dict[str, Any], problem: str) -> None:
    job = served(Job())
    machine = standby()
    with pytest.raises(WireError, match=problem):
        machine.on_message(name, job.rejoin(name, **changes), 1.0)
    assert machine.phase == "standby" and not machine.takeover.rejoins  # type: ignore[union-attr]


def test_failover_standby_takes_nothing_else_and_refuses_a_node_id_twice() -> None:
    job = served(Job())
    machine = standby()
    with pytest.raises(WireError, match="takes only REJOINs"):
        machine.on_message("worker-0", msg(Kind.DECLARE, seq=0, tensors=[]), 1.0)
    machine.on_message("worker-0", job.rejoin("worker-0"), 1.0)
    with pytest.raises(WireError, match="which another node has"):
        machine.on_message("worker-1", job.rejoin("worker-1", node_id=job.ids["worker-0"]), 1.0)
    assert machine.on_message("worker-0", msg(Kind.HEARTBEAT), 1.5)[0][1].kind == Kind.HEARTBEAT_ACK
    assert machine.on_message("worker-2", msg(Kind.HEARTBEAT), 1.5) == []


def test_failover_standby_keeps_the_jobs_name_and_refuses_a_node_of_another_job() -> None:
    """The standby publishes the job in the registries under the name the nodes rejoin with (the silent
    scheduler's endpoint), so the job is not listed twice; a node naming another scheduler is refused."""
    job = served(Job())
    machine = standby()
    assert machine.takeover is not None and machine.takeover.job() == ""
    machine.on_message("server-0", job.rejoin("server-0"), 1.0)
    with pytest.raises(WireError, match=r"from the job of the scheduler at 'tcp://10\.0\.0\.8:4000'"):
        machine.on_message("worker-0", job.rejoin("worker-0", job="tcp://10.0.0.8:4000"), 1.0)
    take_over(job, machine, ["server-1", *job.recall], now=1.5)
    assert machine.phase == "running" and machine.takeover.job() == SCHEDULER


@pytest.mark.timeout(20)
def test_failover_a_standby_whose_scheduler_port_is_silent_and_nobody_rejoined_leaves() -> None:
    """scheduler/standby_watch.py, against a real listening socket: heard while it listens; once it is gone, the
    standby leaves after `patience`, unless a node rejoined (then it takes over)."""
    import socket

    from sluice.scheduler.standby_watch import SchedulerWatch, probe

    listener = socket.create_server(("127.0.0.1", 0))
    endpoint = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    assert probe(endpoint, 0.5) and not probe("tcp://nowhere", 0.5) and not probe("ipc:///x", 0.5)
    watch = SchedulerWatch(endpoint, interval=1.0, patience=3.0, now=0.0)
    assert watch.tick(1.0, rejoined=False) is None
    listener.close()
    assert watch.tick(1.5, rejoined=False) is None  # before the next probe
    assert watch.tick(2.0, rejoined=False) is None  # silent 1 s
    assert watch.tick(5.0, rejoined=True) is None  # a node rejoined: the takeover goes on
    why = watch.tick(5.0, rejoined=False)
    assert why is not None and endpoint in why and "nothing to take over" in why


@pytest.mark.timeout(10)
def test_failover_with_replicas_places_the_copies_where_the_servers_say_they_are_now() -> None:
    """ps.replicas: a standby takes the placement from the servers' word (a server that moved before the takeover
    holds nothing, and its primaries dropped it), not from their endpoints, which would place copies anew:
    server 1 says it holds server 0's copy and has none of its own left, so the next plan gives server 1 server
    0's part and server 0 nobody's; a malformed word is refused."""
    job = Job()
    machine = Rendezvous(WORKERS, SERVERS, 4096, CONFIG, "cfg", now=0.0, standby=True,
                         recovery=ServerRecovery(True, replicas=1))
    outs: list[Out] = []
    said = {"server-0": {"holders": [1], "holds": []}, "server-1": {"holders": [], "holds": [0]}}
    for name in [*ENDPOINTS, *job.recall]:
        outs += machine.on_message(name, msg(Kind.REJOIN, **(job.rejoin(name).meta or {}),
                                             **({"mirror": said[name]} if name in said else {})), 10.0)
    assert machine.phase == "running"
    plans = {p: m.meta or {} for p, m in _declare(machine, 2, tensors("e")) if m.kind == Kind.PLAN}
    assert set(plans["server-1"]["mirrors"]) == {"0"} and "mirrors" not in plans["server-0"]
    other = standby()
    with pytest.raises(WireError, match=r"mirror holders must be a list of ints in 0\.\.1"):
        other.on_message("server-0", msg(Kind.REJOIN, **(job.rejoin("server-0").meta or {}),
                                         mirror={"holders": [5], "holds": []}), 10.0)


def test_failover_a_process_set_half_declared_when_the_scheduler_died_gets_a_key_of_its_own() -> None:
    """Set {0, 1} took key -1 at worker 0's declaration; set {1, 2} declared fully and was planned as -2; then the
    scheduler died. The standby learns only -2 (what a worker saw planned): {0, 1} must not get -2 again, which
    would answer its workers with {1, 2}'s plan (they then waited for theirs until a timeout)."""
    job = Job()
    job.machine.on_message("worker-0", msg(Kind.DECLARE, seq=0, tensors=tensors("y"), ranks=[0, 1]), 1)
    job.declare(0, tensors("z"), ranks=[1, 2])
    machine = standby()
    take_over(job, machine, [*ENDPOINTS, *job.recall])
    outs: list[Out] = []
    for rank in (0, 1):
        outs += machine.on_message(f"worker-{rank}", msg(Kind.DECLARE, seq=0, tensors=tensors("y"), ranks=[0, 1]), 11)
    assert {p for p, m in outs if m.kind == Kind.PLAN} == set(ENDPOINTS)  # planned anew: the servers first
    key = next(m.meta["seq"] for p, m in outs if p == "server-0")
    for server in ENDPOINTS:
        outs += machine.on_message(server, msg(Kind.PLAN_ACK, seq=key), 12)
    plans = {p: [t[1] for t in m.meta["tensors"]] for p, m in outs if m.kind == Kind.PLAN and p in job.recall}
    assert key == -3 and plans == {"worker-0": ["y"], "worker-1": ["y"]}, plans
    assert sorted(machine._set_seqs.values()) == [-3, -2]


def test_failover_a_declaration_no_worker_saw_planned_before_one_they_saw_fails_the_takeover_naming_it() -> None:
    """Set {0, 2} was planned first (the servers have its keys), set {1} next; the scheduler died with the first
    set's PLANs not yet at its workers, the second's delivered. Replayed alone, {1}'s tensor would take {0, 2}'s key,
    which the servers hold for that set: its pushes refused, its worker waiting until op_timeout. The standby fails
    the job at once, saying why."""
    job = Job()
    for rank in (0, 2):  # planned, and acknowledged by the servers, but its workers' PLANs lost
        outs = job.machine.on_message(f"worker-{rank}", msg(Kind.DECLARE, seq=0, tensors=tensors("y"), ranks=[0, 2]),
                                      1)
    key = next(m.meta["seq"] for p, m in outs if p == "server-0")
    for server in ENDPOINTS:
        job.machine.on_message(server, msg(Kind.PLAN_ACK, seq=key), 1)
    job.declare(0, tensors("z"), ranks=[1])
    assert [d[0] for d in job.recall["worker-1"].declarations] == [1]  # planned second
    machine = standby()
    take_over(job, machine, [*ENDPOINTS, *job.recall])
    assert machine.phase == "failed", machine.phase
    assert machine.error is not None and "no worker saw declaration 0 (in planning order) planned, but later ones " \
        "were" in machine.error, machine.error


def test_failover_a_goodbye_the_scheduler_told_some_nodes_only_is_told_the_others_at_the_takeover() -> None:
    job = served(Job())
    bye = job.machine.on_message("worker-2", msg(Kind.BYE), 5)
    assert {p for p, m in bye if m.kind == Kind.BYE} == {"server-0", "server-1", "worker-0", "worker-1"}
    job.deliver([(p, m) for p, m in bye if p == "worker-0"], {})  # then the scheduler died: only worker 0 heard
    machine = standby()
    outs = take_over(job, machine, [*ENDPOINTS, "worker-0", "worker-1"])
    assert sorted((p, m.meta["rank"]) for p, m in outs if m.kind == Kind.BYE) == [
        ("server-0", 2), ("server-1", 2), ("worker-1", 2)]
