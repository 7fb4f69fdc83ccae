"""Averaging gradients for TF: the shared step of DistributedGradientTape and Keras's DistributedOptimizer.

`GradientAverager` reduces one list of gradients (None stays None; tf.IndexedSlices are made dense,
as Horovod's sparse_as_dense) through the FusedReducer of that list of names, shapes and dtypes,
made the first time it is seen and kept for the process (a custom loop wraps a new tape every
step), in one tf.py_function inside a tf.function. Compression casts before and after.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from sluice.errors import SluiceError
from sluice.worker.tensorflow.bridge import run_numpy, wire_dtype
from sluice.worker.tensorflow.collectives import Average, Sum
from sluice.worker.tensorflow.compression import Compression, Compressor
from sluice.worker.tensorflow.fused import FusedReducer, Spec
from sluice.worker.tensorflow.state import NAMES, STATE, require


def variable_names(sources: Sequence[Any]) -> list[str]:
    """A name per source for routes, priorities and logs: a Keras variable's path, a tf.Variable's
    name, else its position; repeats get "#n" appended, so names are unique."""
    names: list[str] = []
    seen: dict[str, int] = {}
    for index, source in enumerate(sources):
        try:
            name = getattr(source, "path", None) or getattr(source, "name", None) or f"source{index}"
        except (AttributeError, ValueError):  # an eager tensor has no name
            name = f"source{index}"
        name = str(name).removesuffix(":0")
        count = seen.get(name, 0)
        seen[name] = count + 1
        names.append(name if count == 0 else f"{name}#{count}")
    return names


#: the fused reducer of each list of gradients, with the node it was made for; one step at a time each
_REDUCERS: dict[tuple[Spec, ...], tuple[FusedReducer, threading.Lock]] = {}
_REDUCERS_LOCK = threading.Lock()


def reducer_for(specs: tuple[Spec, ...]) -> tuple[FusedReducer, threading.Lock]:
    """The reducer of this list of gradients, made (on every rank alike) the first time it is seen."""
    node = require()
    with _REDUCERS_LOCK:
        entry = _REDUCERS.get(specs)
        if entry is None or entry[0].node is not node:  # new, or made before a shutdown() and init()
            entry = _REDUCERS[specs] = (FusedReducer(node, STATE.settings, specs, f"tf.grads{next(NAMES)}"),
                                        threading.Lock())
        return entry


class GradientAverager:
    """Sum or Average gradients over the workers, each list of variables through its own fused buffers."""

    def __init__(self, compression: type[Compressor] = Compression.none, op: str = Average,
                 gradient_predivide_factor: float = 1.0) -> None:
        if op not in (Average, Sum):
            raise SluiceError(f"op must be Average or Sum, got {op!r}")
        if gradient_predivide_factor != 1.0 and op != Average:
            raise SluiceError("gradient_predivide_factor needs op=Average")
        require()
        self.compression, self.op = compression, op
        # Horovod's predivide: scale by 1/f before the sum and by f/size after (f = 1: a plain average)
        self.prescale, self.postscale = 1.0 / gradient_predivide_factor, gradient_predivide_factor

    def __call__(self, grads: Sequence[Any], names: Sequence[str]) -> list[Any]:
        present = [i for i, g in enumerate(grads) if g is not None]
        if not present:
            return list(grads)
        pairs = [self.compression.compress(tf.convert_to_tensor(grads[i])) for i in present]
        tensors = [t for t, _ in pairs]
        wires = [wire_dtype(t.dtype) for t in tensors]
        chosen = [names[i] for i in present]

        def reduce(arrays: list[np.ndarray]) -> list[np.ndarray]:
            reducer, busy = reducer_for(tuple(Spec(n, tuple(a.shape), w)
                                              for n, a, w in zip(chosen, arrays, wires, strict=True)))
            with busy:  # its buffers and group names serve one step at a time
                return reducer.reduce(arrays, self.op == Average, self.prescale, self.postscale)

        out = run_numpy(reduce, tensors, [t.dtype for t in tensors], [t.shape for t in tensors], "gradient allreduce")
        result = list(grads)
        for index, value, (_, context) in zip(present, out, pairs, strict=True):
            result[index] = self.compression.decompress(value, context)
        return result


class _DistributedTape:
    """Mixed in front of the tape's class (so isinstance(tape, tf.GradientTape) holds): gradient()
    returns the gradients averaged (or summed) over the workers."""

    _sluice_average: GradientAverager

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 unconnected_gradients: Any = tf.UnconnectedGradients.NONE) -> Any:
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)  # type: ignore[misc]
        flat = tf.nest.flatten(grads)
        reduced = self._sluice_average(flat, variable_names(tf.nest.flatten(sources)))
        return tf.nest.pack_sequence_as(grads, reduced)


def DistributedGradientTape(gradtape: Any, device_dense: str = "", device_sparse: str = "",
                            compression: type[Compressor] = Compression.none, sparse_as_dense: bool = False,
                            op: str = Average, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                            groups: Any = None) -> Any:
    """Horovod's DistributedGradientTape: `gradient()` averages the gradients over the workers.

    Gradients travel in balanced fused groups (collective.fusion_bytes), which take the place of
    Horovod's num_groups and groups (accepted, not used); sparse gradients are always made dense.
    """
    base: Any = gradtape.__class__
    cls: Any = type(base.__name__, (_DistributedTape, base), {})
    tape: Any = cls.__new__(cls)
    tape.__dict__.update(gradtape.__dict__)  # the same recording: the tape the `with` block filled
    tape._sluice_average = GradientAverager(compression, op, gradient_predivide_factor)
    return tape
