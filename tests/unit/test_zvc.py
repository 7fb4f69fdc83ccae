"""ZVC codec: bit-exact round trips at every density and size, exact frame sizes, and every malformed frame
raises WireError (before anything large is allocated)."""

from __future__ import annotations

import struct
import tracemalloc
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluice.transport import zvc
from sluice.transport.dtypes import STORAGE
from sluice.transport.wire import WireError

FLOATS = ("float32", "float16", "bfloat16")
HEADER = struct.Struct("<4sBBBBQQ")


def sample(dtype: str, n: int, density: float, seed: int = 0) -> np.ndarray[Any, Any]:
    """`n` elements of `dtype` (bfloat16 as uint16 bits) with exactly round(density n) non-zeros."""
    rng = np.random.default_rng(seed)
    storage = np.dtype(STORAGE[dtype])
    bits = rng.integers(1, 1 << (8 * storage.itemsize), size=n, dtype=np.uint64).astype(f"u{storage.itemsize}")
    bits[rng.permutation(n)[round(density * n):]] = 0
    return bits.view(storage)


def wire_name(dtype: str) -> str | None:
    """What encode needs told: the name of a dtype numpy stores as another (bfloat16, float8), else None."""
    return None if np.dtype(STORAGE[dtype]).name == dtype else dtype


def same_bits(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def roundtrip(array: np.ndarray[Any, Any], dtype: str | None = None) -> bytearray:
    frame = zvc.encode(array, dtype)
    n, nnz = array.size, int(np.count_nonzero(array.view(f"u{array.itemsize}")))
    assert len(frame) == zvc.encoded_size(n, nnz, array.itemsize)
    header = zvc.read_header(frame, n)
    assert (header.dtype, header.n, header.nnz) == (dtype or array.dtype.name, n, nnz)
    assert header.raw == (zvc.compressed_size(n, nnz, array.itemsize) >= zvc.HEADER_BYTES + array.itemsize * n)
    assert same_bits(zvc.decode(frame, n), array.reshape(-1))
    out = np.full(n, 7, array.dtype)  # decode_into must overwrite every element, the zeros included
    assert zvc.decode_into(frame, out) == header and same_bits(out, array.reshape(-1))
    return frame


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("density", [0, 0.05, 0.35, 0.9, 1])
def test_round_trip_is_bit_exact_at_every_density(dtype: str, density: float) -> None:
    array = sample(dtype, 4099, density)
    frame = roundtrip(array, dtype)
    nnz = round(density * 4099)
    itemsize = array.itemsize
    if density < 0.9:  # zvc pays: the frame is exactly header + mask + packed values
        assert len(frame) == zvc.HEADER_BYTES + (4099 + 7) // 8 + itemsize * nnz
        assert not zvc.read_header(frame, 4099).raw
    if density == 1:
        assert zvc.read_header(frame, 4099).raw and len(frame) == zvc.HEADER_BYTES + itemsize * 4099


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1023])
@pytest.mark.parametrize("density", [0, 0.5, 1])
def test_empty_and_odd_sizes(dtype: str, n: int, density: float) -> None:
    roundtrip(sample(dtype, n, density, seed=n), dtype)


@pytest.mark.parametrize("density", [0, 0.01, 0.35, 0.97])
def test_arrays_of_several_chunks(density: float) -> None:
    array = sample("float32", 3 * zvc.CHUNK + 5, density)
    array[zvc.CHUNK:2 * zvc.CHUNK] = 0  # a chunk with nothing to gather in the middle
    roundtrip(array)
    roundtrip(sample("bfloat16", 2 * zvc.CHUNK + 3, density), "bfloat16")


