"""Wire format: every kind and dtype round-trips; every malformed message raises WireError and nothing else."""

from __future__ import annotations

import contextlib
import inspect
import random
import re
import sys
import tracemalloc
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluice.transport.dtypes import STORAGE
from sluice.transport.msgpack_scan import ScanError, scan
from sluice.transport.wire import (
    CONTROL_HEADER_BYTES,
    DATA_HEADER_BYTES,
    DTYPES,
    HEADER_FIELDS,
    MAX_DEPTH,
    MAX_DIMS,
    MAX_ITEMS,
    MAX_PAYLOAD_BYTES,
    SCAN_ABOVE,
    VERSION,
    Flag,
    Kind,
    Message,
    WireError,
    brief,
    decode,
    encode,
)

pytestmark = pytest.mark.timeout(30)

FIELDS = ["version", "kind", "sender", "key", "chunk", "round", "priority", "dtype", "shape", "nbytes", "flags", "meta"]
assert len(FIELDS) == HEADER_FIELDS


def header(**fields: Any) -> bytes:
    """A packed header: a valid PUSH without payload, with `fields` overridden by name."""
    values: dict[str, Any] = {
        "version": VERSION, "kind": int(Kind.PUSH), "sender": 3, "key": 7, "chunk": 1, "round": 2,
        "priority": 0, "dtype": "", "shape": [], "nbytes": 0, "flags": 0, "meta": None,
    }
    unknown = set(fields) - set(values)
    assert not unknown, unknown
    values.update(fields)
    return bytes(msgpack.packb([values[name] for name in FIELDS]))


def float32_header(**fields: Any) -> bytes:
    """A valid header for a float32 payload of shape (2, 3) (24 bytes), with overrides."""
    return header(**{"dtype": "float32", "shape": [2, 3], "nbytes": 24, **fields})


def uint8_header(nbytes: int) -> bytes:
    """A valid header for a uint8 payload of `nbytes` bytes."""
    return header(dtype="uint8", shape=[nbytes], nbytes=nbytes)


PAYLOAD_24 = bytes(range(24))


