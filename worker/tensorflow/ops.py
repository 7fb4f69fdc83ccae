"""Horovod's alltoall, reducescatter and grouped_reducescatter for TF tensors, with Horovod's gradients.

alltoall sends row block i of a tensor (`splits[i]` rows; no splits: equal blocks) to rank i and
returns what every rank sent here, in rank order, with the received splits where splits were given
(as Horovod's TF op: the tensor alone otherwise). Invalid splits raise tf.errors.InvalidArgumentError
(eagerly and in a tf.function), as Horovod's op does; its gradient is the alltoall of the output's
gradient back by the received splits (rows past the splits' sum get zeros).

reducescatter reduces the tensor over the ranks (Sum or Average, with prescale and postscale
factors) and gives each rank its block of the first dimension, split as Horovod splits it
(worker/collective/blocks.py: the first `rows % size` ranks get one more row); here it is an
allreduce of the whole tensor of which each rank keeps its block. Its gradient is Horovod's: the
allgather of the output's gradient, times the size for Sum and times the scale factors.
grouped_reducescatter does the same for a list of tensors, in one request per dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from sluice.errors import InvalidCallError
from sluice.worker.collective.blocks import alltoall_splits, block, block_rows
from sluice.worker.collective.process_set import global_process_set
from sluice.worker.tensorflow.bridge import run_numpy, wire_dtype
from sluice.worker.tensorflow.calls import (
    Average,
    Sum,
    checking,
    collective_name,
    custom_gradient,
    not_converted,
    resolve_op,
    upstream,
)
from sluice.worker.tensorflow.collectives import grouped_allgather, reduce_arrays
from sluice.worker.tensorflow.compression import Compression, Compressor
from sluice.worker.tensorflow.state import engine


# ---------------------------------------------------------------------------- alltoall
@not_converted
def alltoall(tensor: Any, splits: Any = None, name: str | None = None, ignore_name_scope: bool = False,
             process_set: Any = global_process_set) -> Any:
    """Row block i of `tensor` to rank i; (what every rank sent here, the rows from each) where `splits`
    is given, else the tensor alone (Horovod's return)."""
    try:
        out, received = _alltoall(tensor, splits, name, process_set)
    except InvalidCallError as exc:  # Horovod's op fails with this code on invalid splits
        raise tf.errors.InvalidArgumentError(None, None, str(exc)) from exc
    return (out, received) if splits is not None else out


def _alltoall(tensor: Any, splits: Any, name: str | None, process_set: Any) -> tuple[Any, Any]:
    on = engine(process_set)
    label = collective_name(name, "alltoall", on)
    with checking(label, on):
        tensor = tf.convert_to_tensor(tensor)
        if tensor.shape.rank == 0:
            raise InvalidCallError("alltoall needs a tensor of at least one dimension")
        wire = wire_dtype(tensor.dtype)
        given = tf.constant([], tf.int32) if splits is None else tf.convert_to_tensor(splits)
        if given.shape.rank not in (1, None):
            raise InvalidCallError("alltoall expects a 1D splits tensor")
        if not given.dtype.is_integer:
            raise InvalidCallError("alltoall expects splits to contain 32-bit integer elements.")
        given = tf.cast(given, tf.int32)

    def exchange(arrays: list[np.ndarray]) -> list[np.ndarray]:
        array, counts = arrays
        here = engine(process_set)
        with checking(label, here):  # the splits' values are known now (in a tf.function: when it runs)
            rows = alltoall_splits(counts.tolist(), array.shape[0], here.size)
        out, received = here.alltoall(label, np.ascontiguousarray(array), rows, wire).result()
        return [np.asarray(out), np.asarray(received, np.int32)]

    @custom_gradient
    def send(x: Any) -> Any:
        shape = tf.TensorShape([None]).concatenate(x.shape[1:]) if x.shape.rank is not None else None
        out, received = run_numpy(exchange, [x, given], [x.dtype, tf.int32], [shape, [on.size]], "alltoall")

        def grad(dy: Any, *unused: Any) -> Any:  # Horovod's: the gradient sent back by the received splits
            back, _ = alltoall(upstream([dy], [out])[0], received, name=f"{label}.grad", process_set=process_set)
            missing = tf.shape(x)[0] - tf.shape(back)[0]  # rows past the splits' sum were not sent
            return tf.concat([back, tf.zeros(tf.concat([[missing], tf.shape(back)[1:]], 0), back.dtype)], 0)

        return (out, received), grad

    out, received = send(tensor)
    return out, received


# ---------------------------------------------------------------------------- reducescatter
@not_converted
def grouped_reducescatter(tensors: Sequence[Any], device_dense: str = "",
                          compression: type[Compressor] = Compression.none, op: str = Average,
                          process_set: Any = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0, name: str | None = None) -> list[Any]:
    """Each tensor reduced over the ranks (Sum or Average), this rank's block of its first dimension."""
    if not tensors:
        return list(tensors)
    return _scatter(list(tensors), compression, op, process_set, prescale_factor, postscale_factor, name)


@not_converted
def reducescatter(tensor: Any, device_dense: str = "", compression: type[Compressor] = Compression.none,
                  op: str = Average, name: str | None = None, process_set: Any = global_process_set,
                  ignore_name_scope: bool = False, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> Any:
    """The tensor reduced over the ranks (Sum or Average), this rank's block of its first dimension."""
    return _scatter([tensor], compression, op, process_set, prescale_factor, postscale_factor, name)[0]


def _scatter(tensors: list[Any], compression: type[Compressor], op: str, process_set: Any, prescale: float,
             postscale: float, name: str | None) -> list[Any]:
    on = engine(process_set)
    label = collective_name(name, "reducescatter", on)
    with checking(label, on):
        chosen = resolve_op(None, op)
        if chosen not in (Sum, Average):
            raise InvalidCallError("Reducescatter currently only supports AVERAGE and SUM.")
        pairs = [compression.compress(tf.convert_to_tensor(t)) for t in tensors]
        if any(t.shape.rank == 0 for t, _ in pairs):
            raise InvalidCallError("Reducescatter does not support scalar inputs")
        wires = [wire_dtype(t.dtype) for t, _ in pairs]

    def reduce(arrays: list[np.ndarray]) -> list[np.ndarray]:
        here = engine(process_set)
        reduced = reduce_arrays(here, label, arrays, wires, chosen, prescale, postscale)
        return [r[block(r.shape[0], here.rank, here.size)] for r in reduced]

    @custom_gradient
    def scatter(*inputs: Any) -> Any:
        shapes = [None if x.shape.rank is None else tf.TensorShape(
            [None if x.shape[0] is None else block_rows(x.shape[0], on.rank, on.size)]).concatenate(x.shape[1:])
                  for x in inputs]
        out = run_numpy(reduce, list(inputs), [x.dtype for x in inputs], shapes, "reducescatter")

        def grad(*dys: Any) -> list[Any]:  # Horovod's: the allgather, times the size for Sum and the factors
            factor = (on.size if chosen == Sum else 1) * prescale * postscale
            scaled = [g * tf.cast(factor, g.dtype) if factor != 1.0 else g for g in upstream(dys, out)]
            return grouped_allgather(scaled, name=f"{label}.grad", process_set=process_set)

        return out, grad

    reduced = scatter(*[t for t, _ in pairs])
    return [compression.decompress(r, context) for r, (_, context) in zip(reduced, pairs, strict=True)]
