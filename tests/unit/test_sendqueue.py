"""ChannelQueue: most urgent first, FIFO among equals, and at most `bound` bytes ahead of an urgent chunk."""

from __future__ import annotations

import pytest

from sluice.transport.sendqueue import ChannelQueue

pytestmark = pytest.mark.timeout(10)

MiB = 1 << 20


def names(ready: list[tuple[int, int, str, float]]) -> list[str]:
    return [item for _, _, item, _ in ready]


def drain(queue: ChannelQueue[str]) -> list[str]:
    """Everything in the queue, in the order it leaves when every send is acknowledged at once."""
    out: list[str] = []
    while len(queue):
        ready = queue.pop_ready()
        assert ready, "a non-empty queue with nothing in flight must release an item"
        out += names(ready)
        queue.ack(sum(nbytes for _, nbytes, _, _ in ready))
    return out


@pytest.mark.parametrize(
    ("pushes", "order"),
    [
        ([], []),
        ([(0, "a")], ["a"]),
        ([(1, "a"), (1, "b"), (1, "c")], ["a", "b", "c"]),
        ([(2, "a"), (1, "b"), (0, "c")], ["c", "b", "a"]),
        ([(1, "a1"), (0, "b0"), (1, "a2"), (0, "b1"), (2, "c"), (0, "b2")], ["b0", "b1", "b2", "a1", "a2", "c"]),
        ([(5, "x"), (3, "y"), (5, "z"), (3, "w"), (4, "v")], ["y", "w", "v", "x", "z"]),
        ([(1 << 30, "late"), (0, "first")], ["first", "late"]),
    ],
)
def test_pop_order_is_priority_then_fifo(pushes: list[tuple[int, str]], order: list[str]) -> None:
    queue: ChannelQueue[str] = ChannelQueue(bound=1 << 40)
    for priority, item in pushes:
        queue.push(priority, 10, item)
    ready = queue.pop_ready()
    assert names(ready) == order
    assert [p for p, _, _, _ in ready] == sorted(p for p, _ in pushes)
    assert queue.inflight == 10 * len(pushes) and len(queue) == 0


@pytest.mark.parametrize(
    ("bound", "sizes", "inflight_before", "leaves"),
    [
        # nothing in flight: the head leaves whatever its size, then items while they fit
        (10, [4, 4, 4], 0, 2),
        (10, [5, 5, 1], 0, 2),
        (10, [10, 1], 0, 1),
        (10, [11, 1], 0, 1),
        (10, [100], 0, 1),
        (10, [1] * 20, 0, 10),
        # something in flight: an item leaves only when it fits under the bound
        (10, [4], 6, 1),
        (10, [5], 6, 0),
        (10, [1, 1, 1, 1, 1], 7, 3),
        (10, [100], 1, 0),
        (10, [0, 0, 0], 10, 3),  # zero-byte items (control messages) always fit
        # the head blocks everything behind it, even smaller items (no overtaking inside the heap)
        (10, [8, 1], 5, 0),
    ],
)
def test_in_flight_bound(bound: int, sizes: list[int], inflight_before: int, leaves: int) -> None:
    queue: ChannelQueue[str] = ChannelQueue(bound)
    if inflight_before:
        queue.push(0, inflight_before, "earlier")
        assert names(queue.pop_ready()) == ["earlier"]
    for index, size in enumerate(sizes):
        queue.push(1, size, f"item{index}")
    ready = queue.pop_ready()
    assert names(ready) == [f"item{i}" for i in range(leaves)]
    assert queue.inflight == inflight_before + sum(sizes[:leaves])
    assert len(queue) == len(sizes) - leaves
    assert queue.pop_ready() == [], "nothing more may leave before an ack"


def test_acks_release_items_as_they_fit() -> None:
    queue: ChannelQueue[str] = ChannelQueue(bound=10)
    for index in range(6):
        queue.push(0, 4, f"c{index}")
    assert names(queue.pop_ready()) == ["c0", "c1"]
    queue.ack(3)  # 5 in flight: 5 + 4 fits
    assert names(queue.pop_ready()) == ["c2"]
    queue.ack(1)  # 8 in flight: 8 + 4 does not fit
    assert queue.pop_ready() == []
    queue.ack(8)
    assert names(queue.pop_ready()) == ["c3", "c4"]
    assert queue.inflight == 8


