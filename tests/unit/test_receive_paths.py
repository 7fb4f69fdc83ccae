"""Hostile messages to every pure receive path: only WireError escapes, a rejected message changes nothing,
and the object keeps working afterwards (a round still sums right, the rendezvous still admits the real
nodes, a node still takes its WELCOME and PLAN). Messages are generated, then passed through encode and
decode, so each is one a receiver can really get."""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluice.errors import SluiceError
from sluice.ps.store import ShardStore
from sluice.scheduler.bootstrap import NodeEnv
from sluice.scheduler.config import SchedulerConfig
from sluice.scheduler.declaration import parse_limits, parse_tensor_table
from sluice.scheduler.node import ControlClient
from sluice.scheduler.rendezvous import Rendezvous
from sluice.transport.wire import CONTROL_HEADER_BYTES, DTYPES, VERSION, Flag, Kind, Message, WireError, decode, encode

pytestmark = pytest.mark.timeout(60)
PROPERTY = settings(max_examples=120, derandomize=True, database=None, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# ------------------------------------------------------------------------------------------ strategies
#: ints a receiver may mistake for sizes, ranks or ids: the edges of every range and msgpack's extremes
edge_ints = st.integers(-3, 12) | st.sampled_from([1 << 31, 1 << 40, (1 << 63) - 1, -(1 << 63), (1 << 64) - 1])
#: anything but a plausible int: wrong types, nested values, floats that int() cannot take
junk = (
    st.sampled_from([None, True, False, float("inf"), float("-inf"), float("nan"), 1e300, "", b"", [], {}])
    | st.floats() | st.text(max_size=6) | st.binary(max_size=6)
    | st.lists(st.integers(-2, 5) | st.text(max_size=2), max_size=6)
    | st.dictionaries(st.text(max_size=3), st.integers(-2, 3) | st.none(), max_size=2)
    | st.recursive(st.none(), lambda inner: st.lists(inner, max_size=2), max_leaves=40)  # nested deep-ish
)
anything = edge_ints | junk
names = st.text(max_size=8) | st.just("x" * 5000) | anything
endpoints = st.lists(st.sampled_from(["tcp://127.0.0.1:5000", ""]) | anything, max_size=3) | anything
opt = st.none() | anything | st.fixed_dictionaries(
    {"name": st.sampled_from(["sgd", "adam", "lbfgs"]) | anything},
    optional={key: st.floats() | edge_ints | anything for key in ("lr", "momentum", "beta1", "eps", "weight_decay")}
    | {"nesterov": st.booleans() | anything},
)
tensor_entry = st.tuples(names, st.lists(edge_ints, max_size=4) | anything,
                         st.sampled_from([*DTYPES, "complex64"]) | anything, opt).map(list)
tables = st.lists(tensor_entry | anything, max_size=3) | anything
limits = st.lists(edge_ints | st.sampled_from([4096, 1 << 20, 1 << 30]), max_size=3) | anything
book_entry = st.tuples(edge_ints | anything, st.sampled_from(["server", "worker"]) | anything, edge_ints | anything,
                       names, endpoints).map(list)
books = st.lists(book_entry | anything, max_size=3) | anything
#: meta of a control message: any subset of the fields any receiver reads, each any shape
control_meta = st.none() | st.fixed_dictionaries({}, optional={
    "role": st.sampled_from(["server", "worker"]) | anything, "rank": edge_ints | anything, "endpoints": endpoints,
    "pid": edge_ints | anything, "fingerprint": st.just("cfg") | anything, "seq": edge_ints | anything,
    "tensors": tables, "limits": limits, "name": names, "nodes": books, "node_id": edge_ints | anything,
    "error": names, "opt": opt, "malformed": names,
})


def _paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """The path (keys and indices) of every part of `value`, itself included."""
    inner = value.items() if type(value) is dict else enumerate(value) if type(value) is list else ()
    return [path, *(p for key, item in inner for p in _paths(item, (*path, key)))]


def _replaced(value: Any, path: tuple[Any, ...], new: Any, remove: bool) -> Any:
    if len(path) == 1 and remove:
        return [v for i, v in enumerate(value) if i != path[0]] if type(value) is list else {
            k: v for k, v in value.items() if k != path[0]}
    if not path:
        return new
    copied = list(value) if type(value) is list else dict(value)
    copied[path[0]] = _replaced(value[path[0]], path[1:], new, remove)
    return copied


@st.composite
def mutants(draw: st.DrawFn, template: Any) -> Any:
    """`template` (a valid value) with one to three of its parts, itself included, replaced by anything or
    left out: deep checks are reached far more often than from values generated blind."""
    value = template
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(_paths(value)))
        value = _replaced(value, path, draw(anything), remove=bool(path) and draw(st.integers(0, 3)) == 0)
    return value


