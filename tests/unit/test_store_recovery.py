"""A server restarted from its state file (ps.recover): re-sent pushes are answered, not applied twice, and
the rounds after the restart give the bits of a run that was never interrupted."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sluice.errors import SluiceError
from sluice.ps.config import ServerConfig
from sluice.ps.recovered import Recovery, open_recovery
from sluice.ps.snapshot import StateFile, state_tag
from sluice.ps.store import Chunk, ShardStore
from sluice.scheduler.bootstrap import NodeEnv
from sluice.transport.wire import Flag, Kind, Message, WireError

TAG = state_tag(b"s" * 32)
WORKERS = 3
#: float32 rows whose sum shows the order of addition (1e8 + 1 == 1e8)
ROWS = [[1e8, 1.0, -1e8, 0.5], [1.0, -1e8, 3.0, 1e8], [-1e8, 1e8, 1.0, -2.0]]
SGD_MOMENTUM = {"name": "sgd", "lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}
ADAM = {"name": "adam", "lr": 0.01, "weight_decay": 0.001}


def new_store(directory: Path | None, opt: dict[str, Any] | None = None, recovering: bool = False) -> ShardStore:
    """A server's store for one tensor of 4 float32 (recovery on when `directory` is given)."""
    store = ShardStore(node_id=1, workers=WORKERS, sync=True)
    store.worker_ids = {10 + r: (f"w{r}", r) for r in range(WORKERS)}
    if directory is not None:
        store.recovery = Recovery(StateFile.open(TAG, 0, str(directory), lock_timeout=0.2))
    store.add_plan([[3, "fc.weight", "float32", opt, [[0, 4]]]], recovering)
    return store


def gradient(rank: int, round_: int) -> list[float]:
    scale = 1.0 if round_ % 2 else 1e-3  # alternate, so the optimizer state matters
    return [v * scale + round_ for v in ROWS[rank]]


def push(rank: int, round_: int, flags: int = Flag.WANT_REPLY, meta: dict[str, Any] | None = None) -> Message:
    data = np.array(gradient(rank, round_), np.float32)
    return Message(Kind.PUSH, sender=10 + rank, key=3, chunk=0, round=round_, dtype="float32", shape=(4,),
                   flags=flags, meta=meta, payload=memoryview(data))


def run(store: ShardStore, rounds: range, order: tuple[int, ...] = (0, 1, 2)) -> list[Message]:
    replies: list[Message] = []
    for round_ in rounds:
        for rank in order:
            replies += [m for _, _, m in store.handle(f"w{rank}", 0, push(rank, round_))]
    return replies


def chunk(store: ShardStore) -> Chunk:
    return store.chunks[(3, 0)]


def snapshot(c: Chunk) -> tuple[Any, ...]:
    state = {k: v.tobytes() if isinstance(v, np.ndarray) else v for k, v in c.opt_state.items()}
    return c.round, c.value.tobytes(), state, c.optimizer, c.bcast_version


def killed_at(directory: Path, rounds: int, opt: dict[str, Any] | None = None) -> ShardStore:
    """A store that ran `rounds` rounds, then died (its file closed, as the kernel does); its replacement."""
    first = new_store(directory, opt)
    run(first, range(1, rounds + 1))
    assert first.recovery is not None
    first.recovery.close()
    return new_store(directory, opt, recovering=True)


def test_a_replacement_restores_the_committed_round_and_logs_it(tmp_path: Path) -> None:
    replacement = killed_at(tmp_path, 4)
    uninterrupted = new_store(None)
    run(uninterrupted, range(1, 5))
    assert snapshot(chunk(replacement)) == snapshot(chunk(uninterrupted))


@pytest.mark.parametrize("want_reply", [True, False])
def test_a_resent_push_of_the_committed_round_is_answered_not_applied(tmp_path: Path, want_reply: bool) -> None:
    store = killed_at(tmp_path, 3, SGD_MOMENTUM)
    before = snapshot(chunk(store))
    flags = Flag.RESEND | (Flag.WANT_REPLY if want_reply else 0)
    replies = store.handle("w1", 4, push(1, 3, flags, meta={"opt": {"name": "sgd", "lr": 9.0}}))
    assert [(peer, ch, m.kind, m.round, m.key) for peer, ch, m in replies] == [("w1", 4, Kind.REPLY, 3, 3)]
    payload = replies[0][2].payload
    assert (payload is not None) == want_reply
    if want_reply:
        assert np.frombuffer(payload, np.float32).tobytes() == before[1]
    assert snapshot(chunk(store)) == before and chunk(store).pushed == set()


