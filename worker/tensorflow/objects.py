"""Horovod's broadcast_object, broadcast_object_fn and allgather_object for TF, without pickle.

Horovod pickles (cloudpickle) the object, so a peer's bytes would run code here. Sluice sends msgpack
(worker/objects_codec.py): an object may be None, bool, int, float, str, bytes, a list, tuple or dict
of those (nested as deep as msgpack allows), a numpy array (bool, integer, float or complex), or a
tf.Tensor or tf.Variable of a dtype sluice.tensorflow carries (it arrives as a tf.Tensor on the
CPU); numpy scalars arrive as Python numbers. Anything else (a class instance, a set, a function, a
Keras model) raises TypeError at the sender, naming what is allowed, and the same call fails on
every other rank (tf.errors.FailedPreconditionError, as when ranks disagree), so the ranks stay in
step. Bytes that do not decode raise SluiceError: no code runs.

The exchange is numpy arrays on the collective engine: broadcast_object broadcasts the length, then
the bytes (the root gets its own object back, as in Horovod); allgather_object gathers every rank's
length, then every rank's bytes. They run in Python when called: eagerly, or inside a tf.function
once, while it is traced (the result is then a constant of the graph). `session` is Horovod's TF1
argument and is not needed: nothing runs in a graph.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import tensorflow as tf

from sluice.errors import CollectiveError, SluiceError
from sluice.transport.dtypes import STORAGE
from sluice.worker.collective.process_set import global_process_set
from sluice.worker.objects_codec import Codec, TensorType
from sluice.worker.tensorflow.bridge import WIRE, to_numpy, to_tensor, wire_dtype
from sluice.worker.tensorflow.calls import checking, collective_name, not_converted
from sluice.worker.tensorflow.collectives import check_root
from sluice.worker.tensorflow.state import engine, require


def _encode(value: Any) -> tuple[str, list[int], bytes]:
    tensor = tf.convert_to_tensor(value)
    try:
        wire = wire_dtype(tensor.dtype)
    except SluiceError as exc:
        raise TypeError(f"a tf.Tensor of {tensor.dtype.name} cannot be sent as an object: {exc}") from None
    return wire, list(tensor.shape), np.ascontiguousarray(to_numpy(tensor)).tobytes()


def _decode(name: str, shape: list[int], raw: bytes) -> Any:
    if name not in WIRE.values():
        raise ValueError(f"dtype {name[:20]!r} is not allowed")
    return to_tensor(np.frombuffer(raw, STORAGE[name]).reshape(shape), tf.as_dtype(name))


CODEC = Codec([TensorType(4, (tf.Tensor, tf.Variable), "tf.Tensor or tf.Variable values", _encode, _decode)])


@contextmanager
def _as_tf_errors() -> Iterator[None]:
    """A call the ranks disagreed on (or another rank refused) raises as Horovod's TF ops do."""
    try:
        yield
    except CollectiveError as exc:
        raise tf.errors.FailedPreconditionError(None, None, str(exc)) from exc


def _decoded(data: bytes, what: str) -> Any:
    try:
        return CODEC.loads(data)
    except ValueError as exc:
        raise SluiceError(f"{what}: {exc}") from None


@not_converted
def broadcast_object(obj: Any, root_rank: int = 0, session: Any = None, name: str | None = None,
                     process_set: Any = global_process_set) -> Any:
    """`root_rank`'s object on every rank (the others' `obj` is not sent); see the module for what may travel."""
    on = engine(process_set)
    label = collective_name(name, "broadcast_object", on)
    root = require().rank == root_rank
    with checking(label, on):
        check_root(root_rank)
        payload = CODEC.dumps(obj) if root else b""
    with _as_tf_errors():
        length = np.array([len(payload)], np.int64)
        on.broadcast(label, length, root_rank, "int64").wait()
        data = np.frombuffer(payload, np.uint8).copy() if root else np.zeros(int(length[0]), np.uint8)
        on.broadcast(f"{label}.bytes", data, root_rank, "uint8").wait()
    return obj if root else _decoded(data.tobytes(), f"broadcast_object {label!r}")


@not_converted
def broadcast_object_fn(root_rank: int = 0, session: Any = None, name: str | None = None,
                        process_set: Any = global_process_set) -> Callable[[Any], Any]:
    """Horovod's TF1 helper: a function that broadcasts the object it is given from `root_rank`."""
    def broadcast_fn(obj: Any) -> Any:
        return broadcast_object(obj, root_rank, session, name, process_set)

    return broadcast_fn


@not_converted
def allgather_object(obj: Any, session: Any = None, name: str | None = None,
                     process_set: Any = global_process_set) -> list[Any]:
    """Every rank's object, in rank order; see the module for what may travel."""
    on = engine(process_set)
    label = collective_name(name, "allgather_object", on)
    with checking(label, on):
        payload = CODEC.dumps(obj)
    with _as_tf_errors():
        lengths = on.allgather(label, np.array([len(payload)], np.int64), "int64").result()
        data = bytes(on.allgather(f"{label}.bytes", np.frombuffer(payload, np.uint8), "uint8").result())
    objects, offset = [], 0
    for length in np.asarray(lengths).tolist():
        objects.append(_decoded(data[offset: offset + length], f"allgather_object {label!r}"))
        offset += length
    return objects
