"""The collective data plane: in-process ranks over a simulated network (random delivery orders, payloads
read from the sender's memory when delivered, as shared memory is), then forked processes over real
transports (shared memory, sockets)."""

from __future__ import annotations

import hashlib
import random
import time
from collections import deque
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import pytest

from sluice.errors import SluiceError
from sluice.transport.base import Transport
from sluice.transport.config import TransportConfig
from sluice.transport.wire import Kind, Message
from sluice.worker.collective.config import CollectiveConfig
from sluice.worker.collective.data import CollectiveHandle, DataPlane
from sluice.worker.collective.reduce import bf16_to_f32, f32_to_bf16
from testbed.ranks import Ranks

CASES = [("float32", "sum"), ("float32", "average"), ("float16", "sum"), ("float16", "average"),
         ("bfloat16", "sum"), ("bfloat16", "average"), ("float64", "sum"), ("int32", "average"), ("int64", "sum")]
EPS = {"float32": 1.2e-7, "float16": 9.8e-4, "bfloat16": 7.9e-3, "float64": 2.3e-16, "int32": 0.0, "int64": 0.0}


def inputs(case: int, rank: int, count: int, dtype: str) -> np.ndarray:
    """Rank `rank`'s input to case `case`: every rank can compute every rank's."""
    rng = np.random.default_rng(case * 1000 + rank)
    if dtype.startswith("int"):
        return rng.integers(-1000, 1000, count).astype(dtype)
    values = rng.standard_normal(count).astype(np.float32)
    if dtype == "bfloat16":
        out = np.empty(count, np.uint16)
        f32_to_bf16(values, out)
        return out
    return values.astype(dtype)


def as_float(array: np.ndarray, dtype: str) -> np.ndarray:
    return (bf16_to_f32(array) if dtype == "bfloat16" else array).astype(np.float64)


def check_sum(case: int, size: int, got: np.ndarray, dtype: str, op: str) -> str | None:
    """None if `got` is the sum (or mean) of every rank's input to `case`, within the dtype's rounding."""
    parts = [as_float(inputs(case, r, got.size, dtype), dtype) for r in range(size)]
    expected = sum(parts, np.zeros(got.size))
    if op == "average":
        expected = np.floor(expected / size) if dtype.startswith("int") else expected / size
    tolerance = 4 * size * EPS[dtype] * sum((np.abs(p) for p in parts), np.zeros(got.size)) + 1e-30
    bad = np.abs(as_float(got, dtype) - expected) > tolerance
    return f"case {case} ({dtype} {op}): {int(bad.sum())} of {got.size} wrong" if bad.any() else None


def digest(array: np.ndarray) -> str:
    return hashlib.sha1(array.tobytes()).hexdigest()


# ---------------------------------------------------------------------------- a simulated network
class FakeTransport:
    """Records sends into the network's links (FIFO per sender, receiver and channel) and refusals."""

    def __init__(self, name: str, net: Network) -> None:
        self.name, self.net = name, net
        self.config = TransportConfig(curve=False)
        self.refused: list[str] = []

    def send(self, peer: str, channel: int, msg: Message) -> None:
        self.net.links.setdefault((self.name, peer, channel), deque()).append(msg)

    def refuse(self, peer: str, text: str) -> None:
        self.refused.append(text)

    def connect(self, peer: str, endpoints: list[str]) -> None:
        self.net.dialled.append((self.name, peer))