def test_a_resent_push_of_the_next_round_is_taken_and_its_copies_ignored(tmp_path: Path) -> None:
    store = killed_at(tmp_path, 2)
    assert store.handle("w0", 0, push(0, 3, Flag.WANT_REPLY | Flag.RESEND)) == []
    assert chunk(store).pushed == {0}
    assert store.handle("w0", 0, push(0, 3)) == []  # the fresh copy that sat in the outbox
    assert store.handle("w1", 0, push(1, 3)) == []
    assert store.handle("w1", 0, push(1, 3, Flag.WANT_REPLY | Flag.RESEND)) == []  # re-sent after the fresh one
    assert chunk(store).pushed == {0, 1} and len(chunk(store).waiting) == 2
    with pytest.raises(WireError, match=r"worker 1 pushed .* twice"):
        store.handle("w1", 0, push(1, 3))  # two fresh copies: as without ps.recover
    replies = store.handle("w2", 0, push(2, 3))
    assert sorted(peer for peer, _, _ in replies) == ["w0", "w1", "w2"]


def test_other_rounds_are_refused_as_before(tmp_path: Path) -> None:
    store = killed_at(tmp_path, 3)
    for round_ in (2, 6):
        with pytest.raises(WireError, match=f"push for round {round_}"):
            store.handle("w0", 0, push(0, round_, Flag.WANT_REPLY | Flag.RESEND))
    with pytest.raises(WireError, match="push for round 5"):
        store.handle("w0", 0, push(0, 5))  # without ps.replicas nothing comes early


def test_a_holder_a_round_behind_redoes_it_from_replays_and_keeps_early_pushes(tmp_path: Path) -> None:
    """ps.replicas: the state (here: committed round 2) is one round behind what workers 0 and 1 saw (round 3,
    whose pushes they replay, their round 4 pushes unanswered); worker 2 never got round 3's reply."""
    store = killed_at(tmp_path, 2, SGD_MOMENTUM)
    assert store.recovery is not None
    store.recovery.lag = 1  # ps.mirror_every = 1
    replay, resend = Flag.RESEND | Flag.REPLAY, Flag.RESEND | Flag.WANT_REPLY
    assert store.handle("w0", 0, push(0, 3, replay)) == []
    assert store.handle("w0", 0, push(0, 4, resend)) == []  # kept: its round is not the next one yet
    with pytest.raises(WireError, match=r"worker 0 sent round 4 .* twice ahead of its turn"):
        store.handle("w0", 0, push(0, 4, resend))
    assert store.handle("w2", 0, push(2, 2, replay)) == []  # committed already: dropped, never answered
    assert store.handle("w1", 0, push(1, 3, replay)) == []
    assert store.handle("w1", 0, push(1, 4, resend)) == []
    replies = store.handle("w2", 0, push(2, 3, resend))  # round 3 completes, and the kept round 4 pushes go in
    assert [(peer, m.round) for peer, _, m in replies] == [("w2", 3)]
    assert chunk(store).round == 3 and chunk(store).pushed == {0, 1}
    replies = store.handle("w2", 0, push(2, 4))
    assert sorted((peer, m.round) for peer, _, m in replies) == [("w0", 4), ("w1", 4), ("w2", 4)]
    uninterrupted = new_store(None, SGD_MOMENTUM)
    run(uninterrupted, range(1, 5))
    assert snapshot(chunk(store)) == snapshot(chunk(uninterrupted))


def test_without_recovery_resend_changes_nothing() -> None:
    store = new_store(None)
    run(store, range(1, 3))
    before = snapshot(chunk(store))
    with pytest.raises(WireError, match="push for round 2"):
        store.handle("w0", 0, push(0, 2, Flag.WANT_REPLY | Flag.RESEND))
    store.handle("w0", 0, push(0, 3, Flag.WANT_REPLY | Flag.RESEND))
    with pytest.raises(WireError, match="twice"):
        store.handle("w0", 0, push(0, 3, Flag.WANT_REPLY | Flag.RESEND))
    bcast = Message(Kind.BCAST_PUSH, sender=10, key=3, round=0, dtype="float32", shape=(4,),
                    flags=Flag.RESEND | Flag.WANT_REPLY, payload=memoryview(np.zeros(4, np.float32)))
    with pytest.raises(WireError, match="older"):
        store.handle("w0", 0, bcast)
    assert snapshot(chunk(store)) == before


@pytest.mark.parametrize("opt", [None, SGD_MOMENTUM, ADAM], ids=["sum", "sgd-momentum", "adam"])
@pytest.mark.parametrize("order", list(itertools.permutations(range(WORKERS))))
def test_rounds_after_a_restart_are_bit_identical(tmp_path: Path, opt: dict[str, Any] | None,
                                                 order: tuple[int, ...]) -> None:
    uninterrupted = new_store(None, opt)
    expected = run(uninterrupted, range(1, 7))
    store = killed_at(tmp_path, 3, opt)
    # round 3's reply never reached worker `order[0]`: it re-sends it, then every worker re-sends round 4
    store.handle(f"w{order[0]}", 0, push(order[0], 3, Flag.WANT_REPLY | Flag.RESEND))
    replies = run(store, range(4, 5), order) + run(store, range(5, 7), order[::-1])
    assert snapshot(chunk(store)) == snapshot(chunk(uninterrupted))
    got = {(m.round, np.frombuffer(m.payload, np.float32).tobytes()) for m in replies}
    assert got == {(m.round, np.frombuffer(m.payload, np.float32).tobytes()) for m in expected if m.round >= 4}


