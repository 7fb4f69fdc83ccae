"""Wire format: one msgpack header frame plus at most one raw payload frame, validated on decode.

Layout of a message (a ZeroMQ multipart message):

    frame 0   msgpack array, positional, exactly HEADER_FIELDS long:
              [version, kind, sender, key, chunk, round, priority, dtype, shape, nbytes, flags, meta]
                version   int, must equal VERSION
                kind      int, a Kind value
                sender    int, node id of the sender (-1 before the scheduler assigned one)
                key       int >= 0, tensor key (or channel index for ACK)
                chunk     int >= 0, chunk index inside the tensor
                round     int >= 0, synchronous round, broadcast version, or acked bytes (ACK)
                priority  int >= 0, smaller is more urgent
                dtype     str, "" when there is no payload, else one of DTYPES
                shape     list of int >= 0 (at most MAX_DIMS), the payload's shape
                nbytes    int >= 0, length of the payload frame
                flags     int >= 0, a bit set of Flag values
                meta      nil or a map with str keys of plain msgpack values (control messages)
    frame 1   raw tensor bytes (only when dtype != ""), received zero-copy; or, when flags
              has SHM, a msgpack [segment name, offset] naming where the nbytes lie in shared memory

msgpack is decoded with no object hooks, so decoding never runs code. Limits hold before msgpack builds
anything: frame count, header size (`max_header`: DATA_HEADER_BYTES between workers and servers,
CONTROL_HEADER_BYTES to and from the scheduler), and, for headers above SCAN_ABOVE bytes, nesting depth
and number of values, by a walk over the bytes (transport/msgpack_scan.py). No error message reprs a
received value: `brief` names its type and shows only small scalars and the start of a string.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import msgpack

from sluice.transport.brief import brief as brief  # re-exported: receivers format what they got with it
from sluice.transport.msgpack_scan import ScanError, scan

VERSION = 1
HEADER_FIELDS = 12
MAX_DIMS = 8
#: header limit between workers and servers: data headers are 30-150 bytes, meta is optimizer settings
DATA_HEADER_BYTES = 64 << 10
#: header limit for messages to and from the scheduler, which carry tensor tables and address books
CONTROL_HEADER_BYTES = 4 << 20
#: containers nested in a header, the header's own array counted: meta is at depth 2
MAX_DEPTH = 32
#: values in a header, containers and map keys included (a PLAN of 100,000 chunks has about 500,000)
MAX_ITEMS = 1 << 20
#: headers up to this size skip the scan: they decode into at most this many values, which msgpack's
#: fixed stack (1024 deep) handles, and the field checks below refuse any field nested too deeply
SCAN_ABOVE = 256
MAX_PAYLOAD_BYTES = 1 << 31
MAX_INT = 1 << 62

#: dtype name -> item size in bytes. bfloat16 has no numpy twin and travels as raw bytes.
DTYPES: dict[str, int] = {
    "float32": 4,
    "float64": 8,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1,
    "bool": 1,
    # float8 formats travel as their bytes (broadcast, allgather); reductions run in float32 (worker/torch)
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
}


class Kind(IntEnum):
    """Message kinds. Control kinds go to and from the scheduler; data kinds carry tensors."""

    REGISTER = 1
    WELCOME = 2
    DECLARE = 3
    PLAN = 4
    BARRIER = 5
    RELEASE = 6
    HEARTBEAT = 7
    HEARTBEAT_ACK = 8
    NODE_LOST = 9
    BYE = 10
    SHUTDOWN = 11
    PLAN_ACK = 12
    #: aggregation trees of a new routing epoch (scheduler -> aggregators and workers), and the
    #: receivers' acknowledgements; COMMIT tells workers from which round of each tensor it applies
    ROUTES = 13
    ROUTES_ACK = 14
    COMMIT = 15
    #: a server that died was replaced (ps.recover): its new endpoints, to the workers and aggregators
    SERVER_BACK = 16
    #: a process's timeline part at its end, in chunks (meta seq, data, last), and the scheduler's
    #: acknowledgement of each (meta seq; refused: why it keeps no more of it): scheduler/timeline_parts.py
    TIMELINE = 17
    TIMELINE_ACK = 18
    #: node -> the standby scheduler once the scheduler fell silent (scheduler.standby): who it is and what
    #: the scheduler had told it, so the standby rebuilds the job's state (scheduler/standby.py)
    REJOIN = 19
    PUSH = 20
    PULL = 21
    REPLY = 22
    BCAST_PUSH = 23
    BCAST_PULL = 24
    BCAST_REPLY = 25
    PROBE = 26
    PROBE_REPLY = 27
    #: transport-internal: "I will send descriptors into this segment of mine" / "I have mapped it"
    SHM_OPEN = 28
    SHM_MAPPED = 29
    ACK = 30
    ERROR = 31
    #: worker -> server: meta joined=true: "I called join(): count me as pushing zeros"; joined=false:
    #: "I am back" (the server echoes it, so the worker knows before it pushes again)
    JOIN = 32
    #: server -> the server that mirrors its shard (ps.replicas, ps/mirror.py): a chunk's committed state
    #: (or, meta `plan`, the chunks of a PLAN), and the holder's acknowledgement once it is in its file
    MIRROR = 33
    MIRROR_ACK = 34
    #: ps.replicas, scheduler -> a holder: server meta `rank` took over from its mirror on this host (its
    #: own host was lost): stop writing that mirror and unlock it for the replacement
    MIRROR_RELEASE = 35
    #: an aggregator that died was replaced (ps.recover): its new endpoints, to all that send it something
    AGGREGATOR_BACK = 36
    #: transport-internal, a dealer's first message on each connection: meta `process`, its transport's token
    HELLO = 37
    #: between workers: the coordinator tree (requests and ready bits up, decisions down)
    COORD_UP = 40
    COORD_DOWN = 41
    #: between workers: one chunk of a collective's data, and "I have consumed all of yours for op N"
    COLL_DATA = 42
    COLL_DONE = 43
    #: between the stages of a pipeline: activations forward, their gradients backward (worker/pipeline/)
    STAGE_FORWARD = 44
    STAGE_BACKWARD = 45
    #: COLL_DATA and COLL_DONE of a sub-group's data plane (the replicas of one pipeline stage)
    GROUP_DATA = 46
    GROUP_DONE = 47
    #: between neighbouring stages on one host: "connect to my direct lane" (transport/lane.py)
    STAGE_LANE = 48
    #: COORD_UP, COORD_DOWN, COLL_DATA and COLL_DONE of a process set's engine, meta["set"] its id
    #: (worker/collective/sets.py)
    SET_UP = 49
    SET_DOWN = 50
    SET_DATA = 51
    SET_DONE = 52


class Flag:
    """Bits of the flags field; plain ints, because enum arithmetic is slow on the per-chunk path."""

    NONE = 0
    #: a PUSH that also asks for the round's result, saving a PULL message
    WANT_REPLY = 1
    #: frame 1 is a shared-memory descriptor, not the payload itself (transport/shm.py)
    SHM = 2
    #: the sender is on this host and reads shared memory: replies may use SHM
    LOCAL = 4
    #: a worker sends this again to a server that replaced a dead one (ps.recover): a push of a round
    #: the server already committed is answered, not applied twice
    RESEND = 8
    #: with RESEND: a push the worker was already answered for, replayed to a server that took over from a
    #: holder of its state rounds behind (ps.replicas): applied if its round is the next, never answered
    REPLAY = 16


_KINDS = {int(k): k for k in Kind}


class WireError(ValueError):
    """A message that does not follow the wire format; the receiver logs and drops it."""


@dataclass(slots=True)
class Message:
    kind: Kind
    sender: int = -1
    key: int = 0
    chunk: int = 0
    round: int = 0
    priority: int = 0
    dtype: str = ""
    shape: tuple[int, ...] = ()
    flags: int = 0
    meta: dict[str, Any] | None = None
    payload: Any = None  # any object with the buffer protocol; a memoryview after decode
    #: (segment name, offset, nbytes) of a payload in shared memory; set by the transport only
    shm: tuple[str, int, int] | None = None

    @property
    def nbytes(self) -> int:
        if self.shm is not None:
            return self.shm[2]
        return 0 if self.payload is None else memoryview(self.payload).nbytes


def keep_payload(msg: Message) -> Message:
    """`msg`, in place, with a payload of its own: to keep it past its handler, as a received payload may be a
    buffer (shared memory, the transport's) that is reused once the handler returns."""
    if msg.payload is not None:
        msg.payload = memoryview(bytes(msg.payload))
    return msg


def encode(msg: Message) -> list[Any]:
    """Frames for `msg`; the payload frame is the caller's buffer itself (no copy)."""
    nbytes = msg.nbytes
    flags = int(msg.flags) | Flag.SHM if msg.shm is not None else int(msg.flags) & ~Flag.SHM
    header = msgpack.packb(
        [
            VERSION,
            int(msg.kind),
            msg.sender,
            msg.key,
            msg.chunk,
            msg.round,
            msg.priority,
            msg.dtype,
            list(msg.shape),
            nbytes,
            flags,
            msg.meta,
        ]
    )
    if msg.shm is not None:
        return [header, msgpack.packb([msg.shm[0], msg.shm[1]])]
    if msg.payload is None:
        return [header]
    return [header, msg.payload]


_LEAVES = frozenset((type(None), bool, int, float, str, bytes))


def _check_plain(meta: dict[Any, Any], depth: int) -> None:
    """Only nil, bool, numbers, strings, bytes, lists and str-keyed maps, at most MAX_DEPTH deep
    (`depth`: the depth of `meta` itself); iterative, so no structure can exhaust the stack."""
    stack: list[tuple[Any, int]] = [(meta, depth)]
    while stack:
        value, level = stack.pop()
        if level > MAX_DEPTH:
            raise WireError(f"meta is nested deeper than {MAX_DEPTH} containers")
        if type(value) is dict:
            for key in value:
                if type(key) is not str:
                    raise WireError(f"meta keys must be strings, got {brief(key)}")
            items = value.values()
        else:
            items = value
        for item in items:
            kind = type(item)
            if kind is dict or kind is list:
                stack.append((item, level + 1))
            elif kind not in _LEAVES:
                raise WireError(f"meta holds a {kind.__name__}, which the wire format does not allow")


def _int_field(value: object, name: str, low: int, high: int = MAX_INT) -> int:
    if type(value) is not int or not low <= value < high:
        raise WireError(f"field {name!r} must be an int in [{low}, {high}), got {brief(value)}")
    return value


class _ExtensionRefused(Exception):
    """Raised from msgpack's ext_hook: an extension type of length 0 (longer ones exceed max_ext_len)."""


def _refuse_extension(code: int, data: bytes) -> Any:
    raise _ExtensionRefused


def _unpack(header: memoryview, what: str) -> Any:
    """Decode a header that passed the limits. msgpack's own limits are a second line of defence: no
    extension types, and no length beyond the bytes at hand (its defaults) or beyond MAX_ITEMS."""
    size = header.nbytes
    try:
        if size <= SCAN_ABOVE:
            return msgpack.unpackb(header, raw=False, strict_map_key=True, use_list=True, max_ext_len=0,
                                   ext_hook=_refuse_extension)
        return msgpack.unpackb(
            header, raw=False, strict_map_key=True, use_list=True, max_str_len=size, max_bin_len=size,
            max_array_len=min(size, MAX_ITEMS), max_map_len=min(size // 2, MAX_ITEMS), max_ext_len=0,
            ext_hook=_refuse_extension,
        )
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise _unpack_error(exc, what) from None


def _unpack_error(exc: Exception, what: str) -> WireError:
    if isinstance(exc, _ExtensionRefused) or (isinstance(exc, ValueError) and "max_ext_len" in str(exc)):
        return WireError(f"{what} holds an extension type, which the wire format does not allow")
    return WireError(f"{what} is not valid msgpack: {type(exc).__name__}")


def frame_view(frame: Any) -> memoryview:
    """A received or outgoing frame's bytes (a zmq.Frame's buffer, or any buffer); WireError for anything else."""
    buffer = getattr(frame, "buffer", None)  # zmq.Frame when received with copy=False
    try:
        return memoryview(buffer if buffer is not None else frame)
    except (TypeError, ValueError):  # not a buffer, or a released one
        raise WireError(f"a frame is {brief(frame)}, not a byte buffer") from None


def decode(frames: Sequence[Any], max_header: int = DATA_HEADER_BYTES) -> Message:
    """Parse and validate one message whose header is at most `max_header` bytes; raise WireError on
    anything out of format, before msgpack builds anything where a limit can tell."""
    if not 1 <= len(frames) <= 2:
        raise WireError(f"expected 1 or 2 frames, got {len(frames)}")
    header_bytes = frame_view(frames[0])
    size = header_bytes.nbytes
    if size > max_header:
        raise WireError(f"header of {size} bytes exceeds {max_header}")
    if size <= SCAN_ABOVE:  # the data path: _unpack inlined
        try:
            fields = msgpack.unpackb(header_bytes, raw=False, strict_map_key=True, use_list=True, max_ext_len=0,
                                     ext_hook=_refuse_extension)
        except Exception as exc:
            raise _unpack_error(exc, "header") from None
    else:
        try:
            scan(header_bytes, MAX_DEPTH, MAX_ITEMS)
        except ScanError as exc:
            raise WireError(f"header is not valid msgpack: {exc}") from None
        except TypeError:  # a buffer that is not one-dimensional bytes
            raise WireError("header is not valid msgpack: not a flat byte buffer") from None
        fields = _unpack(header_bytes, "header")
    if type(fields) is not list or len(fields) != HEADER_FIELDS:
        raise WireError(f"header must be a msgpack array of 12 fields, got {brief(fields)}")
    version, kind, sender, key, chunk, rnd, priority, dtype, shape, nbytes, flags, meta = fields
    if type(version) is not int or version != VERSION:
        raise WireError(f"protocol version {brief(version)} is not {VERSION}")
    member = _KINDS.get(kind) if type(kind) is int else None
    if member is None:
        raise WireError(f"unknown message kind {brief(kind)}")
    msg = Message(
        kind=member,
        sender=_int_field(sender, "sender", -1, 1 << 20),
        key=_int_field(key, "key", 0, 1 << 31),
        chunk=_int_field(chunk, "chunk", 0, 1 << 31),
        round=_int_field(rnd, "round", 0),
        priority=_int_field(priority, "priority", 0, 1 << 31),
        flags=_int_field(flags, "flags", 0, 1 << 16),
    )
    if meta is not None:
        if type(meta) is not dict:
            raise WireError(f"meta must be nil or a map, got {brief(meta)}")
        _check_plain(meta, 2)
    msg.meta = meta
    declared = _int_field(nbytes, "nbytes", 0, MAX_PAYLOAD_BYTES)
    if type(shape) is not list or len(shape) > MAX_DIMS:
        raise WireError(f"shape must be a list of at most {MAX_DIMS} ints, got {brief(shape)}")
    msg.shape = tuple(_int_field(d, "shape", 0, MAX_PAYLOAD_BYTES) for d in shape)
    if dtype == "":
        if len(frames) != 1 or declared != 0 or msg.shape:
            raise WireError("a message without dtype must have no payload, nbytes 0 and no shape")
        return msg
    if type(dtype) is not str or dtype not in DTYPES:
        raise WireError(f"dtype {brief(dtype)} is not one of {sorted(DTYPES)}")
    if len(frames) != 2:
        raise WireError(f"a {dtype} message needs exactly one payload frame")
    if math.prod(msg.shape) * DTYPES[dtype] != declared:
        raise WireError(f"shape {msg.shape} of {dtype} does not match {declared} bytes")
    msg.dtype = dtype
    if msg.flags & Flag.SHM:
        msg.shm = _descriptor(frame_view(frames[1]), declared)
        return msg
    payload = frame_view(frames[1])
    if payload.nbytes != declared:
        raise WireError(f"header declares {declared} payload bytes, frame has {payload.nbytes}")
    msg.payload = payload
    return msg


def _descriptor(frame: memoryview, nbytes: int) -> tuple[str, int, int]:
    if frame.nbytes > 256:
        raise WireError("shared-memory descriptor too long")
    fields = _unpack(frame, "shared-memory descriptor")
    if not (type(fields) is list and len(fields) == 2 and type(fields[0]) is str):
        raise WireError("shared-memory descriptor must be [segment name, offset]")
    return fields[0], _int_field(fields[1], "offset", 0, MAX_INT), nbytes


def meta_field(msg: Message, name: str, kind: type | tuple[type, ...]) -> Any:
    """A required field of a control message's meta map, type-checked."""
    if msg.meta is None or name not in msg.meta:
        raise WireError(f"{msg.kind.name} message lacks meta field {name!r}")
    value = msg.meta[name]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind in (int, float)):
        raise WireError(f"{msg.kind.name} meta field {name!r} has type {type(value).__name__}")
    return value
