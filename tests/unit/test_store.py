"""A server's shard store: rounds, optimizers, pulls that wait, and rejected messages."""

from __future__ import annotations

import numpy as np
import pytest

from ps.store import ShardStore, bf16_to_f32, f32_to_bf16
from transport.wire import Flag, Kind, Message, WireError


def store(sync: bool = True, opt: dict[str, object] | None = None) -> ShardStore:
    shard = ShardStore(node_id=1, workers=2, sync=sync)
    shard.worker_ids = {10: ("w0", 0), 11: ("w1", 1)}
    shard.add_plan([[3, "fc.weight", "float32", opt, [[0, 4]]]])
    return shard


def push(sender: int, round_: int, values: list[float], flags: int = Flag.WANT_REPLY) -> Message:
    data = np.array(values, np.float32)
    return Message(Kind.PUSH, sender=sender, key=3, chunk=0, round=round_, dtype="float32",
                   shape=(4,), flags=flags, payload=memoryview(data))


def values(msg: Message) -> list[float]:
    return np.frombuffer(msg.payload, np.float32).tolist()


def test_round_completes_when_every_worker_pushed() -> None:
    shard = store()
    assert shard.handle("w0", 2, push(10, 1, [1, 2, 3, 4])) == []
    replies = shard.handle("w1", 2, push(11, 1, [10, 20, 30, 40]))
    summary = [(peer, ch, m.kind, m.round) for peer, ch, m in replies]
    assert summary == [("w0", 2, Kind.REPLY, 1), ("w1", 2, Kind.REPLY, 1)]
    assert values(replies[0][2]) == [11, 22, 33, 44]


def test_server_side_sgd_averages_then_steps() -> None:
    shard = store(opt={"name": "sgd", "lr": 0.5})
    shard.handle("w0", 0, Message(Kind.BCAST_PUSH, sender=10, key=3, chunk=0, round=1, dtype="float32", shape=(4,),
                                  payload=memoryview(np.ones(4, np.float32))))
    shard.handle("w0", 0, push(10, 1, [2, 2, 2, 2]))
    replies = shard.handle("w1", 0, push(11, 1, [4, 4, 4, 4]))
    assert values(replies[0][2]) == [1 - 0.5 * 3] * 4


def test_pull_waits_for_its_round() -> None:
    shard = store()
    pull = Message(Kind.PULL, sender=11, key=3, chunk=0, round=1, priority=5)
    assert shard.handle("w1", 1, pull) == []
    shard.handle("w0", 1, push(10, 1, [1, 1, 1, 1], flags=Flag.NONE))
    replies = shard.handle("w1", 1, push(11, 1, [1, 1, 1, 1], flags=Flag.NONE))
    kinds = [(peer, m.kind, m.payload is None, m.priority) for peer, _, m in replies]
    assert kinds == [("w1", Kind.REPLY, True, 0), ("w1", Kind.REPLY, False, 5)]


@pytest.mark.parametrize(
    ("peer", "message", "problem"),
    [
        ("w0", Message(Kind.PULL, sender=10, key=9, round=1), "unknown key"),
        ("w0", Message(Kind.PULL, sender=99, key=3, round=1), "not a worker"),
        ("w1", Message(Kind.PULL, sender=10, key=3, round=1), "not a worker"),
        ("w0", push(10, 2, [0, 0, 0, 0]), "round 2"),
        ("w0", Message(Kind.PUSH, sender=10, key=3, round=1, dtype="float64", shape=(4,),
                       payload=memoryview(np.zeros(4))), "holds float32"),
        ("w0", Message(Kind.HEARTBEAT, sender=10, key=3), "does not take"),
    ],
)
def test_bad_messages_are_rejected(peer: str, message: Message, problem: str) -> None:
    with pytest.raises(WireError, match=problem):
        store().handle(peer, 0, message)


def test_duplicate_push_in_a_round_is_rejected() -> None:
    shard = store()
    shard.handle("w0", 0, push(10, 1, [1, 1, 1, 1]))
    with pytest.raises(WireError, match="twice"):
        shard.handle("w0", 0, push(10, 1, [1, 1, 1, 1]))


def test_async_mode_applies_each_push() -> None:
    shard = store(sync=False, opt={"name": "sgd", "lr": 1.0})
    first = shard.handle("w0", 0, push(10, 1, [1, 1, 1, 1]))
    second = shard.handle("w1", 0, push(11, 1, [1, 1, 1, 1]))
    assert values(first[0][2]) == [-1] * 4 and values(second[0][2]) == [-2] * 4


def test_bfloat16_round_trip_rounds_to_nearest_even() -> None:
    x = np.array([1.0, -2.5, 3.14159, 1e-3], np.float32)
    bits = np.zeros(4, np.uint16)
    f32_to_bf16(x.copy(), bits)
    np.testing.assert_allclose(bf16_to_f32(bits), x, rtol=1 / 128)


def test_a_departed_worker_fails_the_rounds_that_need_it() -> None:
    shard = store()
    assert shard.handle("w0", 1, push(10, 1, [1, 1, 1, 1])) == []  # waits for worker 1
    failed = shard.worker_left(1)
    assert [(peer, m.kind, m.round) for peer, _, m in failed] == [("w0", Kind.ERROR, 1)]
    assert "worker 1 has left the job" in failed[0][2].meta["error"]


def test_a_round_the_departed_worker_joined_still_completes() -> None:
    shard = store()
    shard.handle("w1", 1, push(11, 1, [1, 1, 1, 1], flags=Flag.NONE))
    assert shard.worker_left(1) == []
    replies = shard.handle("w0", 1, push(10, 1, [2, 2, 2, 2]))
    assert [m.kind for _, _, m in replies] == [Kind.REPLY] and values(replies[0][2]) == [3] * 4
    after = shard.handle("w0", 1, push(10, 2, [2, 2, 2, 2]))  # round 2 needs worker 1: refused at once
    assert [m.kind for _, _, m in after] == [Kind.ERROR]


def test_replies_keep_the_priority_and_channel_of_their_request() -> None:
    """The reply path of a pull is prioritised like the request: same priority, same channel."""
    shard = store()
    first, second = push(10, 1, [1, 2, 3, 4]), push(11, 1, [1, 1, 1, 1])
    first.priority, second.priority = 7, 2
    shard.handle("w0", 2, first)
    pull = Message(Kind.PULL, sender=11, key=3, chunk=0, round=1, priority=0)
    replies = shard.handle("w1", 0, second) + shard.handle("w1", 0, pull)
    assert [(peer, ch, m.kind, m.priority) for peer, ch, m in replies] == [
        ("w0", 2, Kind.REPLY, 7), ("w1", 0, Kind.REPLY, 2), ("w1", 0, Kind.REPLY, 0),
    ]


def test_an_orphaned_round_names_the_first_worker_to_leave_first() -> None:
    shard = ShardStore(node_id=1, workers=3, sync=True)
    shard.worker_ids = {10: ("w0", 0), 11: ("w1", 1), 12: ("w2", 2)}
    shard.add_plan([[3, "fc.weight", "float32", None, [[0, 4]]]])
    shard.worker_left(2)
    shard.worker_left(0)
    (reply,) = shard.handle("w1", 0, push(11, 1, [1, 2, 3, 4]))
    assert "workers 2, 0 have left the job (worker 2 first)" in reply[2].meta["error"]