def test_settings_changed_by_a_push_survive_the_restart(tmp_path: Path) -> None:
    first = new_store(tmp_path, SGD_MOMENTUM)
    run(first, range(1, 3))
    for rank in range(WORKERS):  # an lr schedule: round 3 brings new settings
        first.handle(f"w{rank}", 0, push(rank, 3, meta={"opt": {**SGD_MOMENTUM, "lr": 0.05}}))
    assert first.recovery is not None
    first.recovery.close()
    replacement = new_store(tmp_path, SGD_MOMENTUM, recovering=True)
    assert chunk(replacement).optimizer == chunk(first).optimizer
    assert snapshot(chunk(replacement)) == snapshot(chunk(first))


def test_a_broadcast_is_committed_and_a_resent_one_acknowledged(tmp_path: Path) -> None:
    first = new_store(tmp_path, ADAM)
    seed = Message(Kind.BCAST_PUSH, sender=10, key=3, round=1, dtype="float32", shape=(4,), flags=Flag.WANT_REPLY,
                   payload=memoryview(np.array([1, 2, 3, 4], np.float32)))
    first.handle("w0", 0, seed)
    assert first.recovery is not None
    first.recovery.close()
    store = new_store(tmp_path, ADAM, recovering=True)
    assert chunk(store).value.tolist() == [1, 2, 3, 4] and chunk(store).bcast_version == 1
    seed.flags |= Flag.RESEND
    assert [(m.kind, m.round, m.payload) for _, _, m in store.handle("w0", 0, seed)] == [(Kind.BCAST_REPLY, 1, None)]
    pull = Message(Kind.BCAST_PULL, sender=11, key=3, round=1)
    (reply,) = store.handle("w1", 0, pull)
    assert np.frombuffer(reply[2].payload, np.float32).tolist() == [1, 2, 3, 4]


def test_each_round_is_committed_before_its_replies_exist(tmp_path: Path) -> None:
    class Watched(ShardStore):
        seen: list[int] = []

        def _reply(self, kind: Kind, c: Chunk, data: np.ndarray, waiter: Any) -> Message:
            assert self.recovery is not None
            self.seen.append(int(self.recovery.state._records[(3, 0)].stamp[0]) >> 1)
            return super()._reply(kind, c, data, waiter)

    store = Watched(node_id=1, workers=WORKERS, sync=True)
    store.worker_ids = {10 + r: (f"w{r}", r) for r in range(WORKERS)}
    store.recovery = Recovery(StateFile.open(TAG, 0, str(tmp_path)))
    store.add_plan([[3, "fc.weight", "float32", None, [[0, 4]]]])
    run(store, range(1, 3))
    assert store.seen == [1, 1, 1, 2, 2, 2]
    store.recovery.close()


def test_plans_sent_again_as_they_were_restore_too(tmp_path: Path) -> None:
    first = new_store(tmp_path)
    run(first, range(1, 3))
    assert first.recovery is not None
    first.recovery.close()
    replacement = new_store(tmp_path)  # the scheduler re-sends the PLAN unmarked
    assert snapshot(chunk(replacement)) == snapshot(chunk(first))
    run(replacement, range(3, 4))


def test_a_replacement_without_its_state_file_fails_naming_it(tmp_path: Path) -> None:
    with pytest.raises(SluiceError, match=r"server 0 was restarted but its state file .* did not exist: was its host"):
        new_store(tmp_path, recovering=True)


def node_env(secret: bytes, **ps: Any) -> NodeEnv:
    return NodeEnv("tcp://127.0.0.1:1", "server", 0, WORKERS, 1, {"ps": ps}, secret)


def test_open_recovery_refuses_what_it_cannot_recover(tmp_path: Path) -> None:
    with pytest.raises(SluiceError, match=r"ps\.recover needs ps\.sync = true"):
        open_recovery(node_env(b"s" * 32), ServerConfig(sync=False, recover=True), str(tmp_path))
    with pytest.raises(SluiceError, match=r"ps.recover needs the job secret \(transport.curve on, or sluice launch\)"):
        open_recovery(node_env(b""), ServerConfig(recover=True), str(tmp_path))
    recovery = open_recovery(node_env(b"s" * 32), ServerConfig(recover=True), str(tmp_path))
    assert recovery.state.path.endswith(f"sluice-state-{TAG}-server-0")
    recovery.close(remove=True)


