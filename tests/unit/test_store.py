"""A server's shard store: rounds, optimizers, pulls that wait, and rejected messages."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import pytest

from sluice.ps.store import ShardStore, bf16_to_f32, f32_to_bf16
from sluice.transport.wire import Flag, Kind, Message, WireError


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
    assert failed[0][2].meta["error"].endswith(": worker 1 has left the job (did the workers run different numbers "
                                              "of steps?)")


def test_a_worker_that_left_with_an_error_is_named_with_it_and_no_hint_of_uneven_steps() -> None:
    shard = store()
    shard.handle("w0", 1, push(10, 1, [1, 1, 1, 1]))
    failed = shard.worker_left(1, "RuntimeError: out of data")
    assert failed[0][2].meta["error"].endswith(": worker 1 has left the job with an error (RuntimeError: out of data)")


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


# ------------------------------------------------------------------ deterministic sums (issue 7)
#: one column per element: float32 sums of these depend on the order of addition (1e8 + 1 == 1e8)
ORDER_SENSITIVE = np.array(list(itertools.permutations([1e8, 1.0, -1e8, 1.0])), np.float32).T  # ranks x 24


def store_of(workers: int, dtype: str = "float32", opt: dict[str, object] | None = None) -> ShardStore:
    shard = ShardStore(node_id=1, workers=workers, sync=True)
    shard.worker_ids = {10 + r: (f"w{r}", r) for r in range(workers)}
    shard.add_plan([[3, "fc.weight", dtype, opt, [[0, 24]]]])
    return shard


def push_of(rank: int, round_: int, data: np.ndarray, dtype: str = "float32", flags: int = Flag.WANT_REPLY) -> Message:
    return Message(Kind.PUSH, sender=10 + rank, key=3, chunk=0, round=round_, dtype=dtype, shape=data.shape,
                   flags=flags, payload=memoryview(data))


def run_round(shard: ShardStore, order: Sequence[int], rows: np.ndarray, round_: int = 1, dtype: str = "float32",
              flags: int = Flag.WANT_REPLY) -> list[Message]:
    """Push row r of `rows` as worker r, in `order`; the REPLY messages carrying the round's value."""
    replies = []
    for rank in order:
        data = rows[rank].copy()  # each push its own buffer, which the sender may reuse once handled
        replies += shard.handle(f"w{rank}", 0, push_of(rank, round_, data, dtype, flags))
        data[:] = 0  # a store that kept a reference instead of a copy would now sum zeros
    return [m for _, _, m in replies if m.payload is not None]


def in_rank_order(rows: np.ndarray) -> np.ndarray:
    total = rows[0].copy()
    for row in rows[1:]:
        total += row
    return total


def test_the_sum_is_the_same_bits_in_every_arrival_order() -> None:
    expected = in_rank_order(ORDER_SENSITIVE)
    naive = {np.sum(ORDER_SENSITIVE[list(order)], axis=0, dtype=np.float32).tobytes()
             for order in itertools.permutations(range(4))}
    assert len(naive) > 1, "the values must make the order of addition matter"
    for order in itertools.permutations(range(4)):
        shard = store_of(4)
        replies = run_round(shard, order, ORDER_SENSITIVE)
        assert len(replies) == 4, order
        for reply in replies:
            assert np.frombuffer(reply.payload, np.float32).tobytes() == expected.tobytes(), order
        assert not shard.chunks[(3, 0)].sum.stash


def test_rank_order_holds_over_rounds_with_acks_and_reused_stash_buffers() -> None:
    shard = store_of(5)
    rng = np.random.default_rng(7)
    rows = np.concatenate([ORDER_SENSITIVE, rng.standard_normal((1, 24)).astype(np.float32) * 1e8])
    orders = [tuple(int(r) for r in rng.permutation(5)) for _ in range(30)]
    for round_, order in enumerate(orders, start=1):
        replies = run_round(shard, order, rows, round_=round_, flags=Flag.NONE)  # every push acked at once
        pull = shard.handle("w0", 0, Message(Kind.PULL, sender=10, key=3, chunk=0, round=round_))
        assert replies == [] and np.frombuffer(pull[0][2].payload, np.float32).tobytes() == in_rank_order(
            rows).tobytes(), order
    assert sum(len(free) for free in shard._spare._free.values()) <= 3  # workers - 2: reused, not grown


def test_bfloat16_and_server_side_sgd_sum_in_rank_order_too() -> None:
    bits = np.zeros(ORDER_SENSITIVE.shape, np.uint16)
    f32_to_bf16(ORDER_SENSITIVE.copy(), bits)  # 1e8 and 1 are exact enough in bfloat16 to still cancel
    expected = in_rank_order(bf16_to_f32(bits))
    for order in itertools.permutations(range(4)):
        (reply, *_) = run_round(store_of(4, "bfloat16"), order, bits, dtype="bfloat16")
        got = np.zeros(24, np.uint16)
        f32_to_bf16(expected.copy(), got)
        assert np.frombuffer(reply.payload, np.uint16).tobytes() == got.tobytes(), order
    sgd = {"name": "sgd", "lr": 1.0}
    results = {run_round(store_of(4, opt=sgd), order, ORDER_SENSITIVE)[0].payload.tobytes()
               for order in itertools.permutations(range(4))}
    assert len(results) == 1


def test_integer_sums_take_pushes_as_they_come() -> None:
    rows = np.arange(4 * 24, dtype=np.int32).reshape(4, 24)
    for order in [(3, 2, 1, 0), (2, 0, 3, 1)]:
        shard = store_of(4, "int32")
        (reply, *_) = run_round(shard, order, rows, dtype="int32")
        assert np.frombuffer(reply.payload, np.int32).tolist() == rows.sum(axis=0).tolist()
        assert not shard._spare._free  # associative: nothing was stashed


