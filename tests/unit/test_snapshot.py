"""A server's state file (ps.recover): what a commit writes is what a replacement restores, and nothing else."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sluice.errors import SluiceError
from sluice.ps.optim import SGD, Adam
from sluice.ps.ranked_sum import f32_to_bf16
from sluice.ps.snapshot import StateFile, _Record, _record_size, remove_state_files, state_path, state_tag
from sluice.ps.store import Chunk, ShardStore

TAG = state_tag(b"k" * 32)


def chunk_of(dtype: str = "float32", opt: dict[str, Any] | None = None, length: int = 6, key: int = 3) -> Chunk:
    """A chunk as a server's PLAN makes it (zeroed, round 0)."""
    store = ShardStore(node_id=1, workers=2, sync=True)
    store.add_plan([[key, "fc.weight", dtype, opt, [[0, length]]]])
    return store.chunks[(key, 0)]


def opened(directory: Path, rank: int = 0) -> StateFile:
    return StateFile.open(TAG, rank, str(directory), lock_timeout=0.2)


def reopened(directory: Path, first: StateFile, chunk: Chunk, opt: dict[str, Any] | None = None) -> Chunk:
    """Close `first` (as the kernel does when a server dies), open the file again and restore a fresh chunk
    declared like `chunk` (with the plan's optimizer settings `opt`)."""
    first.close()
    again = opened(directory)
    fresh = chunk_of(chunk.dtype, opt, chunk.value.size, chunk.key)
    assert again.restore(fresh)
    again.close()
    return fresh


def committed(directory: Path, chunk: Chunk, round_: int) -> StateFile:
    state = opened(directory)
    state.add([chunk])
    chunk.round = round_
    state.commit(chunk)
    return state


