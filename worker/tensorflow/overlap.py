"""Inside a tf.function, each fused group of gradients leaves as soon as backward has produced it.

The traced form of FusedReducer.reduce (fused.py), split so that TF's dataflow can start the
exchange early. Each fused group gets its own tf.py_function node (`gradient_send`) whose inputs are
only the gradients that group carries: TF runs it the moment those exist, on an inter-op thread,
while the backward pass goes on computing the earlier layers' gradients on another; it copies them
into the group's range of the registered buffer and starts the group's allreduce (or push_pull),
which is asynchronous, and returns at once. One more node (`gradient_wait`), fed by every send's
token, waits for every group and hands the averaged gradients to the optimizer's update.

The sends are created in the order backward completes the groups (the least urgent first: the last
layers' gradients exist first). A tf.function runs py_function nodes (stateful ops) in the order they
were created (its automatic control dependencies), so every rank sends its groups in the same order,
and no send is held up behind one whose gradients come later. The values are those of the eager
path, bit for bit: the same buffers, groups, sums and scaling. A failed step (an error raised in a
send or in the wait) leaves nothing behind: the wait lets every group finish before raising, and the
next step's first send waits out what an interrupted step left in flight.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from sluice.errors import SluiceError
from sluice.worker.tensorflow.bridge import XLA_HELP, to_numpy, to_tensor, xla_compiling
from sluice.worker.tensorflow.fused import FusedReducer, Spec


def traceable(tensors: Sequence[Any]) -> bool:
    """Can `tensors` take the split path: a graph being traced, and every shape known?"""
    return not tf.executing_eagerly() and all(t.shape.is_fully_defined() for t in tensors)


def specs_of(tensors: Sequence[Any], names: Sequence[str], wires: Sequence[str]) -> tuple[Spec, ...]:
    """The reducer's key for these (traced, fully shaped) tensors: name, static shape and wire dtype."""
    return tuple(Spec(n, tuple(int(d) for d in t.shape), w) for n, t, w in zip(names, tensors, wires, strict=True))


def traced_reduce(reducer: FusedReducer, tensors: Sequence[Any], average: bool, prescale: float = 1.0,
                  postscale: float = 1.0) -> list[Any]:
    """The graph nodes that reduce `tensors` (in the reducer's order) through `reducer`: one send per
    fused group, fed by that group's gradients only, and one wait; returns the reduced tensors."""
    if xla_compiling():
        raise SluiceError(f"sluice gradient allreduce runs in Python (tf.py_function), which XLA cannot "
                          f"compile: {XLA_HELP}")
    tokens = []
    for fused, group in reducer.ready_order:
        indices = reducer.inputs_of(fused, group)

        def send(*inputs: Any, fused: int = fused, group: int = group, indices: list[int] = indices) -> Any:
            reducer.start(fused, group, {i: to_numpy(t) for i, t in zip(indices, inputs, strict=True)}, prescale)
            return np.int32(group)

        tokens.append(tf.py_function(send, [tensors[i] for i in indices], Tout=tf.int32, name="gradient_send"))
    dtypes = [t.dtype for t in tensors]

    def wait(*_tokens: Any) -> list[Any]:
        arrays = reducer.finish(average, postscale)
        return [to_tensor(a, d) for a, d in zip(arrays, dtypes, strict=True)]

    outputs = tf.py_function(wait, tokens, Tout=dtypes, name="gradient_wait")
    if not isinstance(outputs, list | tuple):
        outputs = [outputs]
    for output, tensor in zip(outputs, tensors, strict=True):
        output.set_shape(tensor.shape)
    return list(outputs)
