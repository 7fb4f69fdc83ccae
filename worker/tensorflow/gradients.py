"""Averaging gradients for TF: the shared step of the distributed tapes and of both DistributedOptimizers (TF1, Keras).

`GradientAverager` reduces one list of gradients (None stays None; tf.IndexedSlices are made dense,
as Horovod's sparse_as_dense) through the FusedReducer of that list of names, shapes and dtypes,
made the first time it is seen on this process's connection and kept (a custom loop wraps a new
tape every step); inside a tf.function each fused group leaves as soon as backward has made it
(overlap.py). A job re-formed in place gives the process a new connection (elastic.py): the averager
then takes the new engine, and a traced step the new reducer, looked up at each run. Compression
casts before and after.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np
import tensorflow as tf

from sluice.errors import InvalidCallError, SluiceError
from sluice.worker.collective.engine import CollectiveEngine
from sluice.worker.collective.process_set import global_process_set
from sluice.worker.tensorflow.bridge import run_numpy, wire_dtype
from sluice.worker.tensorflow.calls import collective_name
from sluice.worker.tensorflow.collectives import Average, Sum
from sluice.worker.tensorflow.compression import Compression, Compressor
from sluice.worker.tensorflow.fused import FusedReducer, Spec
from sluice.worker.tensorflow.local import LocalSources, check_reduction_args
from sluice.worker.tensorflow.overlap import specs_of, traceable, traced_reduce
from sluice.worker.tensorflow.sparse import SparseGradients
from sluice.worker.tensorflow.state import NAMES, STATE, member_engine, require


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
_REDUCERS: dict[tuple[tuple[Spec, ...], str], tuple[FusedReducer, threading.Lock]] = {}
_REDUCERS_LOCK = threading.Lock()
#: the label of each list of gradient names, drawn once per node: ranks whose shapes disagree under the
#: same names then meet under the same collective names and fail there together, and stay in step
_LABELS: dict[tuple[tuple[str, ...], str], tuple[Any, str]] = {}


def reducer_for(specs: tuple[Spec, ...], on: CollectiveEngine) -> tuple[FusedReducer, threading.Lock]:
    """The reducer of this list of gradients over `on`'s workers (a process set's, or every worker), made
    (on every rank of it alike) the first time it is seen. A set's names start with its id and are numbered
    in its own sequence: only its workers make them, and the servers tell sets apart by name."""
    node = require()
    with _REDUCERS_LOCK:
        entry = _REDUCERS.get((specs, on.label))
        if entry is None or entry[0].node is not node:  # new, or made before a shutdown() and init()
            names = (tuple(s.name for s in specs), on.label)
            known = _LABELS.get(names)
            label = known[1] if known is not None and known[0] is node else (
                f"set{on.set_id}.{collective_name(None, 'grads', on)}" if on.set_id else f"tf.grads{next(NAMES)}")
            _LABELS[names] = (node, label)
            entry = _REDUCERS[(specs, on.label)] = (FusedReducer(node, STATE.settings, specs, label, on),
                                                    threading.Lock())
        return entry


class GradientAverager:
    """Sum or Average gradients over the workers, each list of variables through its own fused buffers."""

    def __init__(self, compression: type[Compressor] = Compression.none, op: str = Average,
                 gradient_predivide_factor: float = 1.0, process_set: Any = None) -> None:
        if op not in (Average, Sum):
            raise SluiceError(f"op must be Average or Sum, got {op!r}")
        if gradient_predivide_factor != 1.0 and op != Average:
            raise SluiceError("gradient_predivide_factor needs op=Average")
        self.process_set = process_set
        self._bound = (require(), member_engine(process_set))
        self.compression, self.op = compression, op
        # Horovod's predivide: scale by 1/f before the sum and by f/size after (f = 1: a plain average)
        self.prescale, self.postscale = 1.0 / gradient_predivide_factor, gradient_predivide_factor

    @property
    def on(self) -> CollectiveEngine | None:
        """The process set's engine on this process's connection now (a job re-formed in place made a new
        one: elastic.py); None where this worker is not in the set (its gradients stay its own)."""
        node = require()
        if self._bound[0] is not node:
            self._bound = (node, member_engine(self.process_set))
        return self._bound[1]

    def _reducer_now(self, specs: tuple[Spec, ...]) -> FusedReducer:
        """The reducer of `specs` on the connection now: what a traced step looks up at each run."""
        on = self.on
        if on is None:
            raise SluiceError("this worker left the process set its gradients were traced for: trace the step again")
        return reducer_for(specs, on)[0]

    def __call__(self, grads: Sequence[Any], names: Sequence[str]) -> list[Any]:
        present = [i for i, g in enumerate(grads) if g is not None]
        on = self.on
        if not present or on is None:
            return list(grads)
        pairs = [self.compression.compress(tf.convert_to_tensor(grads[i])) for i in present]
        tensors = [t for t, _ in pairs]
        wires = [wire_dtype(t.dtype) for t in tensors]
        chosen = [names[i] for i in present]

        def reduce(arrays: list[np.ndarray]) -> list[np.ndarray]:
            reducer, busy = reducer_for(tuple(Spec(n, tuple(a.shape), w)
                                              for n, a, w in zip(chosen, arrays, wires, strict=True)), on)
            with busy:  # its buffers and group names serve one step at a time
                return reducer.reduce(arrays, self.op == Average, self.prescale, self.postscale)

        if traceable(tensors):  # traced: each fused group leaves as soon as backward has made it (overlap.py)
            specs = specs_of(tensors, chosen, wires)
            out = traced_reduce(partial(self._reducer_now, specs), tensors, self.op == Average, self.prescale,
                                self.postscale)
        else:
            out = run_numpy(reduce, tensors, [t.dtype for t in tensors], [t.shape for t in tensors],
                            "gradient allreduce")
        result = list(grads)
        for index, value, (_, context) in zip(present, out, pairs, strict=True):
            result[index] = self.compression.decompress(value, context)
        return result


class _DistributedTape:
    """Mixed in front of the tape's class (so isinstance(tape, tf.GradientTape) holds): gradient()
    returns the gradients averaged (or summed) over the workers."""

    _sluice_average: GradientAverager
    _sluice_local: LocalSources

    def register_local_source(self, source: Any) -> None:
        """Horovod's: the gradient of `source` is not reduced (it is divided by the set's size where
        scale_local_gradients), e.g. a model-parallel layer's own weights."""
        self._sluice_local.register(source)

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 unconnected_gradients: Any = tf.UnconnectedGradients.NONE) -> Any:
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)  # type: ignore[misc]
        flat, flat_sources = tf.nest.flatten(grads), tf.nest.flatten(sources)
        names = variable_names(flat_sources)
        reduced = self._sluice_local.reduce(
            lambda gs, indices: self._sluice_average(gs, [names[i] for i in indices]), flat, flat_sources)
        return tf.nest.pack_sequence_as(grads, reduced)

    def get_local_and_global_gradients(self, target: Any, sources: Any, output_gradients: Any = None
                                       ) -> tuple[list[tuple[Any, Any]], list[tuple[Any, Any]]]:
        """Horovod's: gradient()'s (source, gradient) pairs, those of the local sources, then the others."""
        flat = tf.nest.flatten(sources)
        return self._sluice_local.split(flat, tf.nest.flatten(self.gradient(target, sources, output_gradients)))


