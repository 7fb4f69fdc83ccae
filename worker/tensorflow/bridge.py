"""TensorFlow tensors as numpy arrays and back, eagerly or from inside a tf.function (one tf.py_function).

Reading is zero-copy where TF allows it: `np.asarray` of a CPU eager tensor is a read-only view of
its buffer (`.numpy()` would copy), so collectives copy a tensor once, into the array they send.
Inside a tf.function the numpy work runs in one `tf.py_function`, which XLA cannot compile: under
`jit_compile=True` the trace fails at once with a SluiceError that says what to set. A collective
whose ranks disagreed raises tf.errors.FailedPreconditionError when eager, as Horovod's ops do; inside
a graph a py_function can only raise InvalidArgumentError (for a ValueError, such as an invalid call)
or UnknownError (anything else, a disagreement too).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from sluice.errors import CollectiveError, SluiceError

#: TF dtype -> the wire dtype its values travel as (bfloat16 as its raw 16-bit patterns)
WIRE = {tf.float32: "float32", tf.float64: "float64", tf.float16: "float16", tf.bfloat16: "bfloat16",
        tf.int64: "int64", tf.int32: "int32", tf.int16: "int16", tf.int8: "int8", tf.uint64: "uint64",
        tf.uint32: "uint32", tf.uint16: "uint16", tf.uint8: "uint8", tf.bool: "bool"}

XLA_HELP = ("pass jit_compile=False to model.compile (Keras 3 resolves jit_compile='auto' to True when a GPU is "
            "visible) or to the tf.function of your training step; sluice.keras's BroadcastGlobalVariablesCallback "
            "turns it off for model.fit by itself")

NumpyFn = Callable[[list[np.ndarray]], Sequence[np.ndarray]]


def wire_dtype(dtype: Any) -> str:
    """The wire dtype of a TF dtype; SluiceError for one that Sluice does not carry."""
    wire = WIRE.get(tf.as_dtype(dtype))
    if wire is None:
        raise SluiceError(f"dtype {tf.as_dtype(dtype).name} is not supported; use one of {sorted(WIRE.values())}")
    return wire


def to_numpy(tensor: Any) -> np.ndarray:
    """An eager tensor's values in the storage of its wire dtype: a read-only view of its buffer on the CPU."""
    array = np.asarray(tensor)
    return array.view(np.uint16) if tensor.dtype == tf.bfloat16 else array


def to_tensor(array: np.ndarray, dtype: Any) -> Any:
    """An eager tensor of `dtype` holding `array` (storage of the wire dtype)."""
    if tf.as_dtype(dtype) == tf.bfloat16:
        return tf.bitcast(tf.convert_to_tensor(np.ascontiguousarray(array).view(np.uint16)), tf.bfloat16)
    return tf.convert_to_tensor(array, dtype=dtype)


def xla_compiling() -> bool:
    """Is the graph being built one that XLA compiles (a tf.function with jit_compile=True, or inside one)?"""
    if tf.executing_eagerly():
        return False
    try:  # TF's own check for this (the same one tf.function makes); not part of its public API
        from tensorflow.python.framework import ops
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # a TF that moved it: the XLA compiler's own error will say what it cannot compile
        return False
    return bool(control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph()))


def run_numpy(fn: NumpyFn, tensors: Sequence[Any], out_dtypes: Sequence[Any], out_shapes: Sequence[Any],
              what: str) -> list[Any]:
    """`fn` (arrays in, arrays out, in wire storage) applied to `tensors`: now when eager, else as one
    tf.py_function node of the graph being traced, its outputs given `out_shapes` (None: unknown)."""
    def body(*inputs: Any) -> list[Any]:
        outputs = fn([to_numpy(t) for t in inputs])
        return [to_tensor(a, d) for a, d in zip(outputs, out_dtypes, strict=True)]

    if tf.executing_eagerly():
        try:
            return body(*tensors)
        except CollectiveError as exc:  # the ranks disagreed: Horovod's TF ops fail with this code
            raise tf.errors.FailedPreconditionError(None, None, str(exc)) from exc
    if xla_compiling():
        raise SluiceError(f"sluice {what} runs in Python (tf.py_function), which XLA cannot compile: {XLA_HELP}")
    outputs = tf.py_function(body, list(tensors), Tout=list(out_dtypes), name=what.replace(" ", "_"))
    if not isinstance(outputs, list | tuple):
        outputs = [outputs]
    for output, shape in zip(outputs, out_shapes, strict=True):
        output.set_shape(shape)
    return list(outputs)