def test_special_values_survive_bit_for_bit() -> None:
    special = np.array([0.0, -0.0, np.nan, -np.nan, np.inf, -np.inf, 1e-45, 0.0], np.float32)
    payload_nan = np.array([0x7FC00001, 0xFFFFFFFF], np.uint32).view(np.float32)
    array = np.concatenate([special, payload_nan, np.zeros(40, np.float32)])
    frame = roundtrip(array)
    assert zvc.read_header(frame, array.size).nnz == 8  # -0.0 and every NaN count as non-zero
    half = np.array([-0.0, np.nan, np.inf, 0.0, 6e-8], np.float16)
    roundtrip(np.concatenate([half, np.zeros(50, np.float16)]))
    bf16 = np.array([0x8000, 0x7FC1, 0x7F80, 0, 1], np.uint16)  # -0.0, a NaN, inf, 0, the smallest subnormal
    roundtrip(np.concatenate([bf16, np.zeros(50, np.uint16)]), "bfloat16")


def test_raw_when_zvc_is_not_smaller() -> None:
    assert zvc.read_header(zvc.encode(np.ones(1000, np.float32)), 1000).raw
    assert zvc.read_header(zvc.encode(np.float32(3.0).reshape(1)), 1).raw  # 29 zvc bytes against 28 raw
    assert zvc.read_header(zvc.encode(np.zeros(0, np.float32)), 0).raw  # empty: equal sizes, so raw
    assert not zvc.read_header(zvc.encode(np.zeros(1, np.float32)), 1).raw  # 25 against 28
    # the boundary: zvc wins exactly while ceil(n/8) < itemsize (n - nnz)
    n = 64
    for nnz in range(n + 1):
        array = sample("float32", n, nnz / n)
        assert zvc.read_header(zvc.encode(array), n).raw == (n // 8 >= 4 * (n - nnz)), nnz


@pytest.mark.parametrize("dtype", sorted(zvc.CODES))
def test_every_dtype_round_trips(dtype: str) -> None:
    array = sample(dtype, 333, 0.3)
    roundtrip(array, wire_name(dtype))


def test_shapes_and_layouts_flatten_in_c_order() -> None:
    array = sample("float32", 24 * 10, 0.4).reshape(24, 10)
    assert same_bits(zvc.decode(zvc.encode(array), 240), array.reshape(-1))
    assert same_bits(zvc.decode(zvc.encode(array.T), 240), np.ascontiguousarray(array.T).reshape(-1))
    assert same_bits(zvc.decode(zvc.encode(array[:, ::3]), 96), array[:, ::3].reshape(-1))
    big = array.astype(">f4")
    assert same_bits(zvc.decode(zvc.encode(big), 240), array.reshape(-1))
    assert same_bits(zvc.decode(zvc.encode(big.view(">u4").astype(">u2"), "bfloat16"), 240),
                     array.view(np.uint32).astype(np.uint16).reshape(-1))
    scalar = np.array(2.5, np.float32)
    assert same_bits(zvc.decode(zvc.encode(scalar), 1), scalar.reshape(1))


def test_bad_dtypes_are_refused_with_what_to_do() -> None:
    with pytest.raises(TypeError, match="cannot encode bool"):
        zvc.encode(np.zeros(4, bool))
    with pytest.raises(TypeError, match="must be stored as uint16"):
        zvc.encode(np.zeros(4, np.float32), "bfloat16")
    with pytest.raises(TypeError, match="no dtype"):
        zvc.encode(np.zeros(4, np.float32), "float128")
    with pytest.raises(TypeError, match="contiguous bytes-like"):
        zvc.decode(memoryview(bytes(100))[::2], 10)


def test_sizes_follow_the_theory() -> None:
    assert zvc.compressed_size(1000, 350, 4) == 24 + 125 + 1400
    assert zvc.encoded_size(8, 8, 4) == 24 + 32 and zvc.encoded_size(8, 0, 4) == 24 + 1
    for density in (0.05, 0.35, 0.9):
        n = 1 << 24
        measured = 4 * n / zvc.compressed_size(n, round(density * n), 4)
        assert measured == pytest.approx(zvc.theoretical_ratio(density), rel=1e-5)
    assert zvc.theoretical_ratio(0.35) == pytest.approx(32 / (1 + 32 * 0.35))


def test_decode_into_checks_its_output() -> None:
    frame = zvc.encode(sample("float32", 100, 0.2))
    with pytest.raises(WireError, match="over this receiver's limit"):
        zvc.decode_into(frame, np.empty(99, np.float32))
    with pytest.raises(WireError, match="the output is 101 float32"):
        zvc.decode_into(frame, np.empty(101, np.float32))
    with pytest.raises(WireError, match="the output is 100 uint32"):
        zvc.decode_into(frame, np.empty(100, np.uint32))
    with pytest.raises(ValueError, match="C-contiguous"):
        zvc.decode_into(frame, np.empty(200, np.float32)[::2])


# ---------------------------------------------------------------------------- hostile frames
def small_frames() -> list[bytes]:
    zvc_frame = bytes(zvc.encode(np.array([0, 1.5, 0, -0.0, 0, 0, 0, 0, 0, 2], np.float32)))
    raw_frame = bytes(zvc.encode(np.array([1.5, 2, 3], np.float32)))
    assert not zvc.read_header(zvc_frame, 10).raw and zvc.read_header(raw_frame, 3).raw
    return [zvc_frame, raw_frame]


def patched(frame: bytes, **fields: int | bytes) -> bytes:
    names = ("magic", "version", "code", "mode", "pad", "n", "nnz")
    values = dict(zip(names, HEADER.unpack_from(frame), strict=True)) | fields
    return HEADER.pack(*(values[name] for name in names)) + frame[HEADER.size:]


def rejects(frame: bytes | bytearray, match: str, limit: int = 1 << 20) -> None:
    with pytest.raises(WireError, match=match):
        zvc.decode(frame, limit)
    out = np.full(10, 9.0, np.float32)
    with pytest.raises(WireError):
        zvc.decode_into(frame, out)
    assert np.all(out == 9.0)  # nothing written from a bad frame


def test_every_truncation_and_extra_bytes_are_rejected() -> None:
    for frame in small_frames():
        for cut in range(len(frame)):
            rejects(frame[:cut], "shorter than|must be")
        rejects(frame + b"\0", "must be")
        rejects(frame + frame, "must be")


def test_bad_header_fields_are_rejected() -> None:
    good, raw = small_frames()
    rejects(b"XZVC" + good[4:], "not a zvc frame")
    rejects(patched(good, version=2), "version 2")
    for code in (0, len(zvc.CODES) + 1, 255):
        rejects(patched(good, code=code), "unknown dtype code")
    rejects(patched(good, mode=2), "mode 2")
    rejects(patched(good, pad=1), "reserved byte 1")
    rejects(patched(good, nnz=11), "3 non-zeros|11 non-zeros among only 10")
    rejects(patched(good, code=zvc.CODES["float16"]), "must be")  # the length no longer fits the item size
    rejects(patched(raw, mode=zvc.ZVC), "must be")
    rejects(patched(raw, nnz=2), "declares 2 non-zeros, its values have 3")


def test_mask_and_values_must_agree() -> None:
    good = small_frames()[0]
    mask_at = zvc.HEADER_BYTES
    assert good[mask_at:mask_at + 2] == bytes([0b1010, 0b10])
    moved = bytearray(good)
    moved[mask_at] = 0b1011  # four bits set, three values: the length still matches nnz = 3
    rejects(moved, "marks 4 non-zeros, the header declares 3")
    trailing = bytearray(good)
    trailing[mask_at + 1] |= 0b100  # element 10 of 10
    rejects(trailing, "bits set past its 10 elements")
    zero_value = bytearray(good)
    zero_value[mask_at + 2:mask_at + 6] = bytes(4)
    rejects(zero_value, "packs a zero value")


@pytest.mark.parametrize("threads", [2, 3, 8])
@pytest.mark.parametrize("n", [0, 9, zvc.CHUNK - 3, 2 * zvc.CHUNK, 5 * zvc.CHUNK + 11])
@pytest.mark.parametrize("density", [0, 0.35, 1])
def test_threads_write_and_read_the_same_frames(threads: int, n: int, density: float) -> None:
    """Ranges cut on whole chunks: the frame is byte for byte the one a single thread writes, and decodes
    (fresh or into a dirty buffer) to the same bits."""
    array = sample("float32", n, density, seed=n)
    frame = zvc.encode(array)
    assert zvc.encode(array, threads=threads) == frame
    assert same_bits(zvc.decode(frame, n, threads=threads), array)
    dirty = np.full(n, 7, np.float32)
    zvc.decode_into(frame, dirty, threads=threads)
    assert same_bits(dirty, array)


def test_threads_reject_what_one_thread_rejects() -> None:
    array = sample("float32", 3 * zvc.CHUNK, 0.5, seed=3)
    frame = zvc.encode(array)
    values_at = zvc.HEADER_BYTES + (array.size + 7) // 8
    nnz = HEADER.unpack_from(frame)[6]
    zero_last = bytearray(frame)
    zero_last[values_at + 4 * (nnz - 1):] = bytes(4)  # in the last thread's share of the values
    moved = bytearray(frame)
    moved[values_at - 1] ^= 0b1  # a mark more or fewer in the last range: the total no longer matches
    out = np.full(array.size, 7, np.float32)
    for bad, match in ((zero_last, "packs a zero value"), (moved, "the header declares")):
        with pytest.raises(WireError, match=match):
            zvc.decode(bad, array.size, threads=3)
        with pytest.raises(WireError, match=match):
            zvc.decode_into(bad, out, threads=3)
        assert (out == 7).all()  # nothing written
    with pytest.raises(ValueError, match="threads"):
        zvc.encode(array, threads=0)


def test_a_huge_element_count_allocates_nothing() -> None:
    good = small_frames()[0]
    huge = patched(good, n=1 << 60, nnz=3)
    tracemalloc.start()
    try:
        with pytest.raises(WireError, match="over this receiver's limit"):
            zvc.decode(huge, 1 << 20)
        with pytest.raises(WireError, match="must be"):  # a generous limit: the exact length refuses it
            zvc.decode(huge, 1 << 62)
        with pytest.raises(WireError, match="must be"):
            zvc.decode(patched(good, n=(1 << 64) - 1, nnz=(1 << 64) - 1), 1 << 64)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 10, peak


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dtype=st.sampled_from(sorted(zvc.CODES)), n=st.integers(0, 300), density=st.floats(0, 1),
       seed=st.integers(0, 99))
