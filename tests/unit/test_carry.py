"""Small allreduces carried by the coordinator tree (worker/collective/carry.py): the wire format, its checks, and
every rank's result from in-memory controllers whose messages all go through the wire format."""

from __future__ import annotations

import numpy as np
import pytest

from sluice.transport.wire import Kind, Message, WireError
from sluice.worker.collective.carry import Carrier, carried_bytes, check_blobs
from sluice.worker.collective.negotiation import Decision, Down, Request, Up
from sluice.worker.collective.negotiation_codec import decode_down, decode_up
from tests.unit.negotiation_helpers import Net, grad, wire

LIMIT = 256 << 10


class CarryNet(Net):
    """Net with a Carrier beside each Controller, run the way the coordinator runs them."""

    def __init__(self, n: int, arity: int, limit: int = LIMIT) -> None:
        super().__init__(n, arity)
        self.carrier = [Carrier(self.tree.children[r], n, limit) for r in range(n)]

    def submit_data(self, rank: int, request: Request, data: np.ndarray | None) -> None:
        self.ctl[rank].submit(request, self.now)
        self.carrier[rank].own(self.ctl[rank].fast_index(request.name), request, data)

    def take(self, rank: int, source: int, message: Up | Down) -> None:
        ctl = self.ctl[rank]
        check_blobs(message, ctl.table, "test")
        ctl.receive(source, message, self.now)
        if isinstance(message, Up):
            self.carrier[rank].take_up(source, message, ctl.epoch)
        else:
            self.carrier[rank].take_down(message, ctl.table)

    def tick(self, rank: int) -> tuple[list[tuple[int, Up | Down]], list[Decision]]:
        ctl = self.ctl[rank]
        return self.carrier[rank].attach(ctl.tick(self.now), ctl.take_decisions(), ctl.table, root=ctl.parent is None)


def _step(net: CarryNet, request: Request, data: list[np.ndarray | None]) -> list[np.ndarray | None]:
    """Every rank submits `request` (rank r with data[r]); each rank's result, once all have decided it."""
    before = [len(d) for d in net.decided]
    for rank, array in enumerate(data):
        net.submit_data(rank, request, array)
    net.settle()
    got = [net.decided[r][before[r]:] for r in range(len(data))]
    assert all(len(g) == 1 and g[0].request.name == request.name for g in got)
    return [g[0].result for g in got]


