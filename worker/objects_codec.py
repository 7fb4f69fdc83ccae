"""Objects as msgpack bytes, never pickle: the codec of every shim's broadcast_object and allgather_object.

Horovod pickles (cloudpickle) the object, so a peer's bytes run code on unpickling. Here an object
is msgpack: None, bool, int, float, str, bytes, lists and dicts (keys of those types too), plus
extension types for a tuple (code 1), a numpy array (2) of a dtype from a fixed list, and each
framework's tensors (torch: 3, TensorFlow: 4; a `TensorType` that the shim gives its `Codec`),
arrays and tensors as [dtype name, shape, raw bytes]. numpy scalars travel as Python numbers.
Anything else (a class instance, a set, a function) is refused at the sender with TypeError, saying
what is allowed. Decoding builds only those types, and raises ValueError for anything else: no
code runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

TUPLE, ARRAY = 1, 2
#: the numpy dtypes an array may have
NUMPY_DTYPES = frozenset({"bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
                          "float16", "float32", "float64", "complex64", "complex128"})
PLAIN = "None, bool, int, float, str, bytes, list, tuple, dict, numpy arrays"


@dataclass(frozen=True)
class TensorType:
    """A framework's tensors as an extension type, [dtype name, shape, raw bytes] on the wire."""

    code: int
    types: tuple[type, ...]
    #: "torch tensors": what the refusal message lists
    what: str
    #: tensor -> (dtype name, shape, raw bytes); TypeError for a dtype it cannot send
    encode: Callable[[Any], tuple[str, list[int], bytes]]
    #: (dtype name, shape, raw bytes) -> tensor; ValueError for a dtype it does not allow
    decode: Callable[[str, list[int], bytes], Any]


class Codec:
    """dumps and loads for plain values, numpy arrays and the given framework's tensors."""

    def __init__(self, tensors: Sequence[TensorType] = ()) -> None:
        self._tensors = {t.code: t for t in tensors}
        self.allowed = PLAIN + "".join(f" and {t.what}" for t in tensors)

    def dumps(self, obj: Any) -> bytes:
        """`obj` as msgpack bytes; TypeError for what the format cannot carry."""
        return msgpack.packb(obj, default=self._default, use_bin_type=True, strict_types=True)

    def loads(self, data: bytes) -> Any:
        """The object `dumps` wrote; ValueError on anything else. Sizes are bounded by `data` itself."""
        try:
            return msgpack.unpackb(data, ext_hook=self._ext, raw=False, strict_map_key=False, use_list=True)
        except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
            raise ValueError(f"not an object sent by broadcast_object/allgather_object: {exc}") from None

    def _default(self, obj: Any) -> Any:
        if isinstance(obj, tuple):
            return msgpack.ExtType(TUPLE, self.dumps(list(obj)))
        if isinstance(obj, np.ndarray) and obj.dtype.name in NUMPY_DTYPES:
            body = [obj.dtype.name, list(obj.shape), np.ascontiguousarray(obj).tobytes()]
            return msgpack.ExtType(ARRAY, self.dumps(body))
        for tensor in self._tensors.values():
            if isinstance(obj, tensor.types):
                name, shape, raw = tensor.encode(obj)
                return msgpack.ExtType(tensor.code, self.dumps([name, shape, raw]))
        if isinstance(obj, np.generic):
            return obj.item()
        raise TypeError(f"{type(obj).__name__} cannot be sent without pickle; use {self.allowed}")

    def _ext(self, code: int, data: bytes) -> Any:
        if code == TUPLE:
            value = self.loads(data)
            if not isinstance(value, list):
                raise ValueError("a tuple extension must hold a list")
            return tuple(value)
        if code != ARRAY and code not in self._tensors:
            raise ValueError(f"unknown extension type {code}")
        body = self.loads(data)
        if not (isinstance(body, list) and len(body) == 3 and isinstance(body[0], str) and isinstance(body[1], list)
                and all(isinstance(d, int) and d >= 0 for d in body[1]) and isinstance(body[2], bytes)):
            raise ValueError("an array extension must be [dtype, shape, bytes]")
        name, shape, raw = body
        if code != ARRAY:
            try:
                return self._tensors[code].decode(name, shape, raw)
            except (RuntimeError, TypeError) as exc:  # raw bytes that do not fill the shape
                raise ValueError(f"a tensor extension that does not decode: {exc}") from None
        if name not in NUMPY_DTYPES:
            raise ValueError(f"dtype {name[:20]!r} is not allowed")
        return np.frombuffer(raw, np.dtype(name)).reshape(shape).copy()