def test_random_arrays_round_trip(dtype: str, n: int, density: float, seed: int) -> None:
    roundtrip(sample(dtype, n, density, seed), wire_name(dtype))


def check_decodes_or_rejects(data: bytes) -> None:
    try:
        array = zvc.decode(data, 4096)
    except WireError:
        return
    header = zvc.read_header(data, 4096)
    assert array.dtype == header.storage and array.size == header.n
    assert np.count_nonzero(array.view(f"u{array.itemsize}")) == header.nnz
    again = zvc.encode(array, header.dtype)
    assert same_bits(zvc.decode(again, 4096), array)
    if zvc.read_header(again, 4096).raw == header.raw:  # in the mode the encoder picks, the very same bytes
        assert again == data


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=200))
def test_random_bytes_decode_or_raise_wire_error(data: bytes) -> None:
    check_decodes_or_rejects(data)
    check_decodes_or_rejects(zvc.MAGIC + bytes([zvc.VERSION]) + data)  # past the magic, to reach the deeper checks


@settings(max_examples=300, deadline=None)
@given(position=st.integers(0, 10_000), value=st.integers(0, 255), which=st.integers(0, 1))
def test_a_changed_byte_decodes_or_raises_wire_error(position: int, value: int, which: int) -> None:
    frame = bytearray(small_frames()[which])
    frame[position % len(frame)] = value
    check_decodes_or_rejects(bytes(frame))