def test_a_departed_workers_stashed_push_still_counts() -> None:
    shard = store_of(4)
    rows = ORDER_SENSITIVE
    run_round(shard, [3, 2], rows)  # both wait for ranks 0 and 1
    assert sorted(shard.chunks[(3, 0)].sum.stash) == [2, 3]
    assert shard.worker_left(3) == []  # worker 3 pushed this round: it can still complete
    replies = run_round(shard, [1, 0], rows)
    assert np.frombuffer(replies[0].payload, np.float32).tobytes() == in_rank_order(rows).tobytes()
    (error,) = shard.handle("w0", 0, push_of(0, 2, rows[0].copy()))  # round 2 needs worker 3
    assert error[2].kind == Kind.ERROR and "worker 3 has left" in error[2].meta["error"]


def test_a_refused_push_leaves_the_stash_alone() -> None:
    shard = store_of(4)
    run_round(shard, [2], ORDER_SENSITIVE)
    with pytest.raises(WireError, match="twice"):
        shard.handle("w2", 0, push_of(2, 1, ORDER_SENSITIVE[2].copy()))
    with pytest.raises(WireError, match="holds float32"):
        shard.handle("w3", 0, push_of(3, 1, np.zeros(3, np.float32)))
    assert sorted(shard.chunks[(3, 0)].sum.stash) == [2]
    replies = run_round(shard, [3, 1, 0], ORDER_SENSITIVE)
    assert np.frombuffer(replies[0].payload, np.float32).tobytes() == in_rank_order(ORDER_SENSITIVE).tobytes()


def join(sender: int, joined: bool, epoch: int = 0) -> Message:
    return Message(Kind.JOIN, sender=sender, round=epoch, meta={"joined": joined})


def test_a_joined_worker_counts_as_pushing_zeros_until_it_is_back() -> None:
    shard = store(opt={"name": "sgd", "lr": 1.0})
    assert shard.handle("w0", 2, push(10, 1, [2, 2, 2, 2])) == []  # waits for worker 1
    replies = shard.handle("w1", 0, join(11, True))  # worker 1 joins: round 1 completes with its zeros
    assert [(peer, m.kind, m.round) for peer, _, m in replies] == [("w0", Kind.REPLY, 1)]
    assert values(replies[0][2]) == [-1.0] * 4  # 0 - (2 + 0) / 2: the average still divides by both
    replies = shard.handle("w0", 2, push(10, 2, [4, 4, 4, 4]))  # round 2 needs no push of worker 1
    assert [(peer, values(m)) for peer, _, m in replies] == [("w0", [-3.0] * 4)]
    replies = shard.handle("w1", 0, join(11, False, epoch=1))  # back: the echo, and rounds wait for it again
    assert [(peer, m.kind, m.round, m.meta) for peer, _, m in replies] == [("w1", Kind.JOIN, 1, {"joined": False})]
    assert shard.handle("w0", 2, push(10, 3, [2, 2, 2, 2])) == []
    assert [peer for peer, _, _ in shard.handle("w1", 2, push(11, 3, [0, 0, 0, 0]))] == ["w0", "w1"]


def test_a_join_from_a_stranger_is_refused() -> None:
    with pytest.raises(WireError, match="not a worker"):
        store().handle("w9", 0, join(99, True))


def set_store() -> ShardStore:
    """Three workers; tensor 3 is pushed by the process set of workers 0 and 2 only."""
    shard = ShardStore(node_id=1, workers=3, sync=True)
    shard.worker_ids = {10: ("w0", 0), 11: ("w1", 1), 12: ("w2", 2)}
    shard.add_plan([[3, "set1.fusion", "float32", None, [[0, 4]], [0, 2]]])
    return shard


def test_a_process_sets_round_completes_with_its_workers_and_refuses_the_others() -> None:
    shard = set_store()
    assert shard.handle("w0", 1, push(10, 1, [1, 1, 1, 1])) == []
    with pytest.raises(WireError, match="worker 1 is not in the process set"):
        shard.handle("w1", 1, push(11, 1, [5, 5, 5, 5]))
    replies = shard.handle("w2", 1, push(12, 1, [2, 2, 2, 2]))
    assert [(peer, m.kind) for peer, _, m in replies] == [("w0", Kind.REPLY), ("w2", Kind.REPLY)]
    assert values(replies[0][2]) == [3] * 4
    assert shard.worker_left(1) == []  # a worker outside the set leaving fails none of its rounds
    assert shard.handle("w0", 1, push(10, 2, [1, 1, 1, 1])) == []
    failed = shard.worker_left(2)
    assert [m.kind for _, _, m in failed] == [Kind.ERROR] and "worker 2 has left" in failed[0][2].meta["error"]


def test_a_process_sets_round_counts_its_joined_workers_only() -> None:
    shard = set_store()
    shard.handle("w1", 1, Message(Kind.JOIN, sender=11, meta={"joined": True}))  # outside the set: no effect
    assert shard.handle("w0", 1, push(10, 1, [1, 1, 1, 1])) == []
    replies = shard.handle("w2", 1, Message(Kind.JOIN, sender=12, meta={"joined": True}))
    assert [m.kind for _, _, m in replies] == [Kind.REPLY] and values(replies[0][2]) == [1] * 4


@pytest.mark.parametrize("ranks", [[], [2, 0], [0, 0], [0, 3], ["0"], 1])
def test_a_plan_with_bad_ranks_is_refused(ranks: object) -> None:
    shard = ShardStore(node_id=1, workers=3, sync=True)
    with pytest.raises(WireError, match="must be sorted distinct workers"):
        shard.add_plan([[3, "t", "float32", None, [[0, 4]], ranks]])
    assert shard.chunks == {}