WELCOME = {"node_id": 2, "rank": 0, "role": "worker", "generation": 0,
           "nodes": [[1, "server", 0, "server-0", ["tcp://127.0.0.1:9"]], [2, "worker", 0, "worker-0", []]]}
PLAN = {"seq": 0, "tensors": [[0, "a", [4], "float32", 0, [[0, 0, 4, 0]]]], "limits": [1 << 20, 1 << 22]}
#: a valid meta of each control kind, as its receiver expects it
TEMPLATES = {
    Kind.REGISTER: {"role": "worker", "rank": 1, "endpoints": [], "pid": 7, "fingerprint": "cfg"},
    Kind.DECLARE: {"seq": 0, "tensors": [["a", [4], "float32", None], ["b", [2, 3], "float16", {"name": "sgd",
                                                                                               "lr": 0.1}]],
                   "limits": [1 << 20, 1 << 22]},
    Kind.PLAN_ACK: {"seq": 0},
    Kind.BARRIER: {"name": "b"},
    Kind.RELEASE: {"name": "b"},
    Kind.WELCOME: WELCOME,
    Kind.PLAN: PLAN,
    Kind.ERROR: {"error": "x"},
    Kind.NODE_LOST: {"error": "x", "node_id": 1, "role": "server", "rank": 0},
    Kind.BYE: {"rank": 1},
}
control_messages = st.one_of(
    *(st.builds(Message, st.just(kind), sender=st.just(0), meta=mutants(meta)) for kind, meta in TEMPLATES.items()),
    st.builds(Message, st.sampled_from(list(Kind)), sender=st.just(0), meta=control_meta),
)


def received(msg: Message, max_header: int = CONTROL_HEADER_BYTES) -> Message | None:
    """`msg` as a receiver gets it: encoded, then decoded; None where decode refuses it."""
    try:
        return decode([bytes(f) if i == 0 else f for i, f in enumerate(encode(msg))], max_header)
    except WireError:
        return None


OPT_META = {"opt": {"name": "adam", "lr": 0.1, "beta1": 0.9}}
PLAN_TEMPLATE = [[7, "v", "float32", {"name": "sgd", "lr": 0.1}, [[0, 2], [1, 2]]], [8, "u", "int8", None, [[0, 3]]]]


@st.composite
def data_frames(draw: st.DrawFn) -> list[bytes]:
    """Frames of a data message: real and unknown keys, senders, rounds; payloads of any dtype and shape."""
    dtype = draw(st.sampled_from(["", "", *DTYPES]))
    shape = draw(st.sampled_from([[4], [2], [2, 2], [], [0]])) if dtype else []
    nbytes = int(np.prod(shape)) * DTYPES[dtype] if dtype else 0
    flags = draw(st.sampled_from([0, int(Flag.WANT_REPLY), int(Flag.SHM), int(Flag.LOCAL), 3]))
    meta = draw(st.none() | st.fixed_dictionaries({"opt": opt}) | mutants(OPT_META) | control_meta)
    head = [VERSION, draw(st.sampled_from(list(Kind))), draw(st.sampled_from([10, 11, 12, -1, 0])),
            draw(st.sampled_from([3, 4, 5, 0])), draw(st.sampled_from([0, 1])),
            draw(st.sampled_from([0, 1, 2, 1 << 40])), draw(st.integers(0, 3)), dtype, shape, nbytes, flags, meta]
    frames = [bytes(msgpack.packb(head))]
    if dtype:
        frames.append(bytes(msgpack.packb(["sluice-1-0-00", 0])) if flags & Flag.SHM else draw(
            st.binary(min_size=nbytes, max_size=nbytes)))
    return frames