def sample(dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Deterministic array of `dtype` (bfloat16 as its uint16 bit pattern)."""
    count = int(np.prod(shape))
    return (np.arange(count, dtype=np.int64) % 100).astype(STORAGE[dtype]).reshape(shape)


# ------------------------------------------------------------------------------------------ round trips
@pytest.mark.parametrize("kind", list(Kind))
def test_round_trip_without_payload(kind: Kind) -> None:
    meta = {"seq": 4, "name": "w", "tensors": [[0, "w", "float32", None, [[0, 6]]]], "f": 1.5, "ok": True}
    msg = Message(kind, sender=5, key=9, chunk=3, round=11, priority=2, flags=int(Flag.WANT_REPLY), meta=meta)
    frames = encode(msg)
    assert len(frames) == 1
    got = decode(frames)
    assert got == msg
    assert got.payload is None and got.nbytes == 0 and got.dtype == "" and got.shape == ()


@pytest.mark.parametrize("kind", list(Kind))
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_round_trip_with_payload(kind: Kind, dtype: str) -> None:
    data = sample(dtype, (2, 3))
    msg = Message(kind, sender=-1, key=1, chunk=0, round=3, priority=7, dtype=dtype, shape=data.shape, payload=data)
    frames = encode(msg)
    assert len(frames) == 2
    assert frames[1] is data, "encode must hand over the caller's buffer itself"
    got = decode([bytes(frames[0]), data.tobytes()])
    assert (got.kind, got.sender, got.key, got.chunk, got.round, got.priority) == (kind, -1, 1, 0, 3, 7)
    assert (got.dtype, got.shape, got.flags, got.meta) == (dtype, (2, 3), 0, None)
    assert isinstance(got.payload, memoryview)
    assert got.nbytes == 6 * DTYPES[dtype]
    back = np.frombuffer(got.payload, STORAGE[dtype]).reshape(got.shape)
    np.testing.assert_array_equal(back, data)


@pytest.mark.parametrize(
    ("shape", "size"),
    [((), 1), ((0,), 0), ((4, 0, 2), 0), ((1,) * MAX_DIMS, 1), ((5,), 5)],
)
def test_round_trip_edge_shapes(shape: tuple[int, ...], size: int) -> None:
    data = np.ones(shape, np.float64)
    got = decode(encode(Message(Kind.REPLY, dtype="float64", shape=shape, payload=data)))
    assert got.shape == shape and got.nbytes == 8 * size


def test_bfloat16_travels_as_raw_uint16_bits() -> None:
    bits = np.array([0x3F80, 0xC000, 0x7F80, 0x0001], np.uint16)  # 1.0, -2.0, +inf, smallest subnormal
    got = decode(encode(Message(Kind.PUSH, dtype="bfloat16", shape=(4,), payload=bits)))
    assert bytes(got.payload) == bits.tobytes()


def test_decode_is_zero_copy() -> None:
    data = np.arange(256, dtype=np.float32)
    head = bytes(encode(Message(Kind.PUSH, dtype="float32", shape=(256,), payload=data))[0])
    frame = bytearray(data.tobytes())
    got = decode([head, frame])
    assert np.shares_memory(np.frombuffer(got.payload, np.uint8), np.frombuffer(frame, np.uint8))
    frame[0:4] = np.float32(42.0).tobytes()  # a change to the frame shows through the decoded view
    assert np.frombuffer(got.payload, np.float32)[0] == 42.0


def test_decode_of_zmq_frames_is_zero_copy() -> None:
    data = np.arange(64, dtype=np.int32)
    head = encode(Message(Kind.REPLY, dtype="int32", shape=(64,), payload=data))[0]
    got = decode([zmq.Frame(head), zmq.Frame(data, copy=False)])
    assert np.shares_memory(np.frombuffer(got.payload, np.uint8), data)
    np.testing.assert_array_equal(np.frombuffer(got.payload, np.int32), data)


def test_shared_memory_descriptor_round_trip() -> None:
    msg = Message(Kind.PUSH, sender=2, key=4, dtype="float32", shape=(6,), flags=int(Flag.WANT_REPLY),
                  shm=("sluice-12-3-0badf00d", 4096, 24))
    frames = encode(msg)
    assert len(frames) == 2 and msgpack.unpackb(frames[1]) == ["sluice-12-3-0badf00d", 4096]
    got = decode(frames)
    assert got.shm == ("sluice-12-3-0badf00d", 4096, 24) and got.payload is None and got.nbytes == 24
    assert got.flags == int(Flag.WANT_REPLY | Flag.SHM)


def test_shm_flag_of_the_caller_is_cleared_without_a_descriptor() -> None:
    data = np.zeros(6, np.float32)
    got = decode(encode(Message(Kind.PUSH, dtype="float32", shape=(6,), flags=int(Flag.SHM), payload=data)))
    assert got.shm is None and bytes(got.payload) == data.tobytes() and got.flags == 0


# ------------------------------------------------------------------------------------------ rejections
def _not_msgpack_header(fields: list[Any]) -> bytes:
    return bytes(msgpack.packb(fields))


def _packed(value: Any) -> bytes:
    return bytes(msgpack.packb(value))


MALFORMED: list[tuple[str, list[Any], str]] = [
    # frame counts
    ("no frames", [], "1 or 2 frames"),
    ("3 frames", [float32_header(), PAYLOAD_24, b"x"], "1 or 2 frames"),
    ("3 frames without dtype", [header(), b"", b""], "1 or 2 frames"),
    # version
    ("version 2", [header(version=2)], "version"),
    ("version 0", [header(version=0)], "version"),
    ("version -1", [header(version=-1)], "version"),
    ("version as str", [header(version="1")], "version"),
    ("version nil", [header(version=None)], "version"),
    ("version true", [header(version=True)], "version"),
    ("version 1.0", [header(version=1.0)], "version"),
    # header shape and encoding
    ("empty header", [b""], "not valid msgpack"),
    ("header of 11 fields", [_not_msgpack_header([1, 20, 0, 0, 0, 0, 0, "", [], 0, 0])], "12 fields"),
    ("header of 13 fields", [_not_msgpack_header([1, 20, 0, 0, 0, 0, 0, "", [], 0, 0, None, 0])], "12 fields"),
    ("header of 0 fields", [_not_msgpack_header([])], "12 fields"),
    ("header is a map", [bytes(msgpack.packb({"version": 1}))], "12 fields"),
    ("header is an int", [bytes(msgpack.packb(1))], "12 fields"),
    ("header is a str", [bytes(msgpack.packb("x" * 12))], "12 fields"),
    ("trailing bytes after header", [header() + b"\x00"], "not valid msgpack"),
    ("two headers in one frame", [header() + header()], "not valid msgpack"),
    ("array32 of 4G elements", [b"\xdd\xff\xff\xff\xff"], "not valid msgpack"),
    ("map32 of 4G entries", [b"\xdf\xff\xff\xff\xff"], "not valid msgpack"),
    ("bin32 of 4 GiB", [b"\xc6\xff\xff\xff\xff"], "not valid msgpack"),
    ("header too large", [b"\x00" * (DATA_HEADER_BYTES + 1)], "exceeds"),
    ("invalid utf-8 in dtype", [header().replace(b"\xa0\x90", b"\xa1\xff\x90")], "not valid msgpack"),
    ("msgpack reserved byte 0xc1", [b"\xc1"], "not valid msgpack"),
    # kind
    ("kind 0", [header(kind=0)], "message kind"),
    ("kind 39", [header(kind=39)], "message kind"),
    ("kind 99", [header(kind=99)], "message kind"),
    ("kind -1", [header(kind=-1)], "message kind"),
    ("kind as str", [header(kind="PUSH")], "message kind"),
    ("kind as float", [header(kind=20.0)], "message kind"),
    ("kind as bool", [header(kind=True)], "message kind"),
    # int fields: type and range
    ("negative key", [header(key=-1)], "field 'key'"),
    ("key 2**31", [header(key=1 << 31)], "field 'key'"),
    ("negative chunk", [header(chunk=-1)], "field 'chunk'"),
    ("negative round", [header(round=-1)], "field 'round'"),
    ("round 2**63", [header(round=1 << 63)], "field 'round'"),
    ("negative priority", [header(priority=-5)], "field 'priority'"),
    ("negative flags", [header(flags=-1)], "field 'flags'"),
    ("flags 2**16", [header(flags=1 << 16)], "field 'flags'"),
    ("sender -2", [header(sender=-2)], "field 'sender'"),
    ("sender 2**20", [header(sender=1 << 20)], "field 'sender'"),
    ("sender as str", [header(sender="worker-0")], "field 'sender'"),
    ("key as float", [header(key=7.0)], "field 'key'"),
    ("key as bool", [header(key=True)], "field 'key'"),
    ("key nil", [header(key=None)], "field 'key'"),
    ("chunk as list", [header(chunk=[1])], "field 'chunk'"),
    ("round as bytes", [header(round=b"\x01")], "field 'round'"),
    ("priority as map", [header(priority={"p": 0})], "field 'priority'"),
    ("flags as str", [header(flags="1")], "field 'flags'"),
    ("nbytes as str", [header(nbytes="0")], "field 'nbytes'"),
    ("nbytes as float", [float32_header(nbytes=24.0), PAYLOAD_24], "field 'nbytes'"),
    # meta
    ("meta is a list", [header(meta=[1, 2])], "meta must be"),
    ("meta is an int", [header(meta=5)], "meta must be"),
    ("meta is a str", [header(meta="x")], "meta must be"),
    ("meta with int keys", [header(meta={1: "a"})], "not valid msgpack"),
    ("ext type inside meta", [header(meta={"a": msgpack.ExtType(5, b"x")})], "extension type"),
    ("ext type nested in meta", [header(meta={"a": [1, {"b": msgpack.ExtType(5, b"x")}]})], "extension type"),
    ("empty ext type inside meta", [header(meta={"a": msgpack.ExtType(5, b"")})], "extension type"),
    ("timestamp ext inside meta", [header(meta={"a": msgpack.Timestamp(1, 0)})], "extension type"),
    ("ext type in a long header", [header(meta={"a": "x" * 300, "b": msgpack.ExtType(5, b"")})], "extension type"),
    ("meta with bytes keys", [header(meta={b"a": 1})], "meta keys must be strings"),
    ("meta is an ext type", [header(meta=msgpack.ExtType(1, b"x"))], "extension type"),
    ("key is an ext type", [header(key=msgpack.ExtType(1, b"x"))], "extension type"),
    ("dtype is an ext type", [header(dtype=msgpack.ExtType(1, b"x"))], "extension type"),
    ("shape holds an ext type", [float32_header(shape=[msgpack.ExtType(1, b"x")]), PAYLOAD_24], "extension type"),
    # dtype
    ("unknown dtype complex64", [float32_header(dtype="complex64"), PAYLOAD_24], "is not one of"),
    ("unknown dtype FLOAT32", [float32_header(dtype="FLOAT32"), PAYLOAD_24], "is not one of"),
    ("unknown dtype with space", [float32_header(dtype="float32 "), PAYLOAD_24], "is not one of"),
    ("unknown dtype object", [float32_header(dtype="object"), PAYLOAD_24], "is not one of"),
    ("dtype nil", [float32_header(dtype=None), PAYLOAD_24], "is not one of"),
    ("dtype as int", [float32_header(dtype=4), PAYLOAD_24], "is not one of"),
    ("dtype as bytes", [float32_header(dtype=b"float32"), PAYLOAD_24], "is not one of"),
    # shape
    ("shape not a list", [float32_header(shape=6), PAYLOAD_24], "shape must be"),
    ("shape as str", [float32_header(shape="6"), PAYLOAD_24], "shape must be"),
    ("shape with negative dim", [float32_header(shape=[-2, -3]), PAYLOAD_24], "field 'shape'"),
    ("shape with float dim", [float32_header(shape=[6.0]), PAYLOAD_24], "field 'shape'"),
    ("shape with too many dims", [header(dtype="uint8", shape=[1] * (MAX_DIMS + 1), nbytes=1), b"x"], "shape must be"),
    ("shape product overflows", [header(dtype="uint8", shape=[1 << 30] * 4, nbytes=1), b"x"], "does not match"),
    # sizes against frames
    ("shape does not match nbytes", [float32_header(shape=[2, 2]), PAYLOAD_24], "does not match"),
    ("shape does not match itemsize", [float32_header(dtype="float64"), PAYLOAD_24], "does not match"),
    ("nbytes above the frame length", [float32_header(nbytes=28, shape=[7]), PAYLOAD_24], "declares"),
    ("nbytes below the frame length", [float32_header(nbytes=20, shape=[5]), PAYLOAD_24], "declares"),
    ("frame longer than declared", [float32_header(), PAYLOAD_24 + b"\x00"], "declares"),
    ("frame shorter than declared", [float32_header(), PAYLOAD_24[:-1]], "declares"),
    ("empty payload frame", [float32_header(), b""], "declares"),
    ("huge nbytes 2**40", [float32_header(nbytes=1 << 40, shape=[1 << 38]), PAYLOAD_24], "field 'nbytes'"),
    ("nbytes at the payload limit", [uint8_header(MAX_PAYLOAD_BYTES), b"x"], "field 'nbytes'"),
    ("nbytes just under the limit", [uint8_header(MAX_PAYLOAD_BYTES - 1), b"x"], "declares"),
    ("nbytes 2**64-1", [float32_header(nbytes=(1 << 64) - 1), PAYLOAD_24], "field 'nbytes'"),
    ("negative nbytes", [float32_header(nbytes=-24), PAYLOAD_24], "field 'nbytes'"),
    # shared-memory descriptors (flags has SHM: frame 1 is [segment name, offset], not the payload)
    ("descriptor not msgpack", [float32_header(flags=int(Flag.SHM)), b"\xc1"], "descriptor is not valid msgpack"),
    ("descriptor too long", [float32_header(flags=int(Flag.SHM)), bytes(300)], "descriptor too long"),
    ("descriptor is a map", [float32_header(flags=int(Flag.SHM)), _packed({"name": "x"})], "[segment name, offset]"),
    ("descriptor of 3 fields", [float32_header(flags=int(Flag.SHM)), _packed(["x", 0, 24])], "[segment name, offset]"),
    ("descriptor name not str", [float32_header(flags=int(Flag.SHM)), _packed([b"x", 0])], "[segment name, offset]"),
    ("descriptor negative offset", [float32_header(flags=int(Flag.SHM)), _packed(["x", -1])], "field 'offset'"),
    ("descriptor float offset", [float32_header(flags=int(Flag.SHM)), _packed(["x", 1.0])], "field 'offset'"),
    ("descriptor without dtype", [header(flags=int(Flag.SHM)), _packed(["x", 0])], "without dtype"),
    ("shm flag without descriptor", [float32_header(flags=int(Flag.SHM))], "exactly one payload frame"),
    ("shm shape mismatch", [float32_header(flags=int(Flag.SHM), shape=[5]), _packed(["x", 0])], "does not match"),
    # payload frame against dtype
    ("payload frame without dtype", [header(), PAYLOAD_24], "without dtype"),
    ("payload frame without dtype, nbytes 24", [header(nbytes=24), PAYLOAD_24], "without dtype"),
    ("empty payload frame without dtype", [header(), b""], "without dtype"),
    ("no dtype but a shape", [header(shape=[2, 3])], "without dtype"),
    ("no dtype but nbytes", [header(nbytes=24)], "without dtype"),
    ("dtype without payload frame", [float32_header()], "exactly one payload frame"),
    ("dtype without payload, nbytes 0", [header(dtype="float32", shape=[0], nbytes=0)], "exactly one payload frame"),
]


@pytest.mark.parametrize(("case", "frames", "reason"), MALFORMED, ids=[case for case, _, _ in MALFORMED])
def test_malformed_message_raises_wire_error(case: str, frames: list[Any], reason: str) -> None:
    with pytest.raises(WireError, match=re.escape(reason)):
        decode(frames)


def test_wire_error_is_a_value_error() -> None:
    assert issubclass(WireError, ValueError)


def test_every_truncation_of_a_header_is_rejected() -> None:
    full = encode(
        Message(Kind.PUSH, sender=1, key=70000, chunk=3, round=1 << 40, priority=5, dtype="float32",
                shape=(2, 3), meta={"opt": {"lr": 0.1}}, payload=np.zeros(6, np.float32))
    )
    head = bytes(full[0])
    assert decode([head, PAYLOAD_24]).round == 1 << 40
    for cut in range(len(head)):
        with pytest.raises(WireError):
            decode([head[:cut], PAYLOAD_24])


@pytest.mark.parametrize("seed", range(5))
def test_random_bytes_are_rejected(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(200):
        head = rng.randbytes(rng.randint(0, 96))
        frames: list[bytes] = [head] if rng.random() < 0.5 else [head, rng.randbytes(rng.randint(0, 64))]
        with pytest.raises(WireError):
            decode(frames)


@pytest.mark.parametrize("seed", range(5))
def test_mutated_messages_decode_or_raise_wire_error_only(seed: int) -> None:
    """Bit flips of a valid message: whatever decode makes of them, it raises nothing but WireError."""
    rng = random.Random(seed)
    head = float32_header(meta={"seq": 1, "tensors": [[0, "w", "float32", None, [[0, 6]]]]})
    accepted = 0
    for _ in range(300):
        mutated = bytearray(head)
        for _ in range(rng.randint(1, 4)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        try:
            msg = decode([bytes(mutated), PAYLOAD_24])
        except WireError:
            continue
        accepted += 1
        assert msg.dtype in DTYPES and msg.nbytes == 24 and msg.nbytes == len(PAYLOAD_24)
    assert accepted < 300


def test_large_valid_header_is_accepted_on_control_connections_only() -> None:
    meta = {"tensors": [[i, f"layer{i}.weight", "float32", None, [[0, 1024]]] for i in range(2000)]}
    frames = encode(Message(Kind.PLAN, meta=meta))
    assert DATA_HEADER_BYTES < len(frames[0]) < CONTROL_HEADER_BYTES
    assert decode(frames, max_header=CONTROL_HEADER_BYTES).meta == meta
    assert decode([zmq.Frame(frames[0])], max_header=CONTROL_HEADER_BYTES).meta == meta  # scanned in place
    with pytest.raises(WireError, match="exceeds 65536"):
        decode(frames)


# ------------------------------------------------------------------------------------------ hostile input
# Property tests: whatever arrives, decode returns a Message or raises WireError (never another type),
# its error message is short, and an over-limit header is refused before msgpack builds anything.
# Deterministic (derandomize) and small (max_examples), so this part runs in about a second.
PROPERTY = settings(max_examples=150, derandomize=True, database=None, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

_leaves = (
    st.none() | st.booleans() | st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1)
    | st.floats() | st.text(max_size=20) | st.binary(max_size=20)
    | st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=6))
    | st.builds(msgpack.Timestamp, st.integers(0, 1 << 32), st.integers(0, 999_999_999))
)
#: any msgpack document: nested lists and maps (keys of several types), ints of any msgpack size, ext types
documents = st.recursive(
    _leaves,
    lambda inner: st.lists(inner, max_size=5)
    | st.dictionaries(st.text(max_size=8) | st.integers(-5, 5) | st.binary(max_size=4), inner, max_size=5),
    max_leaves=30,
)


def decode_or_wire_error(frames: list[Any], max_header: int = DATA_HEADER_BYTES) -> Message | None:
    """decode, asserting that the only exception is a WireError with a short message."""
    try:
        return decode(frames, max_header)
    except WireError as exc:
        assert len(str(exc)) < 300, str(exc)
        return None


def deep(levels: int) -> bytes:
    """`levels` nested one-element arrays around a nil, as raw msgpack (nothing is built to make it)."""
    return b"\x91" * levels + b"\xc0"


def with_raw_meta(meta: bytes, **fields: Any) -> bytes:
    """A valid header whose meta field is the raw msgpack `meta` (header() ends with meta's nil byte)."""
    head = header(**fields)
    assert head.endswith(b"\xc0")
    return head[:-1] + meta


def padding(text_bytes: int) -> bytes:
    """A raw meta entry "p": str of `text_bytes` characters, to push a header past SCAN_ABOVE."""
    return b"\xa1p\xda" + text_bytes.to_bytes(2, "big") + b"x" * text_bytes


@PROPERTY
@given(st.binary(max_size=600), st.none() | st.binary(max_size=64))
def test_arbitrary_bytes_decode_or_raise_wire_error(head: bytes, payload: bytes | None) -> None:
    decode_or_wire_error([head] if payload is None else [head, payload])


@PROPERTY
@given(documents)
def test_arbitrary_msgpack_documents_decode_or_raise_wire_error(document: Any) -> None:
    packed = bytes(msgpack.packb(document))
    assert decode_or_wire_error([packed]) is None  # no document but a 12-field header decodes
    decode_or_wire_error([header(meta={"x": document})])
    decode_or_wire_error([with_raw_meta(b"\x82" + padding(300) + b"\xa1x" + packed)])  # the same, scanned


@PROPERTY
@given(st.sampled_from(FIELDS), documents, st.booleans())
def test_a_header_with_any_value_in_any_field_decodes_or_raises_wire_error(
    field: str, value: Any, with_payload: bool
) -> None:
    frames = [float32_header(**{field: value}), PAYLOAD_24] if with_payload else [header(**{field: value})]
    msg = decode_or_wire_error(frames)
    if msg is not None:
        assert msg.dtype in ("", *DTYPES) and (msg.meta is None or isinstance(msg.meta, dict))
        assert all(type(d) is int for d in msg.shape) and type(msg.key) is int


@PROPERTY
@given(st.binary(min_size=1, max_size=300), st.integers(0, 400))
def test_bytes_spliced_into_a_valid_header_decode_or_raise_wire_error(junk: bytes, at: int) -> None:
    head = float32_header(meta={"seq": 1, "name": "x" * 200})
    at = min(at, len(head))
    decode_or_wire_error([head[:at] + junk + head[at:], PAYLOAD_24])
    decode_or_wire_error([head[:at] + junk, PAYLOAD_24])


@pytest.mark.parametrize("levels", [MAX_DEPTH, 40, 255, 1000, 100_000])
def test_deep_nesting_is_refused_without_recursion(levels: int) -> None:
    cases = [
        [deep(levels)],  # the header itself
        [with_raw_meta(b"\x81\xa1a" + deep(levels))],  # inside meta
        [header()[:4] + deep(levels) + header()[5:]],  # in place of the key: [1, 20, 3, [[[...]]], ...]
    ]
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(len(inspect.stack()) + 60)  # any recursion over the levels would fail
    try:
        for frames in cases:
            for max_header in (DATA_HEADER_BYTES, CONTROL_HEADER_BYTES):
                with pytest.raises(WireError):
                    decode(frames, max_header)
    finally:
        sys.setrecursionlimit(limit)


@pytest.mark.parametrize("pad", [0, 300], ids=["short header", "scanned header"])
def test_nesting_up_to_max_depth_is_accepted_and_one_more_is_refused(pad: int) -> None:
    # the header's array is depth 1, meta depth 2: meta {"a": [[...]]} with k arrays reaches depth 2 + k
    extra = padding(pad) if pad else b""
    count = b"\x82" if pad else b"\x81"
    fits = with_raw_meta(count + extra + b"\xa1a" + deep(MAX_DEPTH - 2))
    too_deep = with_raw_meta(count + extra + b"\xa1a" + deep(MAX_DEPTH - 1))
    assert (len(fits) > SCAN_ABOVE) == bool(pad)
    msg = decode([fits])
    assert msg.meta is not None and msg.meta["a"] is not None
    with pytest.raises(WireError, match="deeper than 32"):
        decode([too_deep])


CLAIMS = {"str32": b"\xdb", "bin32": b"\xc6", "array32": b"\xdd", "map32": b"\xdf", "ext32": b"\xc9"}


@pytest.mark.parametrize("pad", [0, 300], ids=["short header", "scanned header"])
@pytest.mark.parametrize("kind", sorted(CLAIMS))
def test_claimed_lengths_of_4g_are_refused(kind: str, pad: int) -> None:
    claim = CLAIMS[kind] + b"\xff\xff\xff\xff" + b"\x00" * 8
    extra = padding(pad) if pad else b""
    for frames in ([claim], [with_raw_meta((b"\x82" if pad else b"\x81") + extra + b"\xa1a" + claim)]):
        tracemalloc.start()
        try:
            with pytest.raises(WireError):
                decode(frames, CONTROL_HEADER_BYTES)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 64 << 10


def _padded_header(size: int) -> bytes:
    """A valid header of exactly `size` bytes: meta {"p": str}."""
    base = len(with_raw_meta(b"\x81\xa1p\xdb\x00\x00\x00\x00"))
    text = size - base
    return with_raw_meta(b"\x81\xa1p\xdb" + text.to_bytes(4, "big") + b"x" * text)


@pytest.mark.parametrize("limit", [DATA_HEADER_BYTES, CONTROL_HEADER_BYTES])
def test_header_size_limit_is_exact(limit: int) -> None:
    assert len(_padded_header(limit)) == limit
    meta = decode([_padded_header(limit)], limit).meta
    assert meta is not None and set(meta["p"]) == {"x"}
    with pytest.raises(WireError, match=f"exceeds {limit}"):
        decode([_padded_header(limit + 1)], limit)


def test_item_limit_is_exact() -> None:
    # root array + 12 fields + meta's key and value + the list's items
    fits = MAX_ITEMS - (1 + HEADER_FIELDS + 2)
    msg = decode([header(meta={"a": [0] * fits})], CONTROL_HEADER_BYTES)
    assert msg.meta is not None and len(msg.meta["a"]) == fits
    with pytest.raises(WireError, match=f"more than {MAX_ITEMS} values"):
        decode([header(meta={"a": [0] * (fits + 1)})], CONTROL_HEADER_BYTES)


def test_meta_is_bounded_by_the_header_limit() -> None:
    frames = [header(meta={"opt": {"name": "sgd", "lr": 0.1, "note": "x" * DATA_HEADER_BYTES}})]
    with pytest.raises(WireError, match="exceeds"):
        decode(frames)
    assert decode(frames, CONTROL_HEADER_BYTES).meta is not None


OVER_LIMIT = {  # built when the test runs, not when pytest collects
    "31 MiB of str": lambda: with_raw_meta(b"\x81\xa1a\xdb" + (31 << 20).to_bytes(4, "big") + b"x" * (31 << 20)),
    "31 MiB of empty lists": lambda: b"\xdd" + (31 << 20).to_bytes(4, "big") + b"\x90" * (31 << 20),
    "4 MiB of empty lists": lambda: b"\xdd" + (4 << 20).to_bytes(4, "big") + b"\x90" * ((4 << 20) - 5),
    "50,000 empty lists then junk": lambda: b"\xdd" + (50_000).to_bytes(4, "big") + b"\x90" * 50_000 + b"!",
}


@pytest.mark.parametrize("case", sorted(OVER_LIMIT))
def test_an_over_limit_header_allocates_nothing_big(case: str) -> None:
    head = OVER_LIMIT[case]()
    for max_header in (DATA_HEADER_BYTES, CONTROL_HEADER_BYTES):
        tracemalloc.start()
        try:
            with pytest.raises(WireError):
                decode([head], max_header)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20, f"{case}: decode allocated {peak} bytes"


def _depth_and_items(value: Any) -> tuple[int, int]:
    if isinstance(value, list | dict):
        children = [x for pair in value.items() for x in pair] if isinstance(value, dict) else value
        inner = [_depth_and_items(child) for child in children]
        return 1 + max((d for d, _ in inner), default=0), 1 + sum(n for _, n in inner)
    return 0, 1


def _has_ext(value: Any) -> bool:
    if isinstance(value, list | dict):
        children = [x for pair in value.items() for x in pair] if isinstance(value, dict) else value
        return any(_has_ext(child) for child in children)
    return isinstance(value, msgpack.ExtType | msgpack.Timestamp)


@PROPERTY
@given(documents, st.integers(1, 4), st.integers(1, 40))
def test_scan_accepts_exactly_the_documents_within_its_limits(document: Any, max_depth: int, max_items: int) -> None:
    depth, items = _depth_and_items(document)
    within = depth <= max_depth and items <= max_items and not _has_ext(document)
    try:
        scan(bytes(msgpack.packb(document)), max_depth, max_items)
        accepted = True
    except ScanError:
        accepted = False
    assert accepted == within


FORMATS: list[tuple[str, Any, int]] = [  # (name, document, values in it)
    *((f"str of {n}", "x" * n, 1) for n in (0, 31, 32, 255, 256, 65535, 65536)),
    *((f"bin of {n}", b"x" * n, 1) for n in (0, 255, 256, 65535, 65536)),
    *((f"array of {n}", [None] * n, n + 1) for n in (0, 15, 16, 65535, 65536)),
    *((f"map of {n}", {str(i): 0 for i in range(n)}, 2 * n + 1) for n in (0, 15, 16, 65536)),
    *((f"int {v}", v, 1) for v in (0, 127, 128, 255, 256, 65535, 65536, (1 << 32) - 1, 1 << 32, (1 << 64) - 1,
                                   -1, -32, -33, -128, -129, -32768, -32769, -(1 << 31), -(1 << 31) - 1, -(1 << 63))),
    ("nil, bools, floats", [None, True, False, 1.5, float("inf")], 6),
]


@pytest.mark.parametrize(("name", "document", "values"), FORMATS, ids=[name for name, _, _ in FORMATS])
def test_scan_reads_every_format(name: str, document: Any, values: int) -> None:
    for packed in {bytes(msgpack.packb(document)), bytes(msgpack.packb(document, use_single_float=True))}:
        scan(packed, 1, values)
        if values > 1:
            with pytest.raises(ScanError, match="more than"):
                scan(packed, 1, values - 1)
        if len(packed) > 1:
            with pytest.raises(ScanError, match=r"truncated|claims"):
                scan(packed[:-1], 1, values)
        with pytest.raises(ScanError, match="follow"):
            scan(packed + b"\xc0", 1, values)


@PROPERTY
@given(st.binary(max_size=200))
def test_what_scan_accepts_msgpack_can_read(data: bytes) -> None:
    try:
        scan(data, MAX_DEPTH, MAX_ITEMS)
    except ScanError:
        return
    with contextlib.suppress(TypeError):  # a list or map as a map key: unhashable (decode's strict_map_key refuses it)
        msgpack.unpackb(data, raw=True, strict_map_key=False)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, "None"), (True, "True"), (1.5, "1.5"), (-3, "-3"), ((1 << 64) - 1, "18446744073709551615"),
        (1 << 200, "an int of 201 bits"), ("float32", "'float32'"),
        ("x" * 1000, "'xxxxxxxxxxxxxxxxxxxx'... (1000 characters)"),
        (b"\x00" * 50, repr(b"\x00" * 20) + "... (50 bytes)"), ([1, 2, 3], "a list of 3 items"),
        ({"a": 1}, "a map of 1 entries"), (msgpack.ExtType(1, b"x" * 100), "a ExtType"), ((1, 2), "a tuple of 2 items"),
    ],
)
def test_brief_names_a_value_without_its_contents(value: Any, expected: str) -> None:
    assert brief(value) == expected


def test_brief_of_a_huge_nested_value_is_quick_and_short() -> None:
    nested: list[Any] = []
    for _ in range(100_000):
        nested = [nested]
    assert brief(nested) == "a list of 1 items"
    assert brief(10**5000).startswith("an int of")