class Network:
    """In-process ranks; `run` interleaves op starts and deliveries at random (seeded). A payload is read
    from the sender's memory at delivery, so a rank that reused its memory too early would be caught."""

    def __init__(self, size: int, seed: int, chunk_bytes: int = 64, timeout: float = 10.0, **options: Any) -> None:
        self.names = [f"worker-{r}" for r in range(size)]
        self.links: dict[tuple[str, str, int], deque[Message]] = {}
        self.dialled: list[tuple[str, str]] = []
        self.rng = random.Random(seed)
        self.transports = [FakeTransport(name, self) for name in self.names]
        self.planes = [DataPlane(cast(Transport, t), r, self.names, list(range(size)), chunk_bytes, CollectiveConfig(),
                                 timeout, lambda p: p % 3, **options) for r, t in enumerate(self.transports)]

    def deliver(self, link: tuple[str, str, int], copy: bool = False) -> Message:
        msg = self.links[link][0] if copy else self.links[link].popleft()
        payload = None if msg.payload is None else memoryview(np.ascontiguousarray(msg.payload)).cast("B")
        got = Message(msg.kind, sender=msg.sender, key=msg.key, chunk=msg.chunk, round=msg.round,
                      priority=msg.priority, dtype=msg.dtype, shape=msg.shape, payload=payload)
        self.planes[self.names.index(link[1])].on_message(link[0], got)
        return got

    def run(self, starts: list[list[Callable[[DataPlane], CollectiveHandle]]]) -> list[list[CollectiveHandle]]:
        handles: list[list[CollectiveHandle]] = [[] for _ in starts]
        while True:
            busy = [link for link, queue in self.links.items() if queue]
            choices = [("deliver", r) for r in range(min(len(busy), 3))]  # deliveries and starts both likely
            choices += [("start", r) for r, todo in enumerate(starts) if len(handles[r]) < len(todo)]
            if not choices:
                return handles
            what, rank = self.rng.choice(choices)
            if what == "deliver":
                self.deliver(self.rng.choice(busy))
            else:
                handles[rank].append(starts[rank][len(handles[rank])](self.planes[rank]))

    def refused(self) -> list[str]:
        return [text for t in self.transports for text in t.refused]


def scribble_when_done(handle: CollectiveHandle, array: np.ndarray, keep: list[np.ndarray]) -> None:
    """The caller takes the result and overwrites its memory the moment the op completes."""
    def done(h: CollectiveHandle) -> None:
        keep.append(h.result().copy())
        array.view(np.uint8)[:] = 0xFF  # NaN in every float dtype
    handle.add_done_callback(done)


def allreduce_start(rank: int, case: int, count: int, algorithm: str,
                    kept: list[np.ndarray]) -> Callable[[DataPlane], CollectiveHandle]:
    dtype, op = CASES[case % len(CASES)]
    array = inputs(case, rank, count, dtype)

    def go(plane: DataPlane) -> CollectiveHandle:
        handle = plane.allreduce(case, array, dtype, op, case % 5, algorithm)
        scribble_when_done(handle, array, kept)
        return handle
    return go