dtypes = st.sampled_from([*DTYPES, "complex64"]) | anything
chunk_lists = st.lists(st.tuples(edge_ints, edge_ints).map(list) | anything, max_size=3) | anything
plan_entry = st.tuples(edge_ints | anything, names, dtypes, opt, chunk_lists).map(list)
plans = mutants(PLAN_TEMPLATE) | st.lists(plan_entry | anything, max_size=3) | anything
store_ops = st.tuples(st.just("handle"), st.sampled_from(["w0", "w1", "a0", "x"]), st.integers(0, 2), data_frames()) \
    | st.tuples(st.just("plan"), plans) | st.tuples(st.just("left"), edge_ints)


# ------------------------------------------------------------------------------------------ ShardStore
def new_store() -> ShardStore:
    shard = ShardStore(node_id=1, workers=2, sync=True)
    shard.worker_ids = {10: ("w0", 0), 11: ("w1", 1)}
    shard.aggregator_ids = {12: "a0"}
    shard.add_plan([[3, "fc.weight", "float32", None, [[0, 4]]], [4, "steps", "int32", None, [[0, 2]]]])
    return shard


def store_state(shard: ShardStore) -> Any:
    chunks = {
        at: (c.name, c.dtype, c.round, sorted(c.pushed), c.value.tobytes(), c.sum.accum.tobytes(), c.optimizer,
             len(c.waiting), len(c.bcast_waiting), c.bcast_version, sorted(c.sum.covered), c.sum.low, c.sum.first,
             {rank: (list(ranks), data.tobytes()) for rank, (ranks, data) in c.sum.stash.items()})
        for at, c in shard.chunks.items()
    }
    return chunks, sorted(shard.departed), list(shard.departure_order)


def push(sender: int, values: list[float], round_: int = 1) -> Message:
    return Message(Kind.PUSH, sender=sender, key=3, chunk=0, round=round_, dtype="float32", shape=(4,),
                   flags=Flag.WANT_REPLY, payload=memoryview(np.array(values, np.float32)))


def a_round_sums(shard: ShardStore) -> bool:
    shard.handle("w0", 1, push(10, [1, 2, 3, 4]))
    replies = shard.handle("w1", 1, push(11, [10, 20, 30, 40]))
    sums = [np.frombuffer(m.payload, np.float32).tolist() for _, _, m in replies]
    return sums == [[11, 22, 33, 44]] * 2


def apply_store_op(shard: ShardStore, op: tuple[Any, ...]) -> None:
    if op[0] == "handle":
        try:
            msg = decode(op[3])
        except WireError:
            return
        shard.handle(op[1], op[2], msg)
    elif op[0] == "plan":
        shard.add_plan(op[1])
    else:
        shard.worker_left(op[1])


@PROPERTY
@given(st.lists(store_ops, max_size=8))
def test_shard_store_takes_any_message_plan_or_departure(ops: list[tuple[Any, ...]]) -> None:
    shard = new_store()
    initial = store_state(shard)
    for op in ops:
        before = store_state(shard)
        try:
            apply_store_op(shard, op)
        except WireError:
            assert store_state(shard) == before, f"a rejected {op[0]} changed the store"
    if store_state(shard) == initial:
        assert a_round_sums(shard)


