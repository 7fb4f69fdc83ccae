"""ps.replicas: a server's commits mirrored through the wire format into another holder's file, replies held until
the holder has the round ps.mirror_every before, every malformed MIRROR refused, the mirror restoring the state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sluice.ps.config import ServerConfig
from sluice.ps.mirror import PIECE_BYTES, Holder, MirrorSender, holders, mirror_messages
from sluice.ps.mirror_holder import MirrorHolder
from sluice.ps.recovered import Recovery
from sluice.ps.snapshot import StateFile, state_tag
from sluice.ps.store import Chunk, Reply, ShardStore
from sluice.scheduler.recovery import Placement
from sluice.transport.wire import Flag, Kind, Message, WireError, decode, encode

TAG = state_tag(b"m" * 32)
WORKERS = 2
PRIMARY, HOLDER = "server-0", "server-1"
SGD_MOMENTUM = {"name": "sgd", "lr": 0.1, "momentum": 0.9, "nesterov": True}
ADAM = {"name": "adam", "lr": 0.01, "weight_decay": 0.001}
#: key -> (dtype, length, optimizer): one chunk larger than a MIRROR piece with Adam (it goes in pieces)
TENSORS = {1: ("float32", 5, SGD_MOMENTUM), 2: ("bfloat16", 300_000, ADAM), 3: ("float64", 3, None)}


def plan() -> list[Any]:
    return [[key, f"t{key}", dtype, opt, [[0, length]]] for key, (dtype, length, opt) in TENSORS.items()]


def primary(directory: Path, every: int = 1) -> tuple[ShardStore, MirrorSender]:
    store = ShardStore(node_id=7, workers=WORKERS, sync=True)
    store.worker_ids = {10 + r: (f"w{r}", r) for r in range(WORKERS)}
    store.recovery = Recovery(StateFile.open(TAG, 0, str(directory), lock_timeout=0.2))
    sender = MirrorSender(0, [Holder(1, HOLDER, "198.18.0.4")], node_id=7, timeout=5.0, clock=lambda: 100.0,
                          every=every)
    store.recovery.after_commit, store.recovery.before_step = sender.committed, sender.stepping
    store.add_plan(plan())
    return store, sender


def holder(directory: Path, every: int = 1) -> MirrorHolder:
    held = MirrorHolder(TAG, 1, node_id=8, workers=WORKERS, directory=str(directory), every=every)
    held.hold(0, PRIMARY, 7)
    held.add_plan(0, plan())
    return held


def wire(msg: Message) -> Message:
    """Through the real encoding, as the transport would carry it."""
    return decode([bytes(memoryview(frame)) if not isinstance(frame, bytes) else frame for frame in encode(msg)])


def push(key: int, rank: int, round_: int) -> Message:
    dtype, length, _ = TENSORS[key]
    values = np.random.default_rng(round_ * 10 + rank + key).standard_normal(length).astype(np.float32)
    data = (values.view(np.uint32) >> 16).astype(np.uint16) if dtype == "bfloat16" else values.astype(dtype)
    return Message(Kind.PUSH, sender=10 + rank, key=key, chunk=0, round=round_, dtype=dtype, shape=(length,),
                   flags=Flag.WANT_REPLY, payload=memoryview(data))


def deliver(out: list[Reply], held: MirrorHolder, sender: MirrorSender) -> tuple[list[Reply], int]:
    """Send the MIRRORs in `out` to the holder and its acks back: the worker replies released, and MIRRORs sent."""
    replies, mirrors = [r for r in out if r[2].kind != Kind.MIRROR], [r for r in out if r[2].kind == Kind.MIRROR]
    for to, _, msg in mirrors:
        assert to == HOLDER
        for _, _, ack in held.take(PRIMARY, wire(msg)):
            replies += sender.acked(HOLDER, wire(ack))
    return replies, len(mirrors)


def state_of(c: Chunk) -> tuple[Any, ...]:
    state = {k: v.tobytes() if isinstance(v, np.ndarray) else v for k, v in c.opt_state.items()}
    return c.round, c.value.tobytes(), state, type(c.optimizer), c.bcast_version, \
        None if c.bcast is None else c.bcast.tobytes()


@pytest.mark.timeout(10)
def test_placement_is_the_next_servers_each_on_another_host() -> None:
    assert holders(["a", "b"]) == {0: [1], 1: [0]}
    assert holders(["a", "a", "b", "b"]) == {0: [2], 1: [2], 2: [0], 3: [0]}
    assert holders(["a", "a"]) == {}
    assert holders(["a", "a"], same_host=True) == {0: [1], 1: [0]}
    # ps.replicas = 2: the next two servers on hosts other than the server's and each other's
    assert holders(["a", "b", "c"], replicas=2) == {0: [1, 2], 1: [2, 0], 2: [0, 1]}
    assert holders(["a", "a", "b", "b", "c"], replicas=2) == {0: [2, 4], 1: [2, 4], 2: [4, 0], 3: [4, 0],
                                                               4: [0, 2]}
    assert holders(["a", "b"], replicas=3) == {0: [1], 1: [0]}  # fewer where the servers span fewer hosts
    assert holders(["a", "a", "a"], same_host=True, replicas=2) == {0: [1, 2], 1: [2, 0], 2: [0, 1]}


@pytest.mark.timeout(10)
def test_placement_after_hosts_are_lost_keeps_the_copies_that_survive() -> None:
    """Three servers on hosts a, b, c with ps.replicas = 2. Host a is lost: server 0 moves to b (its first
    holder's host), holds nothing from then on, and is held on c only; server 2 keeps its copy on b. Then host c:
    server 2 moves to b too (server 1 holds it), and nothing is left on another host."""
    placement = Placement(holders(["a", "b", "c"], replicas=2))
    hosts = ["a", "b", "c"]
    assert [placement.holders(r, hosts) for r in range(3)] == [[1, 2], [2, 0], [0, 1]]
    assert [placement.holds(r, hosts) for r in range(3)] == [[1, 2], [0, 2], [0, 1]]
    placement.moved.add(0)
    hosts = ["b", "b", "c"]
    assert [placement.holders(r, hosts) for r in range(3)] == [[2], [2], [1]]
    assert [placement.holds(r, hosts) for r in range(3)] == [[], [2], [0, 1]]
    placement.moved.add(2)
    hosts = ["b", "b", "b"]
    assert [placement.holders(r, hosts) for r in range(3)] == [[], [], []]


@pytest.mark.timeout(30)
def test_replies_wait_for_the_mirror_and_the_mirror_restores_the_exact_state(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    store, sender = primary(tmp_path / "a")
    held = holder(tmp_path / "b")
    bcast = np.arange(5, dtype=np.float32)
    out = sender.take(store.handle("w0", 0, Message(Kind.BCAST_PUSH, sender=10, key=1, round=1, dtype="float32",
                                                   shape=(5,), flags=Flag.WANT_REPLY, payload=memoryview(bcast))))
    assert [m.kind for _, _, m in out] == [Kind.MIRROR]  # the broadcast's ack waits for its mirror
    released, _ = deliver(out, held, sender)
    assert [m.kind for _, _, m in released] == [Kind.BCAST_REPLY]
    pieces = 0
    carried: dict[int, list[bool]] = {key: [] for key in TENSORS}
    late: dict[int, list[Reply]] = {}  # MIRRORs of odd rounds, acknowledged only after the next round completed
    for round_ in range(1, 4):
        for key in TENSORS:
            first = sender.take(store.handle("w0", 0, push(key, 0, round_)))
            assert first == []  # no reply before the round completes
            out = sender.take(store.handle("w1", 0, push(key, 1, round_)))
            mirrors = [r for r in out if r[2].kind == Kind.MIRROR]
            assert out[:len(mirrors)] == mirrors, "a reply went before its round's MIRROR"
            carried[key].append(mirrors[0][2].meta["grad"])
            replied = sorted(to for to, _, m in out if m.kind == Kind.REPLY)
            if key in late:  # the round before is not acknowledged: this round's replies wait for it
                assert replied == [], "a reply went out two rounds ahead of the holder"
                released, sent = deliver(late.pop(key), held, sender)
                pieces += sent
                replied = sorted(to for to, _, m in released if m.kind == Kind.REPLY)
            assert replied == ["w0", "w1"]  # at once when the round before was acknowledged
            if round_ % 2:
                late[key] = mirrors
            else:
                released, sent = deliver(mirrors, held, sender)
                assert released == []
                pieces += sent
    for mirrors in late.values():
        assert deliver(mirrors, held, sender)[0] == []
        pieces += len(mirrors)
    assert pieces > 3 * len(TENSORS)  # the Adam chunk needed several pieces
    # the gradient once the holder has the round before (key 1's broadcast gave it round 0); never without
    # an optimizer (the sum is the value)
    assert carried == {1: [True, True, True], 2: [False, True, True], 3: [False, False, False]}
    assert sender.overdue(1000.0) is None and sender.mirrored == held.taken == 3 * len(TENSORS) + 1
    # the holder's host takes over: the mirror, released, is what a replacement there restores
    path = held.release(0)
    assert path == str(tmp_path / "b" / f"sluice-state-{TAG}-mirror-0-by-1") and held.release(0) is None
    assert store.recovery is not None
    replacement = ShardStore(node_id=7, workers=WORKERS, sync=True)
    replacement.recovery = Recovery(StateFile.open(TAG, 0, str(tmp_path / "b"), lock_timeout=0.2, held_by=1))
    assert len(replacement.add_plan(plan(), recovering=True)) == len(TENSORS)
    for key in TENSORS:
        assert state_of(replacement.chunks[(key, 0)]) == state_of(store.chunks[(key, 0)])
    held.close()
    replacement.recovery.close()
    store.recovery.close()


@pytest.mark.timeout(30)
def test_every_third_round_mirrors_the_state_and_replies_wait_for_the_round_that_many_before(tmp_path: Path) -> None:
    """ps.mirror_every = 3: each chunk's state (never a gradient) at its first round, then at its own phase
    ((round + 7 key + chunk) % 3 == 0: key 1 at 2, 5; key 2 at 4, 7) and at most 3 rounds apart; a reply of round
    R waits until the holder acknowledged round R - 3 (MIRRORs are delivered only when a reply waits)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    store, sender = primary(tmp_path / "a", every=3)
    held = holder(tmp_path / "b", every=3)
    waiting: dict[int, list[Reply]] = {1: [], 2: []}
    mirrored: dict[int, list[int]] = {1: [], 2: []}
    waited: dict[int, list[int]] = {1: [], 2: []}
    states: dict[tuple[int, int], tuple[Any, ...]] = {}
    for round_ in range(1, 8):
        for key in (1, 2):
            sender.take(store.handle("w0", 0, push(key, 0, round_)))
            out = sender.take(store.handle("w1", 0, push(key, 1, round_)))
            mirrors = [r for r in out if r[2].kind == Kind.MIRROR]
            assert not any(m.meta["grad"] for _, _, m in mirrors if m.meta and "grad" in m.meta)
            mirrored[key] += sorted({m.round for _, _, m in mirrors})
            waiting[key] += mirrors
            replied = sorted((to, m.round) for to, _, m in out if m.kind == Kind.REPLY)
            if not replied:
                waited[key].append(round_)
                released, _ = deliver(waiting[key], held, sender)
                replied = sorted((to, m.round) for to, _, m in released)
                waiting[key] = []
            assert replied == [("w0", round_), ("w1", round_)]
            states[(key, round_)] = state_of(store.chunks[(key, 0)])
    assert mirrored == {1: [1, 2, 5], 2: [1, 4, 7]}
    assert waited == {1: [4, 6], 2: [4]}  # round 4 waits for round 1, key 1's round 6 for 5 (its round 3 never went)
    assert deliver(waiting[1] + waiting[2], held, sender)[0] == [] and held.taken == 6
    path = held.release(0)
    assert path is not None and store.recovery is not None
    replacement = ShardStore(node_id=7, workers=WORKERS, sync=True)
    replacement.recovery = Recovery(StateFile.open(TAG, 0, str(tmp_path / "b"), lock_timeout=0.2, held_by=1))
    replacement.add_plan(plan(), recovering=True)
    for key in (1, 2):  # the primary's state at the chunk's last mirrored round
        assert state_of(replacement.chunks[(key, 0)]) == states[(key, mirrored[key][-1])]
    held.close()
    replacement.recovery.close()
    store.recovery.close()


def mirror_of(store: ShardStore, sender: MirrorSender) -> Message:
    out = sender.take(store.handle("w0", 0, push(1, 0, 1)) + store.handle("w1", 0, push(1, 1, 1)))
    return next(m for _, _, m in out if m.kind == Kind.MIRROR)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("change, error", [
    (lambda m: setattr(m, "sender", 99), "no server this one mirrors"),
    (lambda m: setattr(m, "key", 9), "its plan does not have"),
    (lambda m: setattr(m, "round", 2), "which is at round 0"),
    (lambda m: m.meta.update(bits=8), "meta bits"),
    (lambda m: m.meta.update(opt=[1, 0.1]), "meta opt"),
    (lambda m: m.meta.update(opt=[5, *[0.0] * 5]), "not valid"),
    (lambda m: m.meta.update(bv=1), "lacks its buffer"),
    (lambda m: m.meta.update(at=4), "does not follow"),
    (lambda m: m.meta.update(grad=1), "must be bools"),
    (lambda m: m.meta.update(grad=True), "keeps no state to step"),
    (lambda m: m.meta.update(grad=True, bv=1, bcast=True), "must name an optimizer and no new broadcast"),
    (lambda m: (setattr(m, "payload", memoryview(bytes(8 * 5 + 4))), setattr(m, "shape", (44,))), "more than"),
    (lambda m: (setattr(m, "dtype", "float32"), setattr(m, "shape", (10,))), "must carry bytes"),
])
def test_a_malformed_mirror_is_refused_and_the_file_keeps_its_round(tmp_path: Path, change: Any,
                                                                     error: str) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    store, sender = primary(tmp_path / "a")
    held = holder(tmp_path / "b")
    good = mirror_of(store, sender)
    msg = wire(good)
    change(msg)
    with pytest.raises(WireError, match=error):
        held.take(PRIMARY, msg)
    with pytest.raises(WireError, match="no server this one mirrors"):
        held.take("worker-0", wire(good))
    assert held.taken == 0 and held.primaries[PRIMARY].chunks[(1, 0)].round == 0
    with pytest.raises(WireError, match="nobody awaits"):
        sender.acked(HOLDER, Message(Kind.MIRROR_ACK, sender=8, key=3, chunk=0, round=1))
    assert "has not acknowledged a mirrored commit" in (sender.overdue(200.0) or "")
    held.close()
    assert store.recovery is not None
    store.recovery.close()


@pytest.mark.timeout(30)
def test_a_gradient_mirror_steps_the_holders_copy_and_is_refused_where_there_is_none(tmp_path: Path) -> None:
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
    store, sender = primary(tmp_path / "a")
    held, fresh = holder(tmp_path / "b"), holder(tmp_path / "c")
    deliver(sender.take(store.handle("w0", 0, push(1, 0, 1)) + store.handle("w1", 0, push(1, 1, 1))), held, sender)
    out = sender.take(store.handle("w0", 0, push(1, 0, 2)) + store.handle("w1", 0, push(1, 1, 2)))
    mirror = next(m for _, _, m in out if m.kind == Kind.MIRROR)
    assert mirror.meta["grad"] is True and mirror.nbytes == 5 * 4  # the gradient only, not value and momentum
    with pytest.raises(WireError, match="which is at round 0"):
        fresh.take(PRIMARY, wire(mirror))  # it never had round 1
    # a restarted holder steps from what its file kept: round 2 onto round 1, and it equals the primary's
    held.close()
    held = holder(tmp_path / "b")
    assert deliver(out, held, sender)[1] == 1
    assert state_of(held.primaries[PRIMARY].chunks[(1, 0)])[:3] == state_of(store.chunks[(1, 0)])[:3]
    out = sender.take(store.handle("w0", 0, push(1, 0, 3)) + store.handle("w1", 0, push(1, 1, 3)))
    mirror = next(m for _, _, m in out if m.kind == Kind.MIRROR)
    tampered = wire(mirror)
    tampered.meta["t"] = 5  # not what its step gives
    with pytest.raises(WireError, match="diverged"):
        held.take(PRIMARY, tampered)
    with pytest.raises(WireError, match="keeps no state to step"):
        held.take(PRIMARY, wire(mirror))  # its copy diverged: dropped, only a state MIRROR can follow
    assert held.primaries[PRIMARY].chunks[(1, 0)].round == 2  # the file kept round 2
    fresh.close()
    held.close()
    assert store.recovery is not None
    store.recovery.close()


@pytest.mark.timeout(10)
def test_pieces_are_no_larger_than_a_chunk() -> None:
    assert PIECE_BYTES <= 1 << 20


@pytest.mark.timeout(10)
def test_replicas_need_recover_and_are_at_most_three() -> None:
    assert ServerConfig(recover=True, replicas=3).replicas == 3
    with pytest.raises(ValueError, match=r"set ps\.recover = true too"):
        ServerConfig(replicas=1)
    with pytest.raises(ValueError, match=r"0\.\.3, got 4"):
        ServerConfig(recover=True, replicas=4)


@pytest.mark.timeout(30)
def test_two_holders_each_get_every_mirror_and_a_reply_waits_for_both_until_one_is_lost(tmp_path: Path) -> None:
    """ps.replicas = 2 (primary-backup): each MIRROR goes to both holders; a reply waits until both have the round
    before (mirror_every 1); once the slow holder's host is lost (`stop`), what waited for it alone goes."""
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
    store, _ = primary(tmp_path / "a")
    sender = MirrorSender(0, [Holder(1, HOLDER, "198.18.0.4"), Holder(2, "server-2", "198.18.0.5")], node_id=7,
                          timeout=5.0, clock=lambda: 100.0)
    assert store.recovery is not None
    store.recovery.after_commit, store.recovery.before_step = sender.committed, sender.stepping
    first, second = holder(tmp_path / "b"), holder(tmp_path / "c")
    by_holder = {HOLDER: first, "server-2": second}

    def round_out(round_: int) -> list[Reply]:
        return sender.take(store.handle("w0", 0, push(1, 0, round_)) + store.handle("w1", 0, push(1, 1, round_)))

    def ack(out: list[Reply], to: str) -> list[Reply]:
        released: list[Reply] = []
        for peer, _, msg in out:
            if peer == to and msg.kind == Kind.MIRROR:
                for _, _, answer in by_holder[to].take(PRIMARY, wire(msg)):
                    released += sender.acked(to, wire(answer))
        return released

    out = round_out(1)
    assert sorted(peer for peer, _, m in out if m.kind == Kind.MIRROR) == [HOLDER, "server-2"]
    assert sorted(peer for peer, _, m in out if m.kind == Kind.REPLY) == ["w0", "w1"]  # round 0 is had by all
    assert ack(out, HOLDER) == []  # only the first holder acknowledged round 1
    late = round_out(2)
    assert not [m for _, _, m in late if m.kind == Kind.REPLY]  # round 2's replies wait for the second too
    assert ack(late, HOLDER) == []  # the first has round 2 too: they still wait
    assert "server 2 on 198.18.0.5 has not acknowledged" in (sender.overdue(200.0) or "")
    released = sender.stop("server-2")  # its host was lost
    assert sorted(peer for peer, _, m in released) == ["w0", "w1"] and sender.describe() == "server 1 on 198.18.0.4"
    assert sender.overdue(200.0) is None
    assert state_of(first.primaries[PRIMARY].chunks[(1, 0)])[:3] == state_of(store.chunks[(1, 0)])[:3]
    first.close()
    second.close()
    store.recovery.close()


@pytest.mark.timeout(30)
def test_a_restored_primarys_state_takes_a_holder_back_to_an_earlier_round_and_only_marked_so(tmp_path: Path) -> None:
    """A primary that took over from one holder's copy (rounds behind) mirrors its restored state to the other
    holder, which may be ahead: that MIRROR (meta `again`) is taken at any round; any other going back is refused."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    store, sender = primary(tmp_path / "a", every=3)
    held = holder(tmp_path / "b", every=3)
    for round_ in (1, 2):
        deliver(sender.take(store.handle("w0", 0, push(1, 0, round_)) + store.handle("w1", 0, push(1, 1, round_))),
                held, sender)
    assert held.primaries[PRIMARY].chunks[(1, 0)].round == 2  # key 1 is mirrored at round 2 (its phase)
    # the primary's state, as one restored at round 1 would send it (the same size)
    back = wire(mirror_messages(store.chunks[(1, 0)], 7, with_bcast=False)[0])
    back.round = 1
    with pytest.raises(WireError, match="which is at round 2"):
        held.take(PRIMARY, back)
    again = wire(mirror_messages(store.chunks[(1, 0)], 7, with_bcast=False, again=True)[0])
    again.round = 1
    (ack,) = held.take(PRIMARY, again)
    assert ack[2].round == 1 and held.primaries[PRIMARY].chunks[(1, 0)].round == 1
    held.close()
    assert store.recovery is not None
    store.recovery.close()


@pytest.mark.parametrize("hello_first", [True, False], ids=["hello-before-server-back", "server-back-before-hello"])
def test_a_holder_restarted_on_its_host_is_sent_every_unacknowledged_mirror_once_its_new_process_said_hello(
        tmp_path: Path, hello_first: bool) -> None:
    """The holder dials the primary (the higher rank), so after its restart its hello and the scheduler's SERVER_BACK
    come by different ways, in either order: the MIRRORs go to it from its new process's hello on, never before."""
    (tmp_path / "a").mkdir()
    store, _ = primary(tmp_path / "a")
    sender = MirrorSender(0, [Holder(1, HOLDER, "198.18.0.4", ready=False)], node_id=7, timeout=5.0,
                          clock=lambda: 100.0)
    assert store.recovery is not None
    store.recovery.after_commit, store.recovery.before_step = sender.committed, sender.stepping
    old, new = ("tcp://198.18.0.4:4000",), ("tcp://198.18.0.4:5000",)

    def mirrors(out: list[Reply]) -> list[int]:
        return [m.round for _, _, m in out if m.kind == Kind.MIRROR]

    def round_out(round_: int) -> list[Reply]:
        return sender.take(store.handle("w0", 0, push(1, 0, round_)) + store.handle("w1", 0, push(1, 1, round_)))

    assert mirrors(round_out(1)) == []  # not before its first hello
    assert mirrors(sender.hello(HOLDER, old)) == [1]
    assert mirrors(round_out(2)) == [2]  # it died with rounds 1 and 2 unacknowledged; the new process listens on `new`
    if hello_first:
        assert mirrors(sender.hello(HOLDER, new)) == [1, 2]
        assert sender.holder_replaced(HOLDER, False, new) == []  # it has them
    else:
        assert sender.holder_replaced(HOLDER, False, new) == []
        assert mirrors(round_out(3)) == []  # made, kept until the new process's hello
        assert mirrors(sender.hello(HOLDER, new)) == [1, 2, 3]
    after = 3 if hello_first else 4
    assert mirrors(round_out(after)) == [after]
    store.recovery.close()