def DistributedGradientTape(gradtape: Any, device_dense: str = "", device_sparse: str = "",
                            compression: type[Compressor] = Compression.none, sparse_as_dense: bool = False,
                            op: str = Average, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                            groups: Any = None, process_set: Any = global_process_set,
                            scale_local_gradients: bool = True) -> Any:
    """Horovod's DistributedGradientTape: `gradient()` averages the gradients over the workers, but those
    of sources given to `register_local_source` (see local.py).

    Gradients travel in balanced fused groups (collective.fusion_bytes), which take the place of
    Horovod's num_groups and groups (checked as Horovod does, not used); sparse gradients are gathered
    (tf.IndexedSlices, as Horovod) or, with sparse_as_dense, made dense and fused (sparse.py).
    """
    check_reduction_args(op, gradient_predivide_factor, num_groups, groups, process_set)
    base: Any = gradtape.__class__
    cls: Any = type(base.__name__, (_DistributedTape, base), {})
    tape: Any = cls.__new__(cls)
    tape.__dict__.update(gradtape.__dict__)  # the same recording: the tape the `with` block filled
    tape._sluice_average = SparseGradients(GradientAverager(compression, op, gradient_predivide_factor, process_set),
                                           sparse_as_dense, process_set)  # IndexedSlices: sparse.py
    tape._sluice_local = LocalSources(process_set, scale_local_gradients)
    return tape


def PartialDistributedGradientTape(gradtape: Any, device_dense: str = "", device_sparse: str = "",
                                   compression: type[Compressor] = Compression.none, sparse_as_dense: bool = False,
                                   op: str = Average, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                                   groups: Any = None, process_set: Any = global_process_set,
                                   local_layers: Any = None, scale_local_gradients: bool = True) -> Any:
    """Horovod's: a DistributedGradientTape whose `local_layers` (a Keras layer or a list of them) keep
    their trainable weights' gradients local (registered as local sources)."""
    if local_layers is None:
        local_layers = []
    elif isinstance(local_layers, tf.keras.layers.Layer):
        local_layers = [local_layers]
    elif not all(isinstance(layer, tf.keras.layers.Layer) for layer in local_layers):
        raise InvalidCallError("All local layers must be of tf.keras.layers.Layer type.")
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
                                   gradient_predivide_factor, num_groups, groups, process_set, scale_local_gradients)
    for layer in local_layers:
        for variable in layer.trainable_weights:
            tape.register_local_source(variable)
    return tape