HOSTILE_TO_STORE: list[tuple[str, Any]] = [
    ("plan", [[3, "w", "float32", None]]),  # 4 fields
    ("plan", [[3, "w", "float32", None, [[0]]]]),
    ("plan", [[3, "w", "float32", None, 7]]),
    ("plan", [[3, "w", ["float32"], None, [[0, 4]]]]),  # unhashable dtype
    ("plan", [[3, "w", "complex64", None, [[0, 4]]]]),
    ("plan", [[[3], "w", "float32", None, [[0, 4]]]]),  # unhashable key
    ("plan", [[9, "w", "float32", None, [[0, -1]]]]),
    ("plan", [[9, "w", "float32", None, [[0, 1 << 40]]]]),
    ("plan", [[9, "w", "float32", "sgd", [[0, 4]]]]),  # settings not a map: AttributeError before
    ("plan", [[9, "w", "float32", {"name": "sgd", "lr": float("inf")}, [[0, 4]]]]),
    ("plan", [[9, "w", "int32", {"name": "sgd", "lr": 0.1, "momentum": 0.9}, [[0, 4]]]]),
    ("plan", [[9, "w", "float32", None, [[0, 4]]], "junk"]),  # valid first entry: nothing may be added
    ("plan", "not a list"),
    ("left", -1), ("left", 2), ("left", 1 << 63),
    ("push", Message(Kind.PUSH, sender=10, key=4, round=1, dtype="int32", shape=(2,), meta={"opt": {"name": "adam",
                                                                                                  "lr": 0.1}},
                     payload=memoryview(np.ones(2, np.int32)))),  # an optimizer on ints: numpy TypeError before
    ("push", Message(Kind.PUSH, sender=10, key=3, round=1, dtype="float32", shape=(4,), meta={"opt": [1, 2]},
                     payload=memoryview(np.ones(4, np.float32)))),
    ("push", Message(Kind.PUSH, sender=10, key=3, round=1, dtype="float32", shape=(4,), shm=("sluice-1-0-0", 0, 16))),
]


def test_hostile_plans_departures_and_pushes_are_refused_and_change_nothing() -> None:
    shard = new_store()
    initial = store_state(shard)
    for what, value in HOSTILE_TO_STORE:
        with pytest.raises(WireError):
            if what == "plan":
                shard.add_plan(value)
            elif what == "left":
                shard.worker_left(value)
            else:
                shard.handle("w0", 0, value)
        assert store_state(shard) == initial, (what, value)
    assert a_round_sums(shard)


# ------------------------------------------------------------------------------------------ Rendezvous
CONFIG = SchedulerConfig(heartbeat_interval=1.0, heartbeat_timeout=5.0, rendezvous_timeout=30.0)
MEMBERS = [("server-0", "server", 0), ("worker-0", "worker", 0), ("worker-1", "worker", 1)]
peers = st.sampled_from([name for name, _, _ in MEMBERS] + ["stranger"])


def rendezvous_state(machine: Rendezvous) -> Any:
    return copy.deepcopy({k: v for k, v in vars(machine).items() if k not in ("last_seen", "config")})


def attack_rendezvous(machine: Rendezvous, attack: list[tuple[str, Message]], now: float) -> bool:
    """Send every message; True if any was taken and changed the state (a rejected one may not)."""
    changed = False
    for peer, generated in attack:
        msg = received(generated)
        if msg is None:
            continue
        before = rendezvous_state(machine)
        try:
            machine.on_message(peer, msg, now)
        except WireError:
            assert rendezvous_state(machine) == before, f"a rejected {msg.kind.name} changed the rendezvous"
            continue
        changed = changed or rendezvous_state(machine) != before
        machine.on_tick(now)
    return changed


