"""Horovod's allreduce, allgather and broadcast for TF tensors, with their gradients, on Sluice's collective engine.

Semantics follow horovod.tensorflow: `op=Average` (the default), `Sum`, `Min`, `Max`, `Product` or
`Adasum` (adasum.py), with `prescale_factor` and `postscale_factor`; tf.IndexedSlices are gathered
(values and indices of every rank, the values divided by the size for Average), as Horovod does.
Names are optional (unnamed ones get the same sequence of names on every rank: in a tf.function,
once, when it is traced). Each call works eagerly and inside a tf.function as one tf.py_function
node, which waits for the result; not under XLA (`jit_compile=True`), which cannot call Python. A
tf.function runs its py_function nodes (stateful ops) in program order, through its automatic
control dependencies, so every rank submits its collectives in the same order.

Gradients (tf.custom_gradient) are Horovod's: allreduce's is the allreduce of the output's gradient
with the same op and factors (for Min and Max only the ranks that hold the extreme receive it, for
Product each rank y / x, as sluice.torch's; Horovod gives neither); allgather's is the average of the
output's gradient, narrowed to this rank's rows; broadcast's is that average on the root, zero
elsewhere. A gradient's collectives are named after the call (`<name>.grad`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import partial
from typing import Any

import numpy as np
import tensorflow as tf

from sluice.errors import InvalidCallError
from sluice.worker.collective.engine import CollectiveEngine
from sluice.worker.collective.process_set import barrier_set, global_process_set
from sluice.worker.collective.reduce import scaled
from sluice.worker.tensorflow.adasum import adasum_arrays, check_adasum
from sluice.worker.tensorflow.bridge import run_numpy, wire_dtype
from sluice.worker.tensorflow.calls import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    checking,
    collective_name,
    custom_gradient,
    in_step,
    not_converted,
    resolve_op,
    upstream,
)
from sluice.worker.tensorflow.compression import Compression, Compressor
from sluice.worker.tensorflow.state import engine, require

__all__ = ["Adasum", "Average", "Max", "Min", "Product", "Sum", "allgather", "allreduce", "barrier", "broadcast",
           "broadcast_variables", "check_root", "grouped_allgather", "grouped_allreduce", "reduce_arrays"]


# ---------------------------------------------------------------------------- allreduce
def reduce_arrays(on: CollectiveEngine, name: str, arrays: Sequence[np.ndarray], wires: Sequence[str], op: str,
                  prescale: float, postscale: float) -> list[np.ndarray]:
    """Each array reduced over `on`'s ranks, in fresh arrays: one engine request per dtype (the first
    under `name`). Horovod's average: the sum, then one multiplication by postscale / size (integers
    truncated). Adasum: adasum.py."""
    if op == Adasum:
        return adasum_arrays(on, name, arrays, wires, prescale, postscale)
    copies = [scaled(a, prescale, w) if prescale != 1.0 else np.array(a) for a, w in zip(arrays, wires, strict=True)]
    by_dtype: dict[str, list[int]] = {}
    for index, wire in enumerate(wires):
        by_dtype.setdefault(wire, []).append(index)
    groups = sorted(by_dtype.items())
    names = [name] + [f"{name}.{wire}" for wire, _ in groups[1:]]
    in_step([partial(on.allreduce, n, [copies[i] for i in indices], wire, op, scale=(prescale, postscale))
             for n, (wire, indices) in zip(names, groups, strict=True)])
    after = postscale / on.size if op == Average else postscale
    if after != 1.0:
        copies = [scaled(c, after, w, c) for c, w in zip(copies, wires, strict=True)]
    return copies


def _reduce_dense(label: str, tensors: Sequence[Any], wires: Sequence[str], op: str, prescale: float,
                  postscale: float, process_set: Any) -> list[Any]:
    """The reduction of checked tensors (in their wire dtypes): one py_function, and its gradient."""
    @custom_gradient
    def reduce(*inputs: Any) -> Any:
        out = run_numpy(lambda arrays: reduce_arrays(engine(process_set), label, arrays, wires, op, prescale,
                                                     postscale),
                        list(inputs), [t.dtype for t in inputs], [t.shape for t in inputs], "allreduce")

        def grad(*dys: Any) -> list[Any]:
            grads = upstream(dys, out)
            if op in (Average, Sum, Adasum):  # Horovod's: the same op and factors
                return _reduce_dense(f"{label}.grad", grads, wires, op, prescale, postscale, process_set)
            summed = _reduce_dense(f"{label}.grad", grads, wires, Sum, 1.0, 1.0, process_set)
            if op in (Min, Max):
                return [g * tf.cast(tf.equal(x, y), g.dtype) for g, x, y in zip(summed, inputs, out, strict=True)]
            return [g * y / x for g, x, y in zip(summed, inputs, out, strict=True)]  # Product: prod / x

        return out, grad

    return list(reduce(*tensors))


@not_converted
def grouped_allreduce(tensors: Sequence[Any], average: bool | None = None, device_dense: str = "",
                      device_sparse: str = "", compression: type[Compressor] = Compression.none, op: str | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: Any = global_process_set, ignore_name_scope: bool = False,
                      name: str | None = None) -> list[Any]:
    """Every tensor reduced over the ranks in one request per dtype (decided when all are ready on every
    rank); tf.IndexedSlices among them are gathered instead (Sum or Average, no scale factors)."""
    if not tensors:
        return list(tensors)
    on = engine(process_set)
    label = collective_name(name, "allreduce", on)
    with checking(label, on):
        chosen = resolve_op(average, op)
        sparse = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
        dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
        if sparse:
            _check_sparse(chosen, prescale_factor, postscale_factor)
        if chosen == Adasum and getattr(process_set, "process_set_id", 0) != 0:
            raise NotImplementedError("Adasum does not support non-global process sets yet.")
        pairs = [compression.compress(tf.convert_to_tensor(tensors[i])) for i in dense]
        wires = [wire_dtype(t.dtype) for t, _ in pairs]
        if chosen == Adasum:
            check_adasum(wires)
    out: list[Any] = [None] * len(tensors)
    if dense:
        reduced = _reduce_dense(label, [t for t, _ in pairs], wires, chosen, prescale_factor, postscale_factor,
                                process_set)
        for index, value, (_, context) in zip(dense, reduced, pairs, strict=True):
            out[index] = compression.decompress(value, context)
    if sparse:
        gathered = _gather_slices(f"{label}.sparse" if dense else label, [tensors[i] for i in sparse], chosen,
                                  process_set)
        for index, value in zip(sparse, gathered, strict=True):
            out[index] = value
    return out


@not_converted
def allreduce(tensor: Any, average: bool | None = None, device_dense: str = "", device_sparse: str = "",
              compression: type[Compressor] = Compression.none, op: str | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, name: str | None = None, process_set: Any = global_process_set,
              ignore_name_scope: bool = False) -> Any:
    """The tensor reduced over the ranks. A tf.IndexedSlices (a sparse gradient) is gathered, as Horovod
    does: the values and indices of every rank, the values divided by the size for Average."""
    return grouped_allreduce([tensor], average, device_dense, device_sparse, compression, op, prescale_factor,
                             postscale_factor, process_set, ignore_name_scope, name)[0]


def _check_sparse(op: str, prescale: float, postscale: float) -> None:
    """Horovod's refusals for tf.IndexedSlices (NotImplementedError, as Horovod raises)."""
    if op == Adasum:
        check_adasum([], sparse=True)
    if op not in (Sum, Average):
        raise NotImplementedError("Only Sum and Average ops are supported with tf.IndexedSlices")
    if prescale != 1.0 or postscale != 1.0:
        raise NotImplementedError("Pre/postscale_factor are not supported with tf.IndexedSlices")


