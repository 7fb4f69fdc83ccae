"""Stage messages: one tensor of a micro-batch's activations (forward) or gradients (backward), in pieces.

    STAGE_FORWARD / STAGE_BACKWARD
        sender = the sending worker's rank, round = step, chunk = micro-batch, key = slot (the tensor's
        place among the micro-batch's tensors), priority = the direction's; dtype "uint8", shape
        [piece bytes], the payload one piece of the tensor's bytes, raw or a transport/zvc.py frame;
        meta = {"of": tensors in the micro-batch, "dtype": the tensor's, "shape": its shape,
                "zvc": whether the bytes are a ZVC frame, "size": their length, "piece": the length of
                every piece but the last, "at": this piece's offset (a multiple of "piece")}

Pieces, because a data socket refuses a frame larger than the job's chunk (transport/zmq_guard.py);
so every message names its tensor's shape, dtype, micro-batch and step: a shape that changes between
batches needs nothing agreed in advance, and one that does not fit is refused or reported by name.
`read` checks every field before anything is allocated; `Assembly` collects a tensor's pieces (each
once, all agreeing on the tensor) and decodes it once complete, a ZVC frame to exactly its shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from sluice.transport import zvc
from sluice.transport.dtypes import STORAGE
from sluice.transport.wire import DTYPES, MAX_DIMS, Kind, Message, WireError, brief

FORWARD, BACKWARD = Kind.STAGE_FORWARD, Kind.STAGE_BACKWARD
#: tensors one micro-batch may carry between two stages
MAX_SLOTS = 64
#: a ZVC encode that did not pay (the tensor was dense) skips this many of the slot's next tensors
SKIP_AFTER_DENSE = 15
_META = frozenset(("of", "dtype", "shape", "zvc", "size", "piece", "at"))


@dataclass(frozen=True)
class Received:
    """One tensor of a stage message, decoded: `array` holds its wire storage (bfloat16 as uint16 bits)."""

    slot: int
    of: int
    dtype: str
    array: np.ndarray[Any, Any]
    wire_bytes: int


@dataclass(frozen=True)
class Piece:
    """One message's part of a tensor, checked: the tensor's description and where these bytes go."""

    slot: int
    of: int
    dtype: str
    shape: tuple[int, ...]
    zvc: bool
    size: int
    piece: int
    at: int
    data: memoryview

    def same_tensor(self, other: Piece) -> bool:
        return (self.of, self.dtype, self.shape, self.zvc, self.size, self.piece) == (
            other.of, other.dtype, other.shape, other.zvc, other.size, other.piece)


def build(kind: Kind, sender: int, step: int, micro: int, slot: int, of: int, array: np.ndarray[Any, Any],
          dtype: str, priority: int, compress: bool, piece: int) -> list[Message]:
    """The messages carrying `array` (a tensor's wire storage) in pieces of at most `piece` bytes; its
    bytes ZVC-encoded when `compress` and the frame is smaller than the raw bytes. No copy of raw bytes."""
    shape = [int(d) for d in array.shape]
    data: Any = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    encoded = False
    if compress and dtype in zvc.CODES and array.size:
        frame = zvc.encode(array, dtype)
        if len(frame) < array.nbytes:
            data, encoded = np.frombuffer(frame, np.uint8), True
    size = int(data.size)
    messages = []
    for at in range(0, max(size, 1), piece):
        part = data[at:at + piece]
        messages.append(Message(kind, sender=sender, key=slot, chunk=micro, round=step, priority=priority,
                                dtype="uint8", shape=(int(part.size),), payload=part,
                                meta={"of": of, "dtype": dtype, "shape": shape, "zvc": encoded, "size": size,
                                      "piece": piece, "at": at}))
    return messages


def read(msg: Message, max_elements: int) -> Piece:
    """The piece in `msg` (a view of its payload, valid during the handler call); WireError for anything
    out of format, or a tensor of more than `max_elements` elements."""
    meta = msg.meta
    if type(meta) is not dict or set(meta) != _META:
        raise WireError(f"a stage message's meta must have exactly {sorted(_META)}, got {brief(meta)}")
    of, dtype, shape, encoded, size, piece, at = (meta[k] for k in ("of", "dtype", "shape", "zvc", "size", "piece",
                                                                   "at"))
    if type(of) is not int or not 1 <= of <= MAX_SLOTS or not msg.key < of:
        raise WireError(f"slot {msg.key} of {brief(of)}: a micro-batch carries 1 to {MAX_SLOTS} tensors")
    if type(encoded) is not bool or type(dtype) is not str or dtype not in (zvc.CODES if encoded else DTYPES):
        raise WireError(f"dtype {brief(dtype)} (zvc {brief(encoded)}) is not one a stage message carries")
    if type(shape) is not list or len(shape) > MAX_DIMS or any(type(d) is not int or not 0 <= d < 1 << 40
                                                              for d in shape):
        raise WireError(f"shape must be a list of at most {MAX_DIMS} sizes, got {brief(shape)}")
    count = math.prod(shape)
    if count > max_elements:
        raise WireError(f"a tensor of {count} elements is over this stage's limit of {max_elements}")
    raw = count * DTYPES[dtype]
    if type(size) is not int or not (zvc.HEADER_BYTES <= size <= zvc.HEADER_BYTES + raw if encoded else size == raw):
        raise WireError(f"{brief(size)} bytes cannot hold {shape} of {dtype}{' as a ZVC frame' if encoded else ''}")
    if type(piece) is not int or type(at) is not int or piece < 1 or at < 0 or at % piece or at >= max(size, 1):
        raise WireError(f"piece {brief(piece)} at {brief(at)} does not cut {size} bytes")
    if msg.payload is None or msg.dtype != "uint8" or msg.shape != (min(piece, size - at),):
        raise WireError(f"a piece at {at} of {size} bytes in pieces of {piece} must be {min(piece, size - at)} "
                        f"bytes of uint8, got {msg.dtype or 'nothing'} of shape {msg.shape}")
    return Piece(msg.key, of, dtype, tuple(shape), encoded, size, piece, at, memoryview(msg.payload).cast("B"))


class Assembly:
    """One tensor's pieces as they come (in any order), the first one taken at once; `add` says why a
    later piece does not fit, or None."""

    def __init__(self, first: Piece, adopt: bool = False) -> None:
        """`adopt`: `first.data` is memory of its own (a lane's datagram), which a tensor in one piece keeps
        instead of a copy."""
        self.spec = first
        if adopt and first.at == 0 and len(first.data) == first.size:
            self.buffer = np.frombuffer(first.data, np.uint8)
            self._missing: set[int] = set()
            return
        self.buffer = np.empty(first.size, np.uint8)
        self._missing = set(range(0, max(first.size, 1), first.piece))
        self.add(first)

    @property
    def nbytes(self) -> int:
        return self.spec.size

    def complete(self) -> bool:
        return not self._missing

    def add(self, piece: Piece) -> str | None:
        if not piece.same_tensor(self.spec):
            return "it describes its tensor otherwise than an earlier piece did"
        if piece.at not in self._missing:
            return "it came twice"
        self._missing.discard(piece.at)
        self.buffer[piece.at:piece.at + len(piece.data)] = np.frombuffer(piece.data, np.uint8)
        return None

    def tensor(self) -> Received:
        """The decoded tensor (WireError for a ZVC frame that is not what it says)."""
        spec = self.spec
        if not spec.zvc:
            array = self.buffer.view(STORAGE[spec.dtype]).reshape(spec.shape)
            return Received(spec.slot, spec.of, spec.dtype, array, spec.size)
        count = math.prod(spec.shape)
        header = zvc.read_header(self.buffer, count)
        if header.dtype != spec.dtype or header.n != count:
            raise WireError(f"the ZVC frame holds {header.n} {header.dtype}, its message says {list(spec.shape)} "
                            f"of {spec.dtype}")
        return Received(spec.slot, spec.of, spec.dtype, zvc.decode(self.buffer, count).reshape(spec.shape), spec.size)


class Compression:
    """Whether to ZVC-encode each slot's next tensor, and what compression achieved (`ratio`)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.raw_bytes = 0  # the tensors' own bytes
        self.sent_bytes = 0  # what their messages carried
        self._skip: dict[int, int] = {}

    def wanted(self, slot: int) -> bool:
        if not self.enabled:
            return False
        left = self._skip.get(slot, 0)
        if left:
            self._skip[slot] = left - 1
            return False
        return True

    def count(self, slot: int, raw: int, messages: list[Message], tried: bool) -> None:
        sent = sum(m.nbytes for m in messages)
        self.raw_bytes += raw
        self.sent_bytes += sent
        if tried and sent >= raw:  # dense: encoding costs time and saves nothing, so try again later
            self._skip[slot] = SKIP_AFTER_DENSE

    @property
    def ratio(self) -> float:
        """Raw bytes over bytes sent (1.0 before anything was sent, or with compression off)."""
        return self.raw_bytes / self.sent_bytes if self.sent_bytes else 1.0