def members_form_a_job(machine: Rendezvous) -> None:
    """The real nodes register, declare, plan, meet at a barrier and leave; asserts every step."""
    outs: list[Any] = []
    for name, role, rank in MEMBERS:
        meta = {"role": role, "rank": rank, "endpoints": ["tcp://127.0.0.1:9"] if role == "server" else [], "pid": 1,
                "fingerprint": "cfg"}
        outs += machine.on_message(name, Message(Kind.REGISTER, meta=meta), 2.0)
    assert machine.phase == "running" and sorted(p for p, m in outs if m.kind == Kind.WELCOME) == sorted(
        name for name, _, _ in MEMBERS)
    table = [["a", [4], "float32", None]]
    assert machine.on_message("worker-0", Message(Kind.DECLARE, meta={"seq": 0, "tensors": table}), 2.0) == []
    outs = machine.on_message("worker-1", Message(Kind.DECLARE, meta={"seq": 0, "tensors": table}), 2.0)
    assert [(p, m.kind) for p, m in outs] == [("server-0", Kind.PLAN)]
    outs = machine.on_message("server-0", Message(Kind.PLAN_ACK, meta={"seq": 0}), 2.0)
    assert sorted(p for p, m in outs if m.kind == Kind.PLAN) == ["worker-0", "worker-1"]
    machine.on_message("worker-0", Message(Kind.BARRIER, meta={"name": "b"}), 2.0)
    outs = machine.on_message("worker-1", Message(Kind.BARRIER, meta={"name": "b"}), 2.0)
    assert sorted((p, m.kind) for p, m in outs) == [("worker-0", Kind.RELEASE), ("worker-1", Kind.RELEASE)]
    machine.on_message("worker-0", Message(Kind.BYE), 2.0)
    machine.on_message("worker-1", Message(Kind.BYE), 2.0)
    assert machine.exit_code == 0


@PROPERTY
@given(st.lists(st.tuples(peers, control_messages), max_size=6), st.lists(st.tuples(peers, control_messages),
                                                                         max_size=6))
def test_rendezvous_takes_any_message(before: list[tuple[str, Message]], running: list[tuple[str, Message]]) -> None:
    machine = Rendezvous(2, 1, 1 << 20, CONFIG, "cfg", now=0.0)
    changed = attack_rendezvous(machine, before, 1.0)
    if not changed:
        members_form_a_job(machine)
        return
    with contextlib.suppress(WireError, AssertionError):  # the attack was taken (a stranger registered, say):
        members_form_a_job(machine)  # the job may not form, but nothing else may escape


def running_rendezvous() -> Rendezvous:
    machine = Rendezvous(2, 1, 1 << 20, CONFIG, "cfg", now=0.0)
    for name, role, rank in MEMBERS:
        meta = {"role": role, "rank": rank, "endpoints": ["tcp://127.0.0.1:9"], "pid": 1, "fingerprint": "cfg"}
        machine.on_message(name, Message(Kind.REGISTER, meta=meta), 0.5)
    return machine


@PROPERTY
@given(st.lists(st.tuples(peers, control_messages), max_size=10))
def test_a_running_rendezvous_takes_any_message(attack: list[tuple[str, Message]]) -> None:
    attack_rendezvous(running_rendezvous(), attack, 1.0)


TABLE = [["a", [4], "float32", None]]
HOSTILE_TO_RENDEZVOUS: list[tuple[str, Kind, dict[str, Any]]] = [
    ("worker-0", Kind.DECLARE, {"seq": 0, "tensors": [["a", [4], ["float32"], None]]}),  # unhashable: TypeError before
    ("worker-0", Kind.DECLARE, {"seq": 0, "tensors": [["a", [4], {"f": 1}, None]]}),
    ("worker-0", Kind.DECLARE, {"seq": 0, "tensors": [["a", [1] * 65, "float32", None]]}),
    ("worker-0", Kind.DECLARE, {"seq": 0, "tensors": [["x" * 5000, "4", "float32", None]]}),
    ("worker-0", Kind.DECLARE, {"seq": 0, "tensors": TABLE, "limits": [1 << 20]}),  # recorded the table before
    ("worker-0", Kind.DECLARE, {"seq": True, "tensors": TABLE}),
    ("server-0", Kind.PLAN_ACK, {"seq": 0}),  # nothing planned yet: sent the workers an empty plan before
    ("worker-0", Kind.BARRIER, {"name": ["b"]}),
    ("stranger", Kind.HEARTBEAT, {}),
    ("worker-0", Kind.PLAN, {"seq": 0}),
]