def test_the_tag_is_an_hmac_of_the_secret_and_the_name_uses_it(tmp_path: Path) -> None:
    assert state_tag(b"a" * 32) != state_tag(b"b" * 32) and len(TAG) == 16
    assert state_path(TAG, 2, str(tmp_path)) == str(tmp_path / f"sluice-state-{TAG}-server-2")
    with pytest.raises(ValueError, match="16 hex"):
        state_path("../../etc", 0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64", "float16"])
def test_sum_mode_round_trip(tmp_path: Path, dtype: str) -> None:
    chunk = chunk_of(dtype)
    if dtype == "bfloat16":
        f32_to_bf16(np.array([1.5, -2, 3.25, 1e8, 0, 7], np.float32), chunk.value)
    else:
        chunk.value[:] = np.array([1.5, -2, 3.25, 1e4, 0, 7]).astype(chunk.value.dtype)
    restored = reopened(tmp_path, committed(tmp_path, chunk, 7), chunk)
    assert restored.round == 7 and restored.value.tobytes() == chunk.value.tobytes()
    assert restored.value.dtype == chunk.value.dtype and restored.opt_state == {} and restored.optimizer is None


def test_a_chunk_never_committed_restores_nothing(tmp_path: Path) -> None:
    chunk = chunk_of()
    state = opened(tmp_path)
    state.add([chunk])
    state.close()
    again = opened(tmp_path)
    assert again.holds_state and not again.restore(chunk_of()) and not again.restore(chunk_of(key=9))


def test_sgd_momentum_before_and_after_its_first_step(tmp_path: Path) -> None:
    declared = {"name": "sgd", "lr": 0.1, "momentum": 0.9}
    chunk = chunk_of(opt=declared)
    chunk.value[:] = np.arange(6)
    state = committed(tmp_path, chunk, 0)  # the broadcast parameters, before any step: no momentum yet
    state.close()
    again = opened(tmp_path)
    fresh = chunk_of(opt=declared)
    assert again.restore(fresh) and fresh.opt_state == {} and fresh.value.tolist() == list(range(6))
    assert chunk.optimizer is not None
    chunk.optimizer.step(chunk.value, np.full(6, 2, np.float32), chunk.opt_state)
    chunk.round = 1
    again.commit(chunk)
    restored = reopened(tmp_path, again, chunk, declared)
    assert restored.round == 1 and restored.optimizer == SGD(0.1, 0.9)
    assert restored.opt_state["momentum"].tobytes() == chunk.opt_state["momentum"].tobytes()
    assert restored.opt_state["momentum"] is not chunk.opt_state["momentum"]
    assert restored.value.tobytes() == chunk.value.tobytes()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_adam_moments_step_count_and_changed_settings(tmp_path: Path, dtype: str) -> None:
    chunk = chunk_of(dtype, opt={"name": "adam", "lr": 0.01})
    chunk.optimizer = Adam(0.005, beta1=0.8, weight_decay=0.01)  # a push changed the settings since the plan
    param = np.linspace(-1, 1, 6).astype(np.float32)
    for _ in range(3):
        chunk.optimizer.step(param, np.full(6, 0.5, np.float32), chunk.opt_state)
    if dtype == "bfloat16":
        f32_to_bf16(param, chunk.value)
    else:
        chunk.value[:] = param
    state = committed(tmp_path, chunk, 3)
    state.close()
    again = opened(tmp_path)
    fresh = chunk_of(dtype, opt={"name": "adam", "lr": 0.01})
    assert again.restore(fresh)
    assert fresh.optimizer == Adam(0.005, beta1=0.8, weight_decay=0.01) and fresh.opt_state["t"] == 3
    for name in ("m", "v"):
        assert fresh.opt_state[name].dtype == np.float32
        assert fresh.opt_state[name].tobytes() == chunk.opt_state[name].tobytes()
    assert fresh.value.tobytes() == chunk.value.tobytes()


def test_broadcasts_alternate_buffers_and_are_kept_across_rounds(tmp_path: Path) -> None:
    chunk = chunk_of()
    state = opened(tmp_path)
    state.add([chunk])
    chunk.bcast, chunk.bcast_version = np.full(6, 1, np.float32), 1
    state.commit(chunk)
    chunk.bcast, chunk.bcast_version = np.full(6, 2, np.float32), 2
    state.commit(chunk)
    for _ in range(3):  # rounds with no new broadcast copy nothing into the buffers
        chunk.round += 1
        state.commit(chunk)
    restored = reopened(tmp_path, state, chunk)
    assert restored.bcast_version == 2 and restored.bcast is not None and restored.bcast.tolist() == [2] * 6
    assert restored.round == 3


def test_a_torn_commit_restores_the_previous_round(tmp_path: Path) -> None:
    declared = {"name": "sgd", "lr": 0.1, "momentum": 0.5}
    chunk = chunk_of(opt=declared)
    chunk.value[:], chunk.opt_state["momentum"] = 1, np.full(6, 1, np.float32)
    state = committed(tmp_path, chunk, 4)
    record = state._records[(3, 0)]
    real_stamp = record.stamp
    record.stamp = real_stamp.copy()
    record.stamp.setflags(write=False)  # the server dies at the stamp: the other slot is written, the stamp not
    chunk.value[:], chunk.opt_state["momentum"] = 2, np.full(6, 2, np.float32)
    chunk.round = 5
    with pytest.raises(ValueError, match="read-only"):
        state.commit(chunk)
    record.stamp = real_stamp
    restored = reopened(tmp_path, state, chunk, declared)
    assert restored.round == 4 and restored.value.tolist() == [1] * 6
    assert restored.opt_state["momentum"].tolist() == [1] * 6


def test_a_second_opener_is_refused_while_the_first_lives(tmp_path: Path) -> None:
    first = opened(tmp_path)
    with pytest.raises(SluiceError, match=r"server 0 is still running .* locked.*not replacing a live server"):
        opened(tmp_path)
    other = opened(tmp_path, rank=1)  # another server's file is another lock
    first.close()
    opened(tmp_path).close()
    other.close()


def test_a_mismatched_chunk_is_refused_with_what_to_do(tmp_path: Path) -> None:
    state = committed(tmp_path, chunk_of(), 2)
    for other in (chunk_of(length=7), chunk_of("float64"), chunk_of(opt={"name": "sgd", "lr": 1.0})):
        with pytest.raises(SluiceError, match=r"holds key 3 chunk 0 as float32\[6\].*remove .* start the job again"):
            state.restore(other)
    state.close()


def test_declarations_add_extents_and_all_come_back(tmp_path: Path) -> None:
    first, second = chunk_of(key=1), chunk_of("int32", length=3000, key=2)
    state = opened(tmp_path)
    state.add([first])
    state.add([second, first])  # a chunk already held is not added twice
    first.value[:], second.value[:] = 5, 6
    first.round, second.round = 1, 2
    state.commit(first)
    state.commit(second)
    state.close()
    again = opened(tmp_path)
    one, two = chunk_of(key=1), chunk_of("int32", length=3000, key=2)
    assert again.restore(one) and again.restore(two)
    assert (one.round, two.round, one.value[0], two.value[-1]) == (1, 2, 5, 6)
    again.close()


def test_record_sizes_agree() -> None:
    import mmap

    area = mmap.mmap(-1, 1 << 20)
    for dtype, length in (("float32", 5), ("bfloat16", 33), ("int8", 1), ("float64", 0)):
        assert _Record(area, 64, 0, length, dtype, 0).size == _record_size(length, dtype)


def test_an_unreadable_file_holds_nothing_and_is_rewritten(tmp_path: Path) -> None:
    path = Path(state_path(TAG, 0, str(tmp_path)))
    path.write_bytes(b"not a state file" * 500)
    state = opened(tmp_path)
    assert state.problem == "held no state of this format" and not state.holds_state
    state.close()
    fresh = opened(tmp_path)
    assert fresh.problem is None
    fresh.close()


def test_files_are_0600_regular_and_links_are_refused(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        opened(tmp_path).close()
    finally:
        os.umask(old)
    path = Path(state_path(TAG, 0, str(tmp_path)))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    path.chmod(0o644)
    opened(tmp_path).close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    link = Path(state_path(TAG, 1, str(tmp_path)))
    link.symlink_to(path)
    with pytest.raises(SluiceError, match="cannot open server 1's state file"):
        opened(tmp_path, rank=1)
    hard = Path(state_path(TAG, 2, str(tmp_path)))
    os.link(path, hard)
    with pytest.raises(SluiceError, match="one link"):
        opened(tmp_path, rank=2)


def test_remove_state_files_removes_that_tag_only(tmp_path: Path) -> None:
    other = state_tag(b"x" * 32)
    for rank in (0, 1, 12):
        opened(tmp_path, rank).close()
    StateFile.open(other, 0, str(tmp_path)).close()
    (tmp_path / f"sluice-state-{TAG}-server-1x").write_bytes(b"")
    (tmp_path / f"sluice-state-{TAG}-local-1-0").write_bytes(b"")  # a local group's store a killed worker left
    assert remove_state_files(TAG, str(tmp_path)) == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"sluice-state-{TAG}-server-1x",
                                                         f"sluice-state-{other}-server-0"]
    assert remove_state_files(TAG, str(tmp_path)) == 0


def test_close_with_remove_deletes_the_file(tmp_path: Path) -> None:
    state = opened(tmp_path)
    state.close(remove=True)
    state.close()  # twice is harmless
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("opt", "arrays"), [(None, 2), ({"name": "sgd", "lr": 0.1}, 2),
                                             ({"name": "sgd", "lr": 0.1, "momentum": 0.9}, 4),
                                             ({"name": "adam", "lr": 0.1}, 6)])