@pytest.mark.parametrize(("n", "arity"), [(1, 2), (2, 2), (5, 2), (7, 3), (6, 0)])
def test_a_small_allreduce_gets_every_ranks_sum_with_its_decision_from_the_second_step_on(n: int, arity: int) -> None:
    net = CarryNet(n, arity)
    request = grad(0)
    data = [np.full(12, rank + 1, np.float32) for rank in range(n)]
    assert _step(net, request, data) == [None] * n  # first step: slow path, the data plane moves it
    for step in range(3):
        results = _step(net, request, [d * (step + 1) for d in data])
        expected = np.full(12, n * (n + 1) // 2 * (step + 1), np.float32)
        for result in results:
            np.testing.assert_array_equal(result, expected)
    assert [c.carried for c in net.carrier] == [3] * n
    assert all(c.children == () or not any(c._below.values()) for c in net.carrier)  # nothing left behind


def test_an_average_is_divided_once_at_the_root_and_min_max_product_reduce_as_named() -> None:
    net = CarryNet(4, 2)
    data = [np.array([r + 1, -r, 2.0], np.float64) for r in range(4)]
    expected = {"average": [2.5, -1.5, 2.0], "min": [1, -3, 2], "max": [4, 0, 2], "product": [24, 0, 16]}
    for op, want in expected.items():
        request = Request(f"t.{op}", "allreduce", "float64", ((3,),), op)
        _step(net, request, data)  # slow path
        for result in _step(net, request, data):
            np.testing.assert_array_equal(result, np.array(want, np.float64))


def test_a_bigger_op_a_missing_rank_and_a_joined_rank_leave_it_to_the_data_plane_on_every_rank() -> None:
    net = CarryNet(4, 2, limit=64)
    big, small = Request("big", "allreduce", "float32", ((17,),)), Request("small", "allreduce", "float32", ((16,),))
    assert carried_bytes(big, 64) == 0 and carried_bytes(small, 64) == 64
    ones = [np.ones(16, np.float32)] * 4
    for _ in range(2):
        assert _step(net, big, [np.ones(17, np.float32)] * 4) == [None] * 4
        _step(net, small, ones)
    assert [r is not None for r in _step(net, small, [*ones[:3], None])] == [False] * 4  # rank 3 gave no data
    net.submit(2, Request("join", "join"))  # rank 2 takes part with zeros: the data plane's way
    before = [len(d) for d in net.decided]
    for rank in (0, 1, 3):
        net.submit_data(rank, small, ones[rank])
    net.settle()
    decided = [d for r in range(4) for d in net.decided[r][before[r]:]]
    assert [(d.request.name, d.result) for d in decided] == [("small", None)] * 4
    assert [c.carried for c in net.carrier] == [1] * 4  # the one step with every rank's data


def test_kinds_and_dtypes_that_are_not_summed_are_not_carried() -> None:
    assert carried_bytes(Request("g", "allgather", "float32", ((4,),)), LIMIT) == 0
    assert carried_bytes(Request("b", "broadcast", "float32", ((4,),), root=0), LIMIT) == 0
    assert carried_bytes(Request("x", "allreduce", "bool", ((4,),)), LIMIT) == 0
    assert carried_bytes(Request("e", "allreduce", "float32", ((0,),)), LIMIT) == 0
    assert carried_bytes(Request("h", "allreduce", "bfloat16", ((4, 2),)), LIMIT) == 16
    assert carried_bytes(Request("s", "allreduce", "float32", ((4,),), "average@0.5,2"), LIMIT) == 16


def test_sums_and_results_keep_their_bytes_through_the_wire_format() -> None:
    up = Up(seq=3, ready=(1 << 2) | (1 << 9), sums=((2, np.arange(4, dtype=np.float32)), (9, np.ones(2))))
    back, _ = wire(up)
    assert isinstance(back, Up) and back.ready == up.ready
    assert [(i, bytes(b)) for i, b in back.sums] == [(2, np.arange(4, dtype=np.float32).tobytes()),
                                                    (9, np.ones(2).tobytes())]
    down = Down(ack=1, decided=1 << 700, results=((700, np.arange(3, dtype=np.int64)),))
    back, size = wire(down)
    assert isinstance(back, Down) and back.decided == 1 << 700 and back.results[0][1] == np.arange(3).tobytes()
    assert size < 120  # the 87 leading zero bytes of the bit-vector are not sent


def _up_message(meta_v: list[list[int]], payload: bytes) -> Message:
    return Message(Kind.COORD_UP, round=1, dtype="uint8", shape=(len(payload),), payload=payload,
                   meta={"v": meta_v})


@pytest.mark.parametrize(("meta_v", "payload", "says"), [
    ([[1, 4]], b"\x01" + bytes(4), "does not mark"),  # bit 0 set, data for entry 1
    ([[0, 8]], b"\x01" + bytes(4), "leave no bit-vector"),
    ([[0, 2], [0, 2]], b"\x01" + bytes(4), "twice"),
    ([[0, -1]], b"\x01" + bytes(4), "size"),
    ([0], b"\x01" + bytes(4), "a data blob must be a list"),
])
def test_malformed_blobs_are_refused(meta_v: list[list[int]], payload: bytes, says: str) -> None:
    with pytest.raises(WireError, match=says):
        decode_up(_up_message(meta_v, payload))
    with pytest.raises(WireError, match=says):
        decode_down(Message(Kind.COORD_DOWN, dtype="uint8", shape=(len(payload),), payload=payload,
                            meta={"v": meta_v}))


def test_blobs_that_do_not_fit_the_table_are_refused() -> None:
    table = [grad(0), Request("g", "allgather", "float32", ((4,),))]
    check_blobs(Up(seq=1, ready=1, sums=((0, bytes(48)),)), table, "ok")
    with pytest.raises(WireError, match="carries 40 bytes for table entry 0, which takes 48"):
        check_blobs(Up(seq=1, ready=1, sums=((0, bytes(40)),)), table, "x")
    with pytest.raises(WireError, match="entry 1, which takes none"):
        check_blobs(Up(seq=1, ready=2, sums=((1, bytes(16)),)), table, "x")
    with pytest.raises(WireError, match="entry 2, which takes none"):
        check_blobs(Down(decided=4, results=((2, bytes(16)),)), table, "x")
    with pytest.raises(WireError, match="a table entry it sets"):
        check_blobs(Down(decided=1, entries=((0, grad(0)),), results=((0, bytes(48)),)), table, "x")


def test_data_held_for_an_op_that_failed_is_not_summed_into_its_next_round() -> None:
    net = CarryNet(3, 2)  # rank 0 the root, ranks 1 and 2 its children
    request, other = grad(0), Request("grad.0", "allreduce", "float32", ((2, 3),))
    ones = [np.ones(12, np.float32)] * 3
    _step(net, request, ones)  # slow path: the table gets the entry
    before = [len(d) for d in net.decided]
    net.submit_data(0, request, ones[0])
    net.submit_data(1, request, np.full(12, 100, np.float32))  # its sum reaches the root, which holds it
    net.submit_data(2, other, None)  # another shape: the op fails on every rank
    net.settle()
    assert all(d[before[r]].error is not None for r, d in enumerate(net.decided))
    net.carrier[1].limit = 0  # rank 1 now sends its request without data: nothing may stand in for it
    assert [r is None for r in _step(net, request, ones)] == [True] * 3
    net.carrier[1].limit = LIMIT
    for result in _step(net, request, ones):  # every rank's data again: carried, and the right sum
        np.testing.assert_array_equal(result, np.full(12, 3, np.float32))
