"""Inside a tf.function, each fused group of gradients leaves as soon as backward has produced it.

The traced form of FusedReducer.reduce (fused.py), split so that TF's dataflow can start the
exchange early. Each fused group gets its own tf.numpy_function node (`gradient_send`;
numpy_function rather than py_function: its arrays cross without eager tensors, at about half the
cost a call) whose inputs are only the gradients that group carries: TF runs it the moment those
exist, on an inter-op thread, while the backward pass goes on computing the earlier layers'
gradients on another; it copies them into the group's range of the registered buffer and starts the
group's allreduce (or push_pull), which is asynchronous, and returns at once. One more node
(`gradient_wait`), fed by every send's token, waits for every group and hands the averaged gradients
to the optimizer's update. Where the plan has a single group (a model within one fusion buffer:
collective.fusion_bytes), nothing could leave early, and one node (`gradient_allreduce`) sends and
waits, one Python call a step fewer.

The sends are created in the order backward completes the groups (the least urgent first: the last
layers' gradients exist first). A tf.function runs these nodes (stateful ops) in the order they
were created (its automatic control dependencies), so every rank sends its groups in the same order,
and no send is held up behind one whose gradients come later. The values are those of the eager
path, bit for bit: the same buffers, groups, sums and scaling. A failed step (an error raised in a
send or in the wait) leaves nothing behind: the wait lets every group finish before raising, and the
next step's first send waits out what an interrupted step left in flight. The nodes look the
reducer up at each run, so that a job re-formed in place (a new connection) needs no new trace.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from sluice.errors import SluiceError
from sluice.worker.tensorflow.bridge import XLA_HELP, xla_compiling
from sluice.worker.tensorflow.fused import FusedReducer, Spec


def _storage(array: np.ndarray) -> np.ndarray:
    """A node's input in its wire dtype's storage: bfloat16 (ml_dtypes') as its 16-bit patterns."""
    return array.view(np.uint16) if array.dtype == tf.bfloat16.as_numpy_dtype else array


def traceable(tensors: Sequence[Any]) -> bool:
    """Can `tensors` take the split path: a graph being traced, and every shape known?"""
    return not tf.executing_eagerly() and all(t.shape.is_fully_defined() for t in tensors)


def specs_of(tensors: Sequence[Any], names: Sequence[str], wires: Sequence[str]) -> tuple[Spec, ...]:
    """The reducer's key for these (traced, fully shaped) tensors: name, static shape and wire dtype."""
    return tuple(Spec(n, tuple(int(d) for d in t.shape), w) for n, t, w in zip(names, tensors, wires, strict=True))


class _Current:
    """The reducer a traced step runs through, looked up at each run: a job re-formed in place (elastic.py)
    gives the process a new connection, and the graph traced on the old one then uses the new reducer,
    which has the same groups where the job has the same workers and servers."""

    def __init__(self, lookup: Callable[[], FusedReducer]) -> None:
        self.lookup = lookup
        self.traced = self.checked = lookup()

    def __call__(self) -> FusedReducer:
        reducer = self.lookup()
        if reducer is not self.checked:
            if _layout(reducer) != _layout(self.traced):
                raise SluiceError("the re-formed job groups these gradients otherwise than the step traced before "
                                  "(other workers or servers): trace the training step again (a new tf.function, "
                                  "or model.make_train_function(force=True))")
            self.checked = reducer
        return reducer


def _layout(reducer: FusedReducer) -> list[tuple[int, int, list[int]]]:
    return [(fused, group, reducer.inputs_of(fused, group)) for fused, group in reducer.ready_order]


def traced_reduce(lookup: Callable[[], FusedReducer], tensors: Sequence[Any], average: bool, prescale: float = 1.0,
                  postscale: float = 1.0) -> list[Any]:
    """The graph nodes that reduce `tensors` (in the reducer's order) through the reducer `lookup()` gives,
    at tracing and at each run: one send per fused group, fed by that group's gradients only, and one
    wait (a single group: one node that sends and waits); returns the reduced tensors."""
    if xla_compiling():
        raise SluiceError(f"sluice gradient allreduce runs in Python (tf.py_function), which XLA cannot "
                          f"compile: {XLA_HELP}")
    current = _Current(lookup)
    reducer = current.traced
    dtypes = [t.dtype for t in tensors]
    returned = [tf.as_dtype(d).as_numpy_dtype for d in dtypes]  # bfloat16: ml_dtypes' (storage is uint16)

    def wait(*_tokens: Any) -> list[np.ndarray]:
        arrays = current().finish(average, postscale)
        return [a if a.dtype == r else a.view(r) for a, r in zip(arrays, returned, strict=True)]

    def sender(fused: int, group: int, indices: list[int]) -> Any:
        def send(*inputs: np.ndarray) -> np.ndarray:
            current().start(fused, group, {i: _storage(a) for i, a in zip(indices, inputs, strict=True)}, prescale)
            return np.array(group, np.int32)
        return send

    if len(reducer.ready_order) == 1:  # one group needs every gradient: nothing can leave early, one node
        send = sender(*reducer.ready_order[0], list(range(len(tensors))))
        outputs = tf.numpy_function(lambda *inputs: wait(send(*inputs)), list(tensors), Tout=dtypes,
                                    name="gradient_allreduce")
    else:
        tokens = []
        for fused, group in reducer.ready_order:
            indices = reducer.inputs_of(fused, group)
            tokens.append(tf.numpy_function(sender(fused, group, indices), [tensors[i] for i in indices],
                                            Tout=tf.int32, name="gradient_send"))
        outputs = tf.numpy_function(wait, tokens, Tout=dtypes, name="gradient_wait")
    if not isinstance(outputs, list | tuple):
        outputs = [outputs]
    for output, tensor in zip(outputs, tensors, strict=True):
        output.set_shape(tensor.shape)
    return list(outputs)
