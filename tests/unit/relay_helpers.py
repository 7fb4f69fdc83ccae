"""What the relay's unit tests share: a relay with a plan and trees, and the messages its peers send."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from sluice.ps.relay import Relay
from sluice.scheduler.hierarchy.routes import Route, Routing
from sluice.transport.wire import DATA_HEADER_BYTES, Flag, Kind, Message, WireError, decode, encode

WORKERS = 4
IDS = {"server-0": 1, "server-1": 2, "aggregator-0": 3, "aggregator-1": 4,
       **{f"worker-{r}": 10 + r for r in range(WORKERS)}}
#: key 7: two float32 chunks on servers 0 and 1; key 8: bfloat16 on server 1; key 9: int32 on server 0
PLAN = [
    [7, "fc.weight", [8], "float32", 0, [[0, 0, 4, 0], [1, 4, 4, 1]]],
    [8, "emb", [4], "bfloat16", 1, [[0, 0, 4, 1]]],
    [9, "steps", [2], "int32", 2, [[0, 0, 2, 0]]],
]
LENGTH = {(7, 0): 4, (7, 1): 4, (8, 0): 4, (9, 0): 2}
DTYPE = {(7, 0): "float32", (7, 1): "float32", (8, 0): "bfloat16", (9, 0): "int32"}
STORE = {"float32": np.float32, "bfloat16": np.uint16, "int32": np.int32, "float64": np.float64}
#: workers 0 and 1 send to aggregator-0, which sends to the servers
FLAT_TREE = Route(1.0, {"worker-0": "aggregator-0", "worker-1": "aggregator-0"})
#: workers 1 and 2 send to aggregator-1, which sends to aggregator-0; worker 0 sends to aggregator-0 directly
TWO_LEVEL = Route(1.0, {"worker-0": "aggregator-0", "worker-1": "aggregator-1", "worker-2": "aggregator-1",
                        "aggregator-1": "aggregator-0"})
#: the float32 values that show the order of addition: (1e8 + 1) - 1e8 == 0, (1e8 - 1e8) + 1 == 1
VISIBLE = [[1e8, 1.0, -1e8, 3.0], [1.0, -1e8, 3.0, 1e8], [-1e8, 3.0, 1e8, 1.0]]


def new_relay(name: str = "aggregator-0", *routings: Routing) -> Relay:
    relay = Relay(name, WORKERS)
    relay.node_id = IDS[name]
    tables = relay.tables
    tables.names = {node_id: peer for peer, node_id in IDS.items() if not peer.startswith("server")}
    tables.worker_ranks = {f"worker-{r}": r for r in range(WORKERS)}
    tables.aggregators = {"aggregator-0", "aggregator-1"}
    tables.server_names = ["server-0", "server-1"]
    tables.add_plan(PLAN)
    for routing in routings or (Routing(1, (FLAT_TREE,)),):
        tables.install(routing)
    return relay


def push(child: str, values: Any, key: int = 7, chunk: int = 0, round_: int = 1, route: Any = (1, 0),
         ranks: list[int] | None = None, dtype: str | None = None, flags: int = Flag.WANT_REPLY, priority: int = 0,
         meta: dict[str, Any] | None = None) -> Message:
    dtype = dtype or DTYPE.get((key, chunk), "float32")
    data = np.asarray(values, STORE[dtype])
    if meta is None:
        meta = {} if route is None else {"route": list(route)}
        if ranks is not None:
            meta["ranks"] = ranks
    return Message(Kind.PUSH, sender=IDS.get(child, 99), key=key, chunk=chunk, round=round_, priority=priority,
                   dtype=dtype, shape=data.shape, flags=flags, meta=meta, payload=memoryview(data))


def reply(key: int = 7, chunk: int = 0, round_: int = 1, values: Any = None, kind: Kind = Kind.REPLY,
          sender: int = 1, meta: dict[str, Any] | None = None) -> Message:
    if values is None:
        return Message(kind, sender=sender, key=key, chunk=chunk, round=round_, meta=meta)
    dtype = DTYPE[(key, chunk)]
    data = np.asarray(values, STORE[dtype])
    return Message(kind, sender=sender, key=key, chunk=chunk, round=round_, dtype=dtype, shape=data.shape,
                   payload=memoryview(data), meta=meta)


def summary(out: list[tuple[str, int, Message]]) -> list[tuple[Any, ...]]:
    """What a test checks of each sent message, the payload apart."""
    return [(peer, channel, m.kind, m.sender, m.key, m.chunk, m.round, m.priority, m.flags, m.dtype, m.shape, m.meta)
            for peer, channel, m in out]


def values_of(msg: Message) -> list[Any]:
    return np.frombuffer(msg.payload, STORE[msg.dtype]).tolist()


def bits_of(msg: Message) -> bytes:
    return bytes(memoryview(msg.payload).cast("B"))


def f32(values: Any) -> np.ndarray:
    return np.asarray(values, np.float32)


def plain(value: Any) -> Any:
    """`value` as nested plain data that compares by content: arrays as bytes, objects as their fields."""
    if isinstance(value, np.ndarray):
        return ("array", value.dtype.str, value.shape, value.tobytes())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__name__, {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)})
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain(v) for v in value)
    if isinstance(value, (set, frozenset)):
        return frozenset(plain(v) for v in value)
    if hasattr(value, "__dict__") and not callable(value):
        return (type(value).__name__, plain(vars(value)))
    return value


def state(relay: Relay) -> Any:
    """Everything the relay holds, its tables, rounds, buffers, spare pool and departures included."""
    return plain(vars(relay))


def received(msg: Message) -> Message | None:
    """`msg` as a receiver gets it: encoded, then decoded; None where decode refuses it."""
    try:
        return decode([bytes(f) if i == 0 else f for i, f in enumerate(encode(msg))], DATA_HEADER_BYTES)
    except WireError:
        return None