@pytest.mark.parametrize(("bound", "chunk"), [(4 * MiB, MiB), (4 * MiB, 3 * MiB // 2), (MiB, MiB), (64 * 1024, MiB)])
def test_urgent_chunk_waits_behind_at_most_the_bound(bound: int, chunk: int) -> None:
    """The requirement: a high-priority chunk queued behind many low-priority chunks is sent after
    at most the in-flight bound (here: the bytes acknowledged before it leaves)."""
    queue: ChannelQueue[str] = ChannelQueue(bound)
    for index in range(100):
        queue.push(5, chunk, f"low{index}")
    sent = names(queue.pop_ready())
    assert len(sent) == max(1, bound // chunk)
    queue.push(0, chunk, "urgent")
    acked = 0
    while True:
        ready = names(queue.pop_ready())
        if ready:
            assert ready[0] == "urgent", f"{ready[0]} overtook the urgent chunk"
            break
        queue.ack(chunk)  # the oldest chunk in flight is acknowledged
        acked += chunk
        assert acked <= max(bound, chunk), "the urgent chunk waited for more than the in-flight bound"
    assert acked == chunk, "with equal chunks, the first ack makes room for the urgent one"


def test_literal_four_mib_bound() -> None:
    queue: ChannelQueue[str] = ChannelQueue(4 * MiB)
    for index in range(100):
        queue.push(10, MiB, f"low{index}")
    assert names(queue.pop_ready()) == ["low0", "low1", "low2", "low3"]
    queue.push(0, MiB, "urgent")
    assert queue.pop_ready() == []
    queue.ack(MiB)
    assert names(queue.pop_ready()) == ["urgent"]
    queue.ack(MiB)
    assert names(queue.pop_ready()) == ["low4"]
    assert len(queue) == 95 and queue.inflight == 4 * MiB


def test_push_front_keeps_order() -> None:
    """Items popped but not sent go back in front of their priority, in their original order."""
    queue: ChannelQueue[str] = ChannelQueue(bound=100)
    for item in ["a", "b", "c", "d", "e"]:
        queue.push(1, 10, item)
    queue.push(0, 10, "u")
    ready = queue.pop_ready()
    assert names(ready) == ["u", "a", "b", "c", "d", "e"]
    assert queue.inflight == 60
    # "u" and "a" were sent; the socket refused "b": the rest goes back, last first (as the transport does)
    for priority, nbytes, item, enqueued in reversed(ready[2:]):
        queue.push_front(priority, nbytes, item, enqueued)
    assert queue.inflight == 20
    queue.push(1, 10, "f")
    queue.push(0, 10, "v")
    assert drain(queue) == ["v", "b", "c", "d", "e", "f"]


def test_push_front_twice_keeps_order() -> None:
    queue: ChannelQueue[str] = ChannelQueue(bound=1000)
    for item in ["a", "b", "c"]:
        queue.push(2, 10, item)
    first = queue.pop_ready()
    for priority, nbytes, item, enqueued in reversed(first):
        queue.push_front(priority, nbytes, item, enqueued)
    second = queue.pop_ready()
    assert names(second) == ["a", "b", "c"]
    for priority, nbytes, item, enqueued in reversed(second[1:]):
        queue.push_front(priority, nbytes, item, enqueued)
    queue.push(2, 10, "d")
    assert drain(queue) == ["b", "c", "d"]
    assert queue.inflight == 10, "only the unacknowledged 'a' is still in flight"


def test_push_front_returns_the_bytes_in_flight() -> None:
    queue: ChannelQueue[str] = ChannelQueue(bound=10)
    queue.push(0, 6, "a")
    queue.push(0, 6, "b")
    assert names(queue.pop_ready()) == ["a"]
    assert queue.pop_ready() == []
    queue.push_front(0, 6, "a")
    assert queue.inflight == 0
    assert names(queue.pop_ready()) == ["a"]


@pytest.mark.parametrize(
    ("acks", "inflight"),
    [([5], 5), ([10], 0), ([11], 0), ([1 << 40], 0), ([3, 3, 3, 3], 0), ([4, 100, 0], 0), ([0], 10)],
)
def test_ack_never_goes_negative(acks: list[int], inflight: int) -> None:
    queue: ChannelQueue[str] = ChannelQueue(bound=100)
    queue.push(0, 10, "a")
    queue.pop_ready()
    for nbytes in acks:
        queue.ack(nbytes)
        assert queue.inflight >= 0
    assert queue.inflight == inflight


def test_ack_on_an_idle_queue() -> None:
    queue: ChannelQueue[str] = ChannelQueue(bound=1)
    queue.ack(123)
    assert queue.inflight == 0
    queue.push(0, 5, "a")
    queue.push(0, 5, "b")
    assert names(queue.pop_ready()) == ["a"], "a surplus ack must not become credit"


@pytest.mark.parametrize("bound", [0, -1])
def test_bound_must_be_positive(bound: int) -> None:
    with pytest.raises(ValueError):
        ChannelQueue(bound)


def _drain_at(queue: ChannelQueue[str], now: float) -> list[str]:
    out: list[str] = []
    while len(queue):
        ready = queue.pop_ready(now)
        out += names(ready)
        queue.ack(sum(nbytes for _, nbytes, _, _ in ready))
    return out


@pytest.mark.parametrize(
    ("pushes", "now", "order"),
    [
        # (priority, item, enqueued at); aging bound 1.0
        ([(5, "old", 0.0), (0, "new", 0.5)], 0.9, ["new", "old"]),  # not aged yet: priority wins
        ([(5, "old", 0.0), (0, "new", 0.5)], 1.0, ["old", "new"]),  # aged: it goes first
        ([(5, "a", 0.0), (5, "b", 0.1), (0, "u", 0.2), (7, "c", 1.9)], 1.5, ["a", "b", "u", "c"]),
        ([(3, "x", 0.0), (1, "y", 0.0), (2, "z", 2.0)], 1.0, ["x", "y", "z"]),  # aged ones leave in arrival order
    ],
)
def test_an_aged_item_leaves_before_newer_urgent_ones(
    pushes: list[tuple[int, str, float]], now: float, order: list[str]
) -> None:
    queue: ChannelQueue[str] = ChannelQueue(bound=10, aging=1.0)
    for priority, item, at in pushes:
        queue.push(priority, 10, item, at)
    assert _drain_at(queue, now) == order


def test_aging_bounds_the_wait_of_bulk_under_a_stream_of_urgent_items() -> None:
    """Urgent items keep arriving; without aging the bulk item would wait forever."""
    queue: ChannelQueue[str] = ChannelQueue(bound=10, aging=0.05)
    queue.push(9, 10, "bulk", 0.0)
    sent_at = None
    for step in range(100):
        now = step * 0.01
        queue.push(0, 10, f"u{step}", now)
        for _, nbytes, item, _ in queue.pop_ready(now):
            if item == "bulk":
                sent_at = now
            queue.ack(nbytes)
    assert sent_at is not None and 0.05 <= sent_at <= 0.06


def test_a_returned_item_keeps_its_age() -> None:
    queue: ChannelQueue[str] = ChannelQueue(bound=100, aging=1.0)
    queue.push(5, 10, "old", 0.0)
    ready = queue.pop_ready(0.0)
    for priority, nbytes, item, enqueued in ready:
        queue.push_front(priority, nbytes, item, enqueued)
    queue.push(0, 10, "new", 1.5)
    assert _drain_at(queue, 1.5) == ["old", "new"]


def test_take_gives_back_what_is_picked_in_leaving_order_and_the_rest_leaves_as_before() -> None:
    queue: ChannelQueue[str] = ChannelQueue(bound=10, aging=1.0)
    for priority, item in [(2, "b1"), (1, "a1"), (2, "b2"), (1, "a2"), (3, "c1")]:
        queue.push(priority, 4, item, now=0.0)
    assert [item for _, _, item, _ in queue.pop_ready(0.0)] == ["a1", "a2"]  # 8 of 10 bytes in flight
    taken = queue.take(lambda item: item.startswith(("a", "b")))  # what is in flight is not taken back
    assert taken == [(2, 4, "b1", 0.0), (2, 4, "b2", 0.0)]
    assert len(queue) == 1 and queue.inflight == 8
    assert queue.take(lambda item: False) == []
    queue.ack(8)
    # aged past the bound: the arrivals' order, which still lists the items taken, skips them
    assert [item for _, _, item, _ in queue.pop_ready(5.0)] == ["c1"]
    assert len(queue) == 0 and queue.pop_ready(5.0) == []