@pytest.mark.parametrize("algorithm", ["ring", "tree"])
@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
def test_simulated_allreduce_is_right_identical_and_reproducible(size: int, algorithm: str) -> None:
    counts = [0, 1, size - 1, 7, 301]
    cases = len(CASES) * len(counts)
    digests: dict[int, set[str]] = {}
    for seed in range(6):  # six delivery orders: bitwise the same results
        net = Network(size, seed, copy_below=256)  # small ops send copies, the rest waits for DONE
        results: list[list[list[np.ndarray]]] = [[[] for _ in range(cases)] for _ in range(size)]
        handles = net.run([[allreduce_start(r, c, counts[c // len(CASES)], algorithm, results[r][c])
                            for c in range(cases)] for r in range(size)])
        assert all(h.done() for row in handles for h in row), [h.pending() for row in handles for h in row]
        assert net.refused() == []
        for case in range(cases):
            dtype, op = CASES[case % len(CASES)]
            got = [results[r][case][0] for r in range(size)]
            assert check_sum(case, size, got[0], dtype, op) is None
            assert len({digest(g) for g in got}) == 1, f"ranks differ in case {case}"
            digests.setdefault(case, set()).add(digest(got[0]))
    assert all(len(d) == 1 for d in digests.values()), "results depend on the delivery order"


def exchange_starts(rank: int, size: int, rows: list[int], splits: list[int],
                    kept: dict[str, list[np.ndarray]]) -> list[Callable[[DataPlane], CollectiveHandle]]:
    """An allgather of `rows[rank]` rows, an alltoall of rows naming (source, destination, index), and a
    broadcast from the last rank; each op's memory overwritten once it completes."""
    block = np.full((rows[rank], 3, 2), rank, np.float32)
    table = np.array([[rank, dst, i] for dst in range(size) for i in range(splits[dst])], np.int64).reshape(-1, 3)
    bcast = np.arange(40, dtype=np.uint16) if rank == size - 1 else np.zeros(40, np.uint16)

    def gather(plane: DataPlane) -> CollectiveHandle:
        h = plane.allgather(0, block, "float32", 1)
        scribble_when_done(h, block, kept["gather"])
        return h

    def a2a(plane: DataPlane) -> CollectiveHandle:
        h = plane.alltoall(1, table, splits, "int64", 0)
        scribble_when_done(h, table, kept["a2a"])
        return h

    def broadcast(plane: DataPlane) -> CollectiveHandle:
        h = plane.broadcast(2, bcast, size - 1, "bfloat16", 2)
        scribble_when_done(h, bcast, kept["bcast"])
        return h
    return [gather, a2a, broadcast]


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_simulated_allgather_alltoall_broadcast(size: int) -> None:
    rows = [(3 * r + 2) % 4 for r in range(size)]  # uneven, 0 included
    splits = [[(r + 2 * i) % 3 for i in range(size)] for r in range(size)]
    for seed in range(4):
        net = Network(size, seed, copy_below=32)
        kept: list[dict[str, list[np.ndarray]]] = [{"gather": [], "a2a": [], "bcast": []} for _ in range(size)]
        handles = net.run([exchange_starts(r, size, rows, splits[r], kept[r]) for r in range(size)])
        assert net.refused() == []
        for r in range(size):
            expected = np.concatenate([np.full((rows[s], 3, 2), s, np.float32) for s in range(size)])
            assert np.array_equal(kept[r]["gather"][0], expected)
            assert handles[r][0].splits == rows
            incoming = np.array([[s, r, i] for s in range(size) for i in range(splits[s][r])], np.int64).reshape(-1, 3)
            assert np.array_equal(kept[r]["a2a"][0], incoming)
            assert handles[r][1].splits == [splits[s][r] for s in range(size)]
            assert np.array_equal(kept[r]["bcast"][0], np.arange(40, dtype=np.uint16))


@pytest.mark.parametrize("size", [1, 3])
def test_simulated_allgather_into_the_callers_buffer_and_one_of_the_wrong_size_fails(size: int) -> None:
    rows = [r + 1 for r in range(size)]
    total = sum(rows) * 6
    for seed in range(3):
        net = Network(size, seed, copy_below=32)
        outs = [np.full(total + (r == size - 1), -1.0, np.float32) for r in range(size)]  # the last: one too many

        def start(rank: int, out: np.ndarray) -> Callable[[DataPlane], CollectiveHandle]:
            return lambda plane: plane.allgather(0, np.full((rows[rank], 3, 2), rank, np.float32), "float32", 0, out)
        handles = net.run([[start(r, outs[r])] for r in range(size)])
        expected = np.concatenate([np.full(rows[s] * 6, s, np.float32) for s in range(size)])
        for rank in range(size - 1):  # the rows landed in the caller's buffer itself: no new array
            assert np.array_equal(outs[rank], expected) and np.shares_memory(handles[rank][0].result(), outs[rank])
        last = handles[size - 1][0]
        assert last.done() and last.error == (f"the allgather's output buffer holds {total + 1} elements, and the "
                                              f"ranks' rows ({rows}) make {total}"), last.error


def test_simulated_bad_messages_are_refused_and_change_nothing() -> None:
    net = Network(2, seed=0)
    a, b = np.arange(100, dtype=np.float32), np.ones(100, np.float32)
    h0 = net.planes[0].allreduce(5, a, "float32", "sum", 0)
    h1 = net.planes[1].allreduce(5, b, "float32", "sum", 0)
    link = next(k for k in net.links if k[:2] == ("worker-0", "worker-1"))
    while net.links[link][0].kind != Kind.COLL_DATA:  # rank 0's READY to rank 1 comes first
        net.deliver(link)
    real = net.links[link][0]
    payload = memoryview(np.zeros(real.shape[0], np.float32)).cast("B")
    victim = net.planes[1]

    def data(**fields: Any) -> Message:
        base = {"sender": 0, "key": real.key, "chunk": real.chunk, "round": 5, "dtype": "float32",
                "shape": real.shape, "payload": payload}
        return Message(Kind.COLL_DATA, **{**base, **fields})

    bad: list[tuple[str, Message]] = [
        ("worker-9", data()),  # not a peer
        ("worker-1", data(sender=1)),  # itself
        ("worker-0", data(sender=1)),  # the header names another rank
        ("worker-0", Message(Kind.PUSH, sender=0, round=5)),  # not a collective kind
        ("worker-0", data(payload=None, dtype="", shape=())),  # data without a payload
        ("worker-0", Message(Kind.COLL_DONE, sender=0, key=1, round=5, dtype="uint8", shape=(1,),
                             payload=memoryview(b"x"))),  # DONE with a payload
        ("worker-0", data(key=9)),  # step out of range
        ("worker-0", data(chunk=999)),  # chunk out of range
        ("worker-0", data(dtype="int32")),  # wrong dtype
        ("worker-0", data(shape=(1,), payload=memoryview(b"\0" * 4))),  # wrong length
        ("worker-0", Message(Kind.COLL_DONE, sender=0, key=1, round=5)),  # DONE before we sent it anything
        ("worker-0", Message(Kind.COLL_DONE, sender=0, key=7, round=5)),  # unknown control key
        ("worker-0", data(round=3)),  # an op older than the last started: never runs again
        ("worker-0", data(round=5 + (1 << 20))),  # too far ahead
        ("worker-0", Message(Kind.COLL_DONE, sender=0, key=2, chunk=0)),  # HELLO from a rank that does not dial
    ]
    for count, (peer, msg) in enumerate(bad, 1):
        victim.on_message(peer, msg)
        assert len(net.transports[1].refused) == count, (count, peer, msg)
    net.deliver(link, copy=True)  # the real first chunk, twice: the second copy is refused
    net.deliver(link)
    assert len(net.transports[1].refused) == len(bad) + 1 and "twice" in net.transports[1].refused[-1]
    net.run([[], []])
    for handle in (h0, h1):
        handle.wait(0)
        assert np.array_equal(handle.result(), np.arange(100, dtype=np.float32) + 1)


def test_simulated_early_messages_are_kept_within_bounds() -> None:
    net = Network(2, seed=1, chunk_bytes=64, early_ops=3, early_bytes=4096)
    late = net.planes[1]
    # rank 0 starts four ops rank 1 has not: per op only its READY and the eager budget (64 bytes: one
    # chunk) move, and only three ops' worth is kept; the fourth op's two messages are refused
    arrays = [np.full(64, i, np.float32) for i in range(4)]
    handles = [net.planes[0].allreduce(i, arrays[i], "float32", "sum", 0) for i in range(4)]
    while any(net.links.values()):
        net.deliver(next(k for k, q in net.links.items() if q))
    assert late.early_kept == 6 and len(net.transports[1].refused) == 2
    assert all("too far ahead" in text for text in net.transports[1].refused)
    mine = [np.ones(64, np.float32) for _ in range(3)]
    handles += [late.allreduce(i, mine[i], "float32", "sum", 0) for i in range(3)]
    net.run([[], []])
    for i in range(3):
        assert handles[i].done() and np.all(mine[i] == i + 1)
    assert not handles[3].done()  # its first chunk was refused: it can only time out


def test_simulated_early_data_beyond_the_eager_budget_is_refused() -> None:
    net = Network(2, seed=2, chunk_bytes=64)
    msg = Message(Kind.COLL_DATA, sender=0, key=0, chunk=0, round=3, dtype="float32", shape=(16,),
                  payload=memoryview(b"\0" * 64))
    for _ in range(4):
        net.planes[1].on_message("worker-0", msg)
    assert net.planes[1].early_kept == 3  # the budget (64 bytes) and the room for row counts (128)
    assert "eager budget" in net.transports[1].refused[0]


def test_simulated_timeout_names_the_missing_rank_and_fail_ends_everything() -> None:
    net = Network(3, seed=3, timeout=0.3)
    arrays = [np.ones(1000, np.float32) for _ in range(3)]
    handles = [net.planes[r].allreduce(1, arrays[r], "float32", "sum", 0) for r in (0, 1)]  # rank 2 never starts
    while any(net.links.values()):
        net.deliver(next(k for k, q in net.links.items() if q))
    with pytest.raises(SluiceError, match=r"allreduce \(ring\) seq 1 on rank 0: not done after .*rank 2: "):
        handles[0].wait(0.01)  # a short wait raises but the op goes on
    assert not handles[0].done()
    for rank, handle in enumerate(handles):
        with pytest.raises(SluiceError, match=rf"allreduce \(ring\) seq 1 on rank {rank} failed: no completion "
                                              r"after 0.3 s; it waits for ranks .*rank 2: "):
            handle.wait()
    pending = net.planes[2].allgather(4, np.zeros((1, 2), np.float32), "float32", 0)
    net.planes[2].fail("the job is over")
    with pytest.raises(SluiceError, match="allgather seq 4 on rank 2 failed: the job is over"):
        pending.wait()
    later = net.planes[2].broadcast(5, np.zeros(3, np.float32), 0, "float32", 0)
    assert later.done()
    with pytest.raises(SluiceError, match="the job is over"):
        later.result()


def test_simulated_connect_dials_lower_ranks_and_waits_for_the_higher() -> None:
    net = Network(3, seed=0)
    net.planes[2].connect([["a"], ["b"], ["c"]], timeout=1.0)  # the highest rank waits for nobody
    assert net.dialled == [("worker-2", "worker-0"), ("worker-2", "worker-1")]
    while any(net.links.values()):  # its HELLOs, one per channel
        net.deliver(next(k for k, q in net.links.items() if q))
    with pytest.raises(SluiceError, match=r"rank 0: no HELLO after 0.05 s from ranks \[1\]"):
        net.planes[0].connect([["a"], ["b"], ["c"]], timeout=0.05)
    net.planes[1].connect([["a"], ["b"], ["c"]], timeout=0.05)
    while any(net.links.values()):
        net.deliver(next(k for k, q in net.links.items() if q))
    net.planes[0].connect([["a"], ["b"], ["c"]], timeout=0.05)
    assert net.refused() == []


def test_arguments_are_checked() -> None:
    plane = Network(2, seed=0).planes[0]
    with pytest.raises(ValueError, match="contiguous 1-D array of uint16 for bfloat16"):
        plane.allreduce(0, np.zeros(4, np.float32), "bfloat16", "sum", 0)
    with pytest.raises(ValueError, match="contiguous"):
        plane.allreduce(0, np.zeros(8, np.float32)[::2], "float32", "sum", 0)
    with pytest.raises(ValueError, match="op must be"):
        plane.allreduce(0, np.zeros(4, np.float32), "float32", "median", 0)
    with pytest.raises(ValueError, match="algorithm"):
        plane.allreduce(0, np.zeros(4, np.float32), "float32", "sum", 0, "butterfly")
    with pytest.raises(ValueError, match="splits"):
        plane.alltoall(0, np.zeros((3, 2), np.float32), [1, 1], "float32", 0)
    with pytest.raises(ValueError, match="root"):
        plane.broadcast(0, np.zeros(3, np.float32), 2, "float32", 0)
    plane.allreduce(7, np.zeros(4, np.float32), "float32", "sum", 0)
    with pytest.raises(ValueError, match="not above the last one"):
        plane.allreduce(7, np.zeros(4, np.float32), "float32", "sum", 0)
    # "auto": the tree below collective.tree_below_bytes (4 MiB by default), the ring from there on
    assert plane.allreduce(8, np.zeros((1 << 20) - 1, np.float32), "float32", "sum", 0, "auto").what.startswith(
        "allreduce (tree) seq 8")
    assert plane.allreduce(9, np.zeros(1 << 20, np.float32), "float32", "sum", 0, "auto").what.startswith(
        "allreduce (ring) seq 9")


# ---------------------------------------------------------------------------- forked processes, real transports
#: 16 KiB chunks: full chunks go through shared memory, tails inline; a small in-flight bound keeps the
#: credit path busy
FORKED = TransportConfig(chunk_bytes=16 << 10, inflight_bytes=128 << 10, curve=False)


def _allreduce_rank(plane: DataPlane, transport: Transport, rank: int, size: int, algorithm: str) -> list[Any]:
    """Every case at once (all in flight), twice; results overwritten the moment each completes."""
    counts = [0, 1, size - 1, 1000, 65_537]
    cases = [(c, n) for n in counts for c in range(len(CASES))]
    out: list[Any] = []
    for run in range(2):
        started = []
        for seq, (case, count) in enumerate(cases):
            dtype, op = CASES[case]
            source = inputs(case, rank, count, dtype)
            array = transport.alloc(count, source.dtype) if seq % 2 else np.empty(count, source.dtype)
            array[:] = source
            started.append((case, array, plane.allreduce(run * len(cases) + seq, array, dtype, op, seq % 4, algorithm)))
        for case, array, handle in started:
            handle.wait()
            dtype, op = CASES[case]
            out.append((check_sum(case, size, array, dtype, op), digest(array)))
            array.view(np.uint8)[:] = 0xFF  # the memory is ours again at once: peers must be done with it
    return out


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("algorithm", ["ring", "tree"])
@pytest.mark.parametrize("size", [2, 3, 4])
def test_forked_allreduce(size: int, algorithm: str) -> None:
    with Ranks(size, FORKED) as ranks:
        results = ranks.run(_allreduce_rank, algorithm, limit=45)
    for rank in range(size):
        assert [problem for problem, _ in results[rank] if problem] == [], rank
    digests = [[d for _, d in results[rank]] for rank in range(size)]
    assert all(d == digests[0] for d in digests), "ranks differ"
    half = len(digests[0]) // 2
    assert digests[0][:half] == digests[0][half:], "two runs differ"


def _gather_rank(plane: DataPlane, transport: Transport, rank: int, size: int) -> list[str]:
    problems = []
    rows = [2, 0, 3][:size]
    block = transport.alloc(rows[rank] * 6, np.dtype(np.float32)).reshape(rows[rank], 3, 2)
    block[:] = rank
    gather = plane.allgather(0, block, "float32", 0)
    small = np.full((rank + 1, 5), rank, np.int8)
    gather8 = plane.allgather(1, small, "int8", 2)
    root_data = np.arange(100_003, dtype=np.float32)
    bcast = transport.alloc(100_003, np.dtype(np.float32))
    bcast[:] = root_data if rank == 1 else 0
    broadcast = plane.broadcast(2, bcast, 1, "float32", 1)
    splits = [(rank + 2 * i) % 3 for i in range(size)]
    table = np.array([[rank, dst, i] for dst in range(size) for i in range(splits[dst])], np.int64).reshape(-1, 3)
    a2a = plane.alltoall(3, table, splits, "int64", 0)
    expected = np.concatenate([np.full((rows[s], 3, 2), s, np.float32) for s in range(size)])
    if not np.array_equal(gather.result(), expected) or gather.splits != rows:
        problems.append(f"allgather float32 on rank {rank}")
    expected8 = np.concatenate([np.full((s + 1, 5), s, np.int8) for s in range(size)])
    if not np.array_equal(gather8.result(), expected8):
        problems.append(f"allgather int8 on rank {rank}")
    broadcast.wait()
    if not np.array_equal(bcast, root_data):
        problems.append(f"broadcast on rank {rank}")
    incoming = np.array([[s, rank, i] for s in range(size) for i in range((s + 2 * rank) % 3)], np.int64)
    if not np.array_equal(a2a.result(), incoming.reshape(-1, 3)) or a2a.splits != [(s + 2 * rank) % 3 for s in
                                                                                      range(size)]:
        problems.append(f"alltoall on rank {rank}")
    return problems


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_forked_allgather_broadcast_alltoall() -> None:
    with Ranks(3, FORKED) as ranks:
        assert ranks.run(_gather_rank, limit=45) == [[], [], []]


def _late_rank(plane: DataPlane, transport: Transport, rank: int, size: int) -> tuple[int, bool]:
    """Rank 0 starts at once, the others once its first messages have come (not a fixed delay, which a
    loaded machine can outlast): its eager chunks wait for them, the rest for their READY."""
    deadline = time.monotonic() + 10.0
    while rank and plane.early_kept == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    big = np.full(300_000, rank + 1, np.float32)
    small = np.full(10, rank + 1, np.int64)
    handles = [plane.allreduce(0, big, "float32", "sum", 1), plane.allreduce(1, small, "int64", "sum", 0, "tree")]
    for handle in handles:
        handle.wait()
    total = size * (size + 1) // 2
    return plane.early_kept, bool(np.all(big == total) and np.all(small == total))


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_forked_early_arrivals_are_kept_until_the_op_starts() -> None:
    with Ranks(3, FORKED) as ranks:
        results = ranks.run(_late_rank, limit=45)
    assert all(ok for _, ok in results)
    assert results[1][0] > 0 and results[2][0] > 0  # rank 0's first messages came before they started


def _refusing_rank(plane: DataPlane, transport: Transport, rank: int, size: int, started: Any) -> tuple[int, bool]:
    """Rank 0 sends rank 1 garbage, some of it for an op rank 1 runs; rank 1 refuses it all, the ops complete."""
    data = np.full(50_000, rank + 1, np.float32)
    plane.allreduce(0, data, "float32", "sum", 0).wait()
    if rank == 1:
        handle = plane.allreduce(1, data, "float32", "sum", 0)
        started.set()
    else:
        started.wait(10)  # rank 1 runs op 1 and waits for our data: send it garbage first
        chunk = np.zeros(4096, np.float32)
        for fields in ({"sender": 5}, {"round": 0}, {"round": 1, "chunk": 10_000}, {"round": 1, "dtype": "int32"},
                       {"round": 1 << 40}):
            msg = Message(Kind.COLL_DATA, **{"sender": 0, "dtype": "float32", "shape": (4096,), "payload": chunk,
                                             **fields})
            transport.send("worker-1", 0, msg)
        transport.send("worker-1", 0, Message(Kind.PUSH, sender=0, round=1))
        handle = plane.allreduce(1, data, "float32", "sum", 0)
    handle.wait()
    refused = int(transport.stats()["rejected"])
    return refused, bool(np.all(data == 6))  # (1 + 2), then (3 + 3)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_forked_bad_messages_are_refused_while_ops_complete() -> None:
    with Ranks(2, FORKED) as ranks:
        results = ranks.run(_refusing_rank, ranks.event(), limit=45)
    assert results == [(0, True), (6, True)]


def _stalled_rank(plane: DataPlane, transport: Transport, rank: int, size: int) -> str:
    if rank == 2:
        time.sleep(1.5)  # never starts op 1
        return ""
    try:
        plane.allreduce(1, np.ones(100_000, np.float32), "float32", "sum", 0).wait()
    except SluiceError as exc:
        return str(exc)
    return "completed"


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_forked_timeout_names_the_missing_rank() -> None:
    with Ranks(3, FORKED, timeout=1.0) as ranks:
        errors = ranks.run(_stalled_rank, limit=45)
    for rank in (0, 1):
        assert f"allreduce (ring) seq 1 on rank {rank} failed: no completion after 1 s" in errors[rank]
        assert "rank 2: " in errors[rank], errors[rank]
