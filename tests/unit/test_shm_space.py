"""Shared memory reserved before use: what cannot be had is an error naming the size and the fix, never a SIGBUS."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest

from sluice.errors import SluiceError
from sluice.ps.snapshot import StateFile, state_tag
from sluice.transport.shm import Registry, SharedPayloads
from sluice.transport.shm_peers import SHM_DIR
from sluice.transport.shm_space import Segment, reserve

#: more than any /dev/shm or disk here holds: tmpfs answers ENOSPC, ext4 EFBIG, at once
HUGE = 1 << 50


def _ours() -> set[str]:
    return {name for name in os.listdir(SHM_DIR) if name.startswith(f"sluice-{os.getpid()}-")}


@pytest.mark.timeout(10)
def test_a_reservation_that_cannot_be_had_names_the_size_the_space_and_the_fix(tmp_path: Path) -> None:
    with open(tmp_path / "f", "wb") as file, pytest.raises(SluiceError) as failed:
        reserve(file.fileno(), 0, HUGE, "a test's buffer", str(tmp_path), held=4096, alternative=", or not")
    text = str(failed.value)
    assert text.startswith(f"a test's buffer needs {HUGE} bytes ")
    assert "(this process holds 4096 bytes (0.0 MiB) there already)" in text
    assert f"; {tmp_path} has " in text and " free of " in text
    assert "mount a larger /dev/shm (docker run --shm-size=SIZE; on Kubernetes an emptyDir with medium: Memory" in text
    assert text.endswith(", or not")
    assert os.path.getsize(tmp_path / "f") == 0  # nothing was allocated


@pytest.mark.timeout(10)
def test_segments_and_arenas_reserve_what_they_hand_out_and_leave_nothing_when_they_cannot() -> None:
    before = _ours()
    with pytest.raises(SluiceError, match=rf"^a send ring needs {HUGE} bytes .* mount a larger /dev/shm"):
        Segment(HUGE, "a send ring")
    assert _ours() == before  # the file of a segment that could not be made is gone
    registry = Registry()
    small = registry.alloc(1000, np.dtype(np.float32))
    arena = registry.segments[-1]
    assert os.stat(arena.path).st_blocks * 512 < 1 << 20  # a 64 MiB arena holds (about) what it handed out
    small[:] = 1
    with pytest.raises(SluiceError, match=rf"^a shared array of {HUGE // 4} float32 .* needs {HUGE} bytes"):
        registry.alloc(HUGE // 4, np.dtype(np.float32))
    assert len(registry.segments) == 1 and registry.alloc(10, np.dtype(np.float32)).base is small.base
    registry.close()
    assert _ours() == before


@pytest.mark.timeout(10)
def test_a_ring_that_cannot_be_had_sends_through_the_socket_saying_why(caplog: pytest.LogCaptureFixture) -> None:
    shared = SharedPayloads(HUGE)
    payload = np.ones(1 << 16, np.float32)
    with caplog.at_level(logging.WARNING, "sluice.transport"):
        for _ in range(2):
            assert shared.prepare(("peer", 0), payload, payload.nbytes) is None  # inline
    (warning,) = caplog.messages  # once, not per message
    assert warning.startswith(f"a send ring to a process on this host needs {HUGE} bytes")
    assert warning.endswith("meanwhile payloads to processes on this host travel through sockets")
    shared.forget("peer")  # a new process of that name: a ring is tried again
    with caplog.at_level(logging.WARNING, "sluice.transport"):
        assert shared.prepare(("peer", 0), payload, payload.nbytes) is None
    assert len(caplog.messages) == 2
    shared.close()


@pytest.mark.timeout(10)
def test_a_state_file_that_cannot_grow_says_so_and_how_else(tmp_path: Path) -> None:
    state = StateFile.open(state_tag(b"k" * 32), 3, str(tmp_path), lock_timeout=0.2)
    try:
        with pytest.raises(SluiceError) as failed:
            state._reserve_range(0, HUGE)
    finally:
        state.close(remove=True)
    text = str(failed.value)
    assert text.startswith(f"server 3's state for ps.recover ({tmp_path}/sluice-state-")
    assert f"needs {HUGE} bytes" in text and "mount a larger /dev/shm" in text
    assert text.endswith(", or turn ps.recover off")
