"""Sealed messages (transport/seal.py): what opens, and everything forged, altered, moved or replayed that does not."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.transport.auth import JobKeys
from sluice.transport.seal import OVERHEAD, TAG_BYTES, Opener, Sealer
from sluice.transport.wire import WireError

KEYS = JobKeys(b"s" * 32, ["worker-0", "server-0"])
KEY = KEYS.seal_key("worker-0", "server-0", 1, b"session-a")


def pair(key: bytes = KEY) -> tuple[Sealer, Opener]:
    return Sealer(key), Opener(key)


def test_messages_open_to_what_was_sealed_and_the_originals_stay_as_they_were() -> None:
    sealer, opener = pair()
    payload = np.arange(1000, dtype=np.float32)
    for frames in ([b"header"], [b"header", payload], [b"h", b""]):
        sealed = sealer.seal(frames)
        assert sum(len(f) for f in sealed) <= sum(memoryview(f).nbytes for f in frames) + OVERHEAD
        assert all(bytes(s[-TAG_BYTES:]) != b"" for s in sealed)
        assert [bytes(f) for f in opener.open(sealed)] == [bytes(memoryview(f)) for f in frames]
    assert payload.tolist() == list(range(1000)) and sealer.sealed == opener.opened == 3
    assert b"header" not in bytes(sealer.seal([b"header"])[0])  # encrypted, not merely signed


def test_a_replay_or_an_older_message_is_refused_and_changes_nothing() -> None:
    sealer, opener = pair()
    first, second, third = (sealer.seal([b"h", bytes([n]) * 64]) for n in range(3))
    assert bytes(opener.open(second)[1]) == bytes([1]) * 64
    for stale in (second, first):
        with pytest.raises(WireError, match="not above the last opened"):
            opener.open(stale)
    assert bytes(opener.open(third)[1]) == bytes([2]) * 64  # a gap is allowed (a message lost), never a step back


def _flipped(frame: memoryview, at: int) -> bytes:
    data = bytearray(frame)
    data[at] ^= 1
    return bytes(data)


@pytest.mark.parametrize("frame, at", [(0, 0), (0, 7), (0, 8), (0, -1), (1, 0), (1, -1)],
                         ids=["counter-high", "counter-low", "header", "header-tag", "payload", "payload-tag"])
def test_any_altered_byte_is_refused_and_the_next_genuine_message_still_opens(frame: int, at: int) -> None:
    sealer, opener = pair()
    sealed = sealer.seal([b"header", b"p" * 100])
    altered = list(sealed)
    altered[frame] = memoryview(_flipped(sealed[frame], at))
    with pytest.raises(WireError):
        opener.open(altered)
    assert [bytes(f) for f in opener.open(sealed)] == [b"header", b"p" * 100]


def test_frames_cannot_be_swapped_dropped_or_moved_between_messages() -> None:
    sealer, opener = pair()
    one, two = sealer.seal([b"h1", b"a" * 10]), sealer.seal([b"h2", b"b" * 10])
    for forged in ([one[0], two[1]], [two[0], one[1]], [one[0]], [one[1], one[0]]):
        with pytest.raises(WireError):
            opener.open(forged)
    assert [bytes(f) for f in opener.open(two)] == [b"h2", b"b" * 10]


def test_each_direction_channel_and_session_has_a_key_of_its_own() -> None:
    keys = {KEYS.seal_key(a, b, channel, session) for a, b in (("worker-0", "server-0"), ("server-0", "worker-0"))
            for channel in (0, 1) for session in (b"session-a", b"session-b")}
    assert len(keys) == 8 and KEY in keys and all(len(k) == 32 for k in keys)
    assert JobKeys(b"s" * 32, []).seal_key("worker-0", "server-0", 1, b"session-a") == KEY  # every member derives it
    assert JobKeys(b"t" * 32, []).seal_key("worker-0", "server-0", 1, b"session-a") != KEY  # another job's differs
    sealed = Sealer(KEY).seal([b"h"])
    for other in keys - {KEY}:
        with pytest.raises(WireError, match="failed authentication"):
            Opener(other).open(sealed)
    for bad in (("", "server-0", 1, b"s"), ("worker-0", "a\0b", 1, b"s"), ("worker-0", "server-0", 256, b"s"),
                ("worker-0", "server-0", 1, b"")):
        with pytest.raises(ValueError):
            KEYS.seal_key(*bad)


def test_out_of_format_messages_are_refused_before_any_decryption() -> None:
    opener = Opener(KEY)
    for frames, problem in (([], "1 to 2 frames"), ([b"x"] * 3, "1 to 2 frames"), ([b"\0" * 23], "shorter"),
                            ([b"\0" * 30, b"\0" * 15], "shorter"), ([b"\0" * 30], "not above")):
        with pytest.raises(WireError, match=problem):
            opener.open(frames)
    with pytest.raises(ValueError):
        Sealer(b"short")
    with pytest.raises(ValueError):
        Sealer(KEY).seal([b"a", b"b", b"c"])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=80), min_size=0, max_size=3))
def test_arbitrary_bytes_raise_only_wire_error_and_never_move_the_mark(frames: list[bytes]) -> None:
    sealer, opener = pair()
    with pytest.raises(WireError):
        opener.open(frames)
    assert bytes(opener.open(sealer.seal([b"genuine"]))[0]) == b"genuine"


def test_a_sealer_never_reuses_a_counter() -> None:
    sealer = Sealer(os.urandom(32))
    counters = [int.from_bytes(bytes(sealer.seal([b"h", b"p"] if n % 2 else [b"h"])[0][:8]), "big") for n in range(50)]
    assert counters == sorted(set(counters)) and counters[0] == 1
    assert all(b - a == (2 if n % 2 else 1) for n, (a, b) in enumerate(itertools.pairwise(counters)))