def test_room_is_reserved_for_what_commits_write_and_no_more(tmp_path: Path, opt: dict[str, Any] | None,
                                                             arrays: int) -> None:
    length = 1 << 18  # 1 MiB of float32
    state = opened(tmp_path)
    state.add([chunk_of(opt=opt, length=length)])
    path = Path(state.path)
    used = path.stat().st_blocks * 512
    assert arrays * length * 4 <= used < (arrays + 0.1) * length * 4  # (the other parts are holes until used)
    assert path.stat().st_size > 8 * length * 4
    state.close()


def test_a_damaged_extent_chain_holds_nothing_and_says_so(tmp_path: Path) -> None:
    state = committed(tmp_path, chunk_of(), 3)
    state.close()
    path = Path(state_path(TAG, 0, str(tmp_path)))
    with path.open("r+b") as raw:  # the first extent starts on the second page
        raw.seek(4096)
        raw.write(b"garbage!")
    again = opened(tmp_path)
    assert again.problem == "is damaged (the extent at byte 4096 is malformed)" and not again.holds_state
    assert not again.restore(chunk_of())
    again.close()


def test_a_file_removed_while_an_opener_waits_is_not_taken(tmp_path: Path) -> None:
    import threading

    first = opened(tmp_path)
    errors: list[BaseException] = []

    def second() -> None:
        try:
            StateFile.open(TAG, 0, str(tmp_path), lock_timeout=10).close()
        except SluiceError as exc:
            errors.append(exc)

    waiter = threading.Thread(target=second)
    waiter.start()
    time.sleep(0.2)
    first.close(remove=True)  # the job ended and cleaned up while a late replacement waited for the lock
    waiter.join(10)
    assert len(errors) == 1 and "was removed or replaced while it was being opened" in str(errors[0])
    assert list(tmp_path.iterdir()) == []