def test_hostile_control_messages_are_refused_and_the_job_still_runs() -> None:
    machine = Rendezvous(2, 1, 1 << 20, CONFIG, "cfg", now=0.0)
    for meta in [
        {"role": ["worker"]}, {"role": "x" * 5000},
        {"role": "worker", "rank": True, "endpoints": [], "pid": 1, "fingerprint": "cfg"},
        {"role": "server", "rank": -1, "endpoints": [1], "pid": 1, "fingerprint": "cfg"},
    ]:
        with pytest.raises(WireError) as caught:
            machine.on_message("stranger", Message(Kind.REGISTER, meta=meta), 0.0)
        assert len(str(caught.value)) < 300
    for name, role, rank in MEMBERS:
        meta = {"role": role, "rank": rank, "endpoints": ["tcp://127.0.0.1:9"], "pid": 1, "fingerprint": "cfg"}
        machine.on_message(name, Message(Kind.REGISTER, meta=meta), 0.5)
    assert machine.phase == "running" and len(machine.nodes) == 3
    machine = running_rendezvous()
    initial = rendezvous_state(machine)
    for peer, kind, meta in HOSTILE_TO_RENDEZVOUS:
        with pytest.raises(WireError) as caught:
            machine.on_message(peer, Message(kind, meta=meta), 1.0)
        assert len(str(caught.value)) < 300 and rendezvous_state(machine) == initial, (peer, kind, meta)
    outs = machine.on_message("worker-0", Message(Kind.DECLARE, meta={"seq": 0, "tensors": TABLE}), 1.0)
    outs += machine.on_message("worker-1", Message(Kind.DECLARE, meta={"seq": 0, "tensors": TABLE}), 1.0)
    assert [(p, m.kind) for p, m in outs] == [("server-0", Kind.PLAN)]


@PROPERTY
@given(tables, limits)
def test_tensor_tables_and_limits_parse_or_raise_wire_error(table: Any, raw_limits: Any) -> None:
    for parse, value in ((parse_tensor_table, table), (parse_limits, raw_limits)):
        try:
            parse(value)
        except WireError as exc:
            assert len(str(exc)) < 400


def test_a_name_declared_twice_fails_the_job() -> None:
    machine = Rendezvous(1, 1, 1 << 20, CONFIG, "cfg", now=0.0)
    for name, role, rank in MEMBERS[:2]:
        meta = {"role": role, "rank": rank, "endpoints": ["tcp://127.0.0.1:9"], "pid": 1, "fingerprint": "cfg"}
        machine.on_message(name, Message(Kind.REGISTER, meta=meta), 0.0)
    twice = [["a", [4], "float32", None], ["a", [2], "float32", None]]  # one worker: before, planned under two keys
    machine.on_message("worker-0", Message(Kind.DECLARE, meta={"seq": 0, "tensors": twice}), 1.0)
    assert machine.phase == "failed" and "worker 0 declares a tensor name twice" in machine.error


def test_a_declaration_too_large_to_plan_fails_the_job_with_its_reason() -> None:
    machine = Rendezvous(1, 2, 1 << 20, CONFIG, "cfg", now=0.0)
    for name, role, rank in [("server-0", "server", 0), ("server-1", "server", 1), ("worker-0", "worker", 0)]:
        meta = {"role": role, "rank": rank, "endpoints": ["tcp://127.0.0.1:9"], "pid": 1, "fingerprint": "cfg"}
        machine.on_message(name, Message(Kind.REGISTER, meta=meta), 0.0)
    huge = [["w", [1 << 40], "float32", None]]  # 4 TiB: four million 1 MiB chunks, before: planned until memory ran out
    outs = machine.on_message("worker-0", Message(Kind.DECLARE, meta={"seq": 0, "tensors": huge}), 1.0)
    assert machine.phase == "failed" and "chunks" in machine.error
    assert {m.kind for _, m in outs} == {Kind.ERROR}