def _gather_slices(label: str, slices: Sequence[Any], op: str, process_set: Any) -> list[Any]:
    """Horovod's allreduce of tf.IndexedSlices: two grouped allgathers, values (divided by the size for
    Average) and indices; duplicate indices stay, to be summed where the slices are applied."""
    values = grouped_allgather([s.values for s in slices], name=label, process_set=process_set)
    indices = grouped_allgather([s.indices for s in slices], name=f"{label}.indices", process_set=process_set)
    size = engine(process_set).size
    return [tf.IndexedSlices(v / tf.cast(size, v.dtype) if op == Average else v, i, s.dense_shape)
            for v, i, s in zip(values, indices, slices, strict=True)]


# ---------------------------------------------------------------------------- allgather
@not_converted
def grouped_allgather(tensors: Sequence[Any], name: str | None = None, ignore_name_scope: bool = False,
                      process_set: Any = global_process_set) -> list[Any]:
    """Every rank's tensors, each concatenated along its first dimension (which may differ per rank)."""
    on = engine(process_set)
    label = collective_name(name, "allgather", on)
    with checking(label, on):
        if not isinstance(tensors, list | tuple) or not tensors:
            raise InvalidCallError("grouped_allgather needs a list of at least one tensor")
        checked = [tf.convert_to_tensor(t) for t in tensors]
        if any(t.shape.rank == 0 for t in checked):
            raise InvalidCallError("allgather needs a tensor of at least one dimension")
        wires = [wire_dtype(t.dtype) for t in checked]
    return _gather(label, checked, wires, process_set)


@not_converted
def allgather(tensor: Any, name: str | None = None, ignore_name_scope: bool = False,
              process_set: Any = global_process_set) -> Any:
    """Every rank's tensor concatenated along the first dimension, which may differ per rank."""
    return grouped_allgather([tensor], name, ignore_name_scope, process_set)[0]


