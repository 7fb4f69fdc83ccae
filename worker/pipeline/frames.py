"""Stage messages: one tensor of a micro-batch's activations (forward) or gradients (backward), raw or ZVC.

    STAGE_FORWARD / STAGE_BACKWARD
        sender = the sending worker's rank, round = step, chunk = micro-batch, key = slot (the tensor's
        place among the micro-batch's tensors), priority = the direction's; meta = {"of": tensors in
        the micro-batch} and, when the payload is compressed, "zvc": [dtype, shape] of the tensor.
        Raw: dtype and shape are the tensor's (the wire checks them against the payload's length).
        ZVC: dtype "uint8", shape [frame bytes], the payload a transport/zvc.py frame.

So every message names its shape, dtype, micro-batch and step: a shape that changes between batches
needs nothing agreed in advance, and one that does not fit is refused or reported by name, not hung
on. `read` checks every field before it allocates; a frame must decode to exactly the shape declared.
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


@dataclass(frozen=True)
class Received:
    """One tensor of a stage message, decoded: `array` holds its wire storage (bfloat16 as uint16 bits)."""

    slot: int
    of: int
    dtype: str
    array: np.ndarray[Any, Any]
    wire_bytes: int


def build(kind: Kind, sender: int, step: int, micro: int, slot: int, of: int, array: np.ndarray[Any, Any],
          dtype: str, priority: int, compress: bool) -> Message:
    """The message carrying `array` (a tensor's wire storage); ZVC-compressed when `compress` and the
    frame is smaller than the raw bytes, else raw."""
    shape = tuple(int(d) for d in array.shape)
    if compress and dtype in zvc.CODES and array.size:
        frame = zvc.encode(array, dtype)
        if len(frame) < array.nbytes:
            return Message(kind, sender=sender, key=slot, chunk=micro, round=step, priority=priority, dtype="uint8",
                           shape=(len(frame),), meta={"of": of, "zvc": [dtype, list(shape)]}, payload=frame)
    return Message(kind, sender=sender, key=slot, chunk=micro, round=step, priority=priority, dtype=dtype,
                   shape=shape, meta={"of": of}, payload=np.ascontiguousarray(array))


def read(msg: Message, max_elements: int) -> Received:
    """The tensor in `msg` (a copy: the payload is only valid during the handler call); WireError for
    anything out of format, or a tensor of more than `max_elements` elements."""
    meta = msg.meta
    if type(meta) is not dict or not set(meta) <= {"of", "zvc"}:
        raise WireError(f"a stage message's meta must be a map of 'of' (and 'zvc'), got {brief(meta)}")
    of = meta.get("of")
    if type(of) is not int or not 1 <= of <= MAX_SLOTS or not msg.key < of:
        raise WireError(f"slot {msg.key} of {brief(of)}: a micro-batch carries 1 to {MAX_SLOTS} tensors")
    if msg.payload is None or not msg.dtype:
        raise WireError("a stage message carries a tensor")
    described = meta.get("zvc")
    if described is None:
        count = math.prod(msg.shape)
        if count > max_elements:
            raise WireError(f"a tensor of {count} elements is over this stage's limit of {max_elements}")
        array = np.frombuffer(msg.payload, STORAGE[msg.dtype]).reshape(msg.shape).copy()
        return Received(msg.key, of, msg.dtype, array, array.nbytes)
    dtype, shape = _described(described)
    if msg.dtype != "uint8" or len(msg.shape) != 1:
        raise WireError(f"a ZVC frame travels as 1-D uint8, got {msg.dtype} of shape {msg.shape}")
    count = math.prod(shape)
    if count > max_elements:
        raise WireError(f"a tensor of {count} elements is over this stage's limit of {max_elements}")
    header = zvc.read_header(msg.payload, count)
    if header.dtype != dtype or header.n != count:
        raise WireError(f"the ZVC frame holds {header.n} {header.dtype}, its message says {shape} of {dtype}")
    array = zvc.decode(msg.payload, count).reshape(shape)
    return Received(msg.key, of, dtype, array, msg.shape[0])


def _described(value: Any) -> tuple[str, tuple[int, ...]]:
    if type(value) is not list or len(value) != 2:
        raise WireError(f"'zvc' must be [dtype, shape], got {brief(value)}")
    dtype, shape = value
    if type(dtype) is not str or dtype not in zvc.CODES:
        raise WireError(f"'zvc' dtype {brief(dtype)} is not one ZVC encodes")
    if type(shape) is not list or len(shape) > MAX_DIMS or any(type(d) is not int or not 0 <= d < 1 << 40
                                                              for d in shape):
        raise WireError(f"'zvc' shape must be a list of at most {MAX_DIMS} sizes, got {brief(shape)}")
    if DTYPES[dtype] * math.prod(shape) >= 1 << 40:
        raise WireError(f"'zvc' shape {shape} of {dtype} is too large")
    return dtype, tuple(shape)


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

    def count(self, slot: int, raw: int, msg: Message, tried: bool) -> None:
        sent = msg.nbytes
        self.raw_bytes += raw
        self.sent_bytes += sent
        if tried and sent >= raw:  # dense: encoding costs time and saves nothing, so try again later
            self._skip[slot] = SKIP_AFTER_DENSE

    @property
    def ratio(self) -> float:
        """Raw bytes over bytes sent (1.0 before anything was sent, or with compression off)."""
        return self.raw_bytes / self.sent_bytes if self.sent_bytes else 1.0