# ------------------------------------------------------------------------------------------ ControlClient
class StubTransport:
    """Records what the client sends; the unit under test is the client's message handling only."""

    def __init__(self) -> None:
        self.sent: list[Message] = []

    def connect(self, peer: str, endpoints: Any, control: bool = False, tos: int | None = None) -> None:
        pass

    def send(self, peer: str, channel: int, msg: Message) -> None:
        self.sent.append(msg)

    def on_failure(self, listener: Any) -> None:
        self.listener = listener


def new_client() -> ControlClient:
    env = NodeEnv(scheduler="tcp://127.0.0.1:1", role="worker", rank=0, workers=2, servers=1, config={})
    client = ControlClient(StubTransport(), env, SchedulerConfig(rendezvous_timeout=1.0, op_timeout=1.0))  # type: ignore[arg-type]
    client.role = "worker"
    return client


def client_still_works(client: ControlClient) -> None:
    client.on_message(Message(Kind.WELCOME, sender=0, meta=WELCOME))
    client.register("worker", [])
    try:
        assert (client.node_id, client.rank) == (2, 0) and [p.name for p in client.peers] == ["server-0", "worker-0"]
        client.on_message(Message(Kind.PLAN, sender=0, meta=PLAN))
        table, settled = client.declare([["a", [4], "float32", None]])
        assert table == PLAN["tensors"] and settled.as_list() == PLAN["limits"]
    finally:
        client.bye()


@PROPERTY
@given(st.lists(control_messages, max_size=8))
def test_control_client_takes_any_message(attack: list[Message]) -> None:
    client = new_client()
    for generated in attack:
        msg = received(generated)
        if msg is not None:
            with contextlib.suppress(WireError):
                client.on_message(msg)
    client._replies.clear()  # a WELCOME or PLAN of the attack may wait there; the real ones follow
    if client.failure is None:  # an ERROR or NODE_LOST in the attack ends the node, as it should
        client_still_works(client)


@pytest.mark.parametrize(
    "nodes",
    [
        [[1, "server", 0, "server-0"]],  # 4 fields
        [[1, "server", 0, "server-0", "tcp://127.0.0.1:9"]],  # endpoints a str: was split into characters
        [[1, "server", 0, "server-0", 5]],
        [[float("inf"), "server", 0, "server-0", []]],  # int(inf): OverflowError escaped before
        [[1.5, "server", 0, "server-0", []]],
        [["1", "server", 0, "server-0", []]],
        [[1, ["server"], 0, "server-0", []]],
        [[1, "server", 0, "server-0", [1, 2]]],
        ["entry"],
    ],
)
def test_a_malformed_address_book_is_reported_not_raised(nodes: Any) -> None:
    client = new_client()
    client.on_message(Message(Kind.WELCOME, sender=0, meta={**WELCOME, "nodes": nodes}))
    with pytest.raises(SluiceError, match="malformed WELCOME"):
        client.register("worker", [])
    assert client.node_id == -1 and client.peers == []


def test_a_dead_transport_fails_the_node_naming_itself(capsys: pytest.CaptureFixture[str]) -> None:
    """The I/O thread's death ends every wait at once with its cause, and this node is the culprit: not
    the scheduler whose heartbeats it stops hearing 8 s later."""
    client = new_client()
    client.rank = 1
    transport = client._transport
    assert isinstance(transport, StubTransport)
    transport.listener("transport worker-1: its I/O thread stopped on RuntimeError: boom")
    assert client.failure is not None and "I/O thread stopped" in client.failure
    assert "SLUICE_CULPRIT worker 1" in capsys.readouterr().err