def _gather(label: str, tensors: Sequence[Any], wires: Sequence[str], process_set: Any) -> list[Any]:
    @custom_gradient
    def gather(*inputs: Any) -> Any:
        def exchange(arrays: list[np.ndarray]) -> list[np.ndarray]:
            on = engine(process_set)
            names = [label] + [f"{label}.{i}" for i in range(1, len(arrays))]
            # the tensor's own buffer is sent (read only, kept alive by the view); the result is a new array
            return [np.asarray(r) for r in in_step([partial(on.allgather, n, np.ascontiguousarray(a), w)
                                                    for n, a, w in zip(names, arrays, wires, strict=True)])]

        shapes = [tf.TensorShape([None]).concatenate(t.shape[1:]) if t.shape.rank is not None else None
                  for t in inputs]
        out = run_numpy(exchange, list(inputs), [t.dtype for t in inputs], shapes, "allgather")

        def grad(*dys: Any) -> list[Any]:  # Horovod's: the average, this rank's rows of it
            on = engine(process_set)
            averaged = grouped_allreduce(upstream(dys, out), op=Average, name=f"{label}.grad",
                                         process_set=process_set)
            rows = tf.stack([tf.shape(x, out_type=tf.int64)[0] for x in inputs])
            every = allgather(tf.reshape(rows, [1, -1]), name=f"{label}.grad.rows", process_set=process_set)
            return [tf.split(g, every[:, i], num=on.size)[on.rank] for i, g in enumerate(averaged)]

        return out, grad

    return list(gather(*tensors))


# ---------------------------------------------------------------------------- broadcast
def _broadcast_arrays(name: str, arrays: Sequence[np.ndarray], wires: Sequence[str], root_rank: int,
                      process_set: Any) -> list[np.ndarray]:
    on = engine(process_set)
    copies = [np.array(a) for a in arrays]  # the engine writes the root's values into them
    names = [name] + [f"{name}.{i}" for i in range(1, len(copies))]
    in_step([partial(on.broadcast, n, c, root_rank, w) for n, c, w in zip(names, copies, wires, strict=True)])
    return copies


@not_converted
def broadcast(tensor: Any, root_rank: int, name: str | None = None, ignore_name_scope: bool = False,
              process_set: Any = global_process_set) -> Any:
    """`root_rank`'s tensor, on every rank."""
    on = engine(process_set)
    label = collective_name(name, "broadcast", on)
    with checking(label, on):
        tensor = tf.convert_to_tensor(tensor)
        wire = wire_dtype(tensor.dtype)
        check_root(root_rank)

    @custom_gradient
    def take(x: Any) -> Any:
        out = run_numpy(lambda arrays: _broadcast_arrays(label, arrays, [wire], root_rank, process_set), [x],
                        [x.dtype], [x.shape], "broadcast")[0]

        def grad(dy: Any) -> Any:  # Horovod's: the average on the root, zero elsewhere
            averaged = allreduce(upstream([dy], [out])[0], op=Average, name=f"{label}.grad", process_set=process_set)
            return averaged if require().rank == root_rank else averaged * 0

        return out, grad

    return take(tensor)


def check_root(root_rank: int) -> None:
    size = require().size
    if type(root_rank) is not int or not 0 <= root_rank < size:
        raise InvalidCallError(f"broadcast received invalid root rank {root_rank} (ranks 0..{size - 1})")


@not_converted
def broadcast_variables(variables: Iterable[Any], root_rank: int, process_set: Any = global_process_set,
                        inplace: bool = False) -> Any:
    """Assign `root_rank`'s values to every rank's variables (tf.Variable or keras.Variable), eagerly or
    inside a tf.function (whose automatic control dependencies run the assignments); in a TF1 graph, the
    op that runs them (as Horovod's: a group of the assignments). `inplace` is Horovod's memory option:
    the values are assigned in place either way."""
    variables = list(variables)
    if not variables:
        return None if tf.compat.v1.executing_eagerly_outside_functions() else tf.no_op()
    on = engine(process_set)
    label = collective_name(None, "broadcast_variables", on)
    with checking(label, on):
        values = [tf.convert_to_tensor(v) for v in variables]
        wires = [wire_dtype(v.dtype) for v in values]
        check_root(root_rank)
    out = run_numpy(lambda arrays: _broadcast_arrays(label, arrays, wires, root_rank, process_set), values,
                    [v.dtype for v in values], [v.shape for v in values], "broadcast_variables")
    assigns = [variable.assign(value) for variable, value in zip(variables, out, strict=True)]
    # a TF1 graph runs only the ops it is asked for: there, the op of every assignment (Horovod's group)
    return None if tf.compat.v1.executing_eagerly_outside_functions() else tf.group(*assigns)


@not_converted
def barrier(process_set: Any = global_process_set, name: str | None = None) -> None:
    """Wait (eagerly) until every rank (of `process_set`) has called barrier (the same number of times: unnamed ones
    are numbered); the set first, as sluice.torch's and Horovod's torch barrier."""
    on = engine(barrier_set(process_set))
    on.barrier(collective_name(name, "barrier", on)).wait()