def test_a_holder_three_rounds_behind_redoes_them_from_replays_in_any_order(tmp_path: Path) -> None:
    """ps.mirror_every = 3: the state is at round 1; workers 0 and 1 saw round 4 (they replay 2-4, then worker 0
    re-sends 5 and worker 1 pushes 5 anew), worker 2 saw round 3 (it replays 1-3 and re-sends 4); each worker's
    messages come in a burst."""
    store = killed_at(tmp_path, 1, ADAM)
    assert store.recovery is not None
    store.recovery.lag = 3
    replay, resend = Flag.RESEND | Flag.REPLAY, Flag.RESEND | Flag.WANT_REPLY
    for rank in (0, 1):
        for round_ in (2, 3, 4):
            assert store.handle(f"w{rank}", 0, push(rank, round_, replay)) == []
        # worker 0 re-sends its unanswered push of round 5; worker 1 pushes round 5 only now (it was computing)
        assert store.handle(f"w{rank}", 0, push(rank, 5, resend if rank == 0 else Flag.WANT_REPLY)) == []
    with pytest.raises(WireError, match="push for round 6"):
        store.handle("w0", 0, push(0, 6, resend))  # more than ps.mirror_every + 1 ahead
    for round_ in (1, 2, 3):
        assert store.handle("w2", 0, push(2, round_, replay)) == []
    assert [(peer, m.round) for peer, _, m in store.handle("w2", 0, push(2, 4, resend))] == [("w2", 4)]
    assert sorted((peer, m.round) for peer, _, m in store.handle("w2", 0, push(2, 5))) == [
        ("w0", 5), ("w1", 5), ("w2", 5)]
    uninterrupted = new_store(None, ADAM)
    run(uninterrupted, range(1, 6))
    assert snapshot(chunk(store)) == snapshot(chunk(uninterrupted)) and store.recovery.replayed == 8


def test_a_worker_replays_the_pushes_it_was_answered_for_as_they_were_sent() -> None:
    """scheduler/resend.py Answered: copies (the caller's array changes after the reply), the newest `depth` per chunk,
    only to the server each went to, marked RESEND | REPLAY, never asking for a reply, and through the wire intact."""
    from sluice.scheduler.resend import Answered
    from sluice.transport.wire import decode, encode

    answered, caller = Answered(depth=2), np.array(gradient(0, 3), np.float32)
    answered.keep(1, push(0, 1))
    answered.keep(1, push(0, 2, meta={"opt": {"name": "sgd", "lr": 0.5}}))
    answered.keep(1, Message(Kind.PUSH, sender=10, key=3, chunk=0, round=3, dtype="float32", shape=(4,),
                             flags=Flag.WANT_REPLY | Flag.LOCAL, payload=caller[:]))
    answered.keep(0, Message(Kind.PUSH, sender=10, key=4, chunk=1, round=7, dtype="float32", shape=(4,),
                             payload=memoryview(np.ones(4, np.float32))))
    caller[:] = -1.0  # the next step's gradient, written into the same array
    assert answered.replays(2) == []
    second, third = answered.replays(1)
    assert (second.round, second.flags) == (2, Flag.RESEND | Flag.REPLAY)
    assert second.meta == {"opt": {"name": "sgd", "lr": 0.5}}  # the settings it was sent with
    assert (third.round, third.meta, third.flags) == (3, None, Flag.RESEND | Flag.REPLAY | Flag.LOCAL)
    back = decode([bytes(memoryview(frame)) if not isinstance(frame, bytes) else frame for frame in encode(third)])
    assert np.frombuffer(back.payload, np.float32).tolist() == np.array(gradient(0, 3), np.float32).tolist()
    assert [m.key for m in answered.replays(0)] == [4]


def test_a_worker_says_once_when_its_kept_pushes_pass_their_share_of_memory(caplog: pytest.LogCaptureFixture) -> None:
    """Answered counts the bytes of its copies (buffers reused, so a chunk's depth of them at most) and warns once,
    naming ps.mirror_every, when they pass the limit (here 40 bytes: 3 copies of a 16-byte chunk)."""
    from sluice.scheduler.resend import Answered, host_memory

    answered = Answered(depth=3, warn_bytes=40)
    with caplog.at_level(logging.WARNING, logger="sluice.worker"):
        kept = []
        for round_ in range(1, 7):
            answered.keep(1, push(0, round_))
            kept.append((answered.kept_bytes, answered.warned))
    assert kept == [(16, False), (32, False), (48, True), (48, True), (48, True), (48, True)]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "last 3 answered rounds" in warnings[0] and "ps.mirror_every" in warnings[0]
    assert host_memory() > 0
