"""Horovod's collective API for TF tensors, served by Sluice's collective engine (allreduce among workers).

Semantics follow horovod.tensorflow: `op=Average` (the default) or `Sum`, with `prescale_factor` and
`postscale_factor`; names optional (unnamed ones get the same sequence of names on every rank: in a
tf.function, once, when it is traced). Each call works eagerly and inside a tf.function (one
tf.py_function node, which waits for the result); not under XLA (`jit_compile=True`), which cannot
call Python. A tf.function runs its py_function nodes (stateful ops) in program order, through its
automatic control dependencies, so every rank submits its collectives in the same order.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from sluice.errors import InvalidCallError
from sluice.worker.collective.engine import CollectiveEngine
from sluice.worker.collective.reduce import scaled
from sluice.worker.collective.refusal import refusing
from sluice.worker.tensorflow.bridge import run_numpy, wire_dtype
from sluice.worker.tensorflow.compression import Compression, Compressor
from sluice.worker.tensorflow.state import NAMES, STATE, engine, require

#: Horovod's reduction ops (horovod.tensorflow.Average, Sum, Min, Max, Product)
Average, Sum, Min, Max, Product = "average", "sum", "min", "max", "product"


def resolve_op(average: bool | None, op: str | None) -> str:
    if average is not None and op is not None:
        raise InvalidCallError("The op parameter supersedes average. Please provide only one of them.")
    if op is None:
        return Sum if average is False else Average
    if op not in (Average, Sum, Min, Max, Product):
        raise InvalidCallError(f"op must be Average, Sum, Min, Max or Product, got {op!r}")
    return op


def collective_name(name: str | None, kind: str) -> str:
    """The engine's name of a call, drawn before its checks: unnamed ones are numbered alike on every rank."""
    return name if name is not None else f"tf.{kind}.noname.{next(NAMES)}"


def checking(name: str) -> Any:
    """Run a call's checks: where they fail here, the call fails on every rank (worker/collective/refusal.py)."""
    return refusing(name, _running_engine)


def _running_engine() -> CollectiveEngine | None:
    return STATE.node.collectives if STATE.node is not None else None


# ---------------------------------------------------------------------------- allreduce
def _reduce_arrays(name: str, arrays: Sequence[np.ndarray], wires: Sequence[str], op: str, prescale: float,
                   postscale: float) -> list[np.ndarray]:
    """Each array reduced over the ranks, in fresh arrays: one engine request per dtype. Horovod's
    average: the sum, then one multiplication by postscale / size (integers truncated)."""
    copies = [scaled(a, prescale, w) if prescale != 1.0 else np.array(a) for a, w in zip(arrays, wires, strict=True)]
    by_dtype: dict[str, list[int]] = {}
    for index, wire in enumerate(wires):
        by_dtype.setdefault(wire, []).append(index)
    handles = [engine().allreduce(name if len(by_dtype) == 1 else f"{name}.{wire}", [copies[i] for i in indices],
                                  wire, op, scale=(prescale, postscale))
               for wire, indices in sorted(by_dtype.items())]
    for handle in handles:
        handle.wait()
    after = postscale / require().size if op == Average else postscale
    if after != 1.0:
        copies = [scaled(c, after, w, c) for c, w in zip(copies, wires, strict=True)]
    return copies


def grouped_allreduce(tensors: Sequence[Any], average: bool | None = None, device_dense: str = "",
                      device_sparse: str = "", compression: type[Compressor] = Compression.none, op: str | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      name: str | None = None) -> list[Any]:
    """Every tensor reduced over the ranks in one request (decided when all are ready on every rank)."""
    label = collective_name(name, "allreduce")
    with checking(label):
        if not tensors:
            raise InvalidCallError("grouped_allreduce needs at least one tensor")
        chosen = resolve_op(average, op)
        pairs = [compression.compress(tf.convert_to_tensor(t)) for t in tensors]
        wire = [p[0] for p in pairs]
        wires = [wire_dtype(t.dtype) for t in wire]
    out = run_numpy(lambda arrays: _reduce_arrays(label, arrays, wires, chosen, prescale_factor, postscale_factor),
                    wire, [t.dtype for t in wire], [t.shape for t in wire], "allreduce")
    return [compression.decompress(o, context) for o, (_, context) in zip(out, pairs, strict=True)]


def allreduce(tensor: Any, average: bool | None = None, device_dense: str = "", device_sparse: str = "",
              compression: type[Compressor] = Compression.none, op: str | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, name: str | None = None) -> Any:
    """The tensor reduced over the ranks. tf.IndexedSlices (sparse gradients) are gathered, as Horovod
    does: the values and indices of every rank, the values divided by the ranks for Average."""
    if isinstance(tensor, tf.IndexedSlices):
        label = collective_name(name, "allreduce")
        values = allgather(tensor.values * prescale_factor, name=f"{label}.values")
        indices = allgather(tensor.indices, name=f"{label}.indices")
        scale = postscale_factor / (size_now() if resolve_op(average, op) == Average else 1)
        return tf.IndexedSlices(values * tf.cast(scale, values.dtype), indices, tensor.dense_shape)
    return grouped_allreduce([tensor], average, device_dense, device_sparse, compression, op, prescale_factor,
                             postscale_factor, name)[0]


def size_now() -> int:
    return require().size


# ---------------------------------------------------------------------------- gather, broadcast, barrier
def allgather(tensor: Any, name: str | None = None) -> Any:
    """Every rank's tensor concatenated along the first dimension, which may differ per rank."""
    label = collective_name(name, "allgather")
    with checking(label):
        tensor = tf.convert_to_tensor(tensor)
        if tensor.shape.rank == 0:
            raise InvalidCallError("allgather needs a tensor of at least one dimension")
        wire = wire_dtype(tensor.dtype)

    def gather(arrays: list[np.ndarray]) -> list[np.ndarray]:
        # the tensor's own buffer is sent (read only, kept alive by the view); the result is a new array
        return [np.asarray(engine().allgather(label, np.ascontiguousarray(arrays[0]), wire).result())]

    shape = tf.TensorShape([None]).concatenate(tensor.shape[1:]) if tensor.shape.rank is not None else None
    return run_numpy(gather, [tensor], [tensor.dtype], [shape], "allgather")[0]


def _broadcast_arrays(name: str, arrays: Sequence[np.ndarray], wires: Sequence[str],
                      root_rank: int) -> list[np.ndarray]:
    copies = [np.array(a) for a in arrays]  # the engine writes the root's values into them
    handles = [engine().broadcast(f"{name}.{i}" if len(copies) > 1 else name, c, root_rank, w)
               for i, (c, w) in enumerate(zip(copies, wires, strict=True))]
    for handle in handles:
        handle.wait()
    return copies


def broadcast(tensor: Any, root_rank: int, name: str | None = None) -> Any:
    """`root_rank`'s tensor, on every rank."""
    label = collective_name(name, "broadcast")
    with checking(label):
        tensor = tf.convert_to_tensor(tensor)
        wire = wire_dtype(tensor.dtype)
        _check_root(root_rank)
    return run_numpy(lambda arrays: _broadcast_arrays(label, arrays, [wire], root_rank), [tensor], [tensor.dtype],
                     [tensor.shape], "broadcast")[0]


def _check_root(root_rank: int) -> None:
    size = require().size
    if type(root_rank) is not int or not 0 <= root_rank < size:
        raise InvalidCallError(f"broadcast received invalid root rank {root_rank} (ranks 0..{size - 1})")


def broadcast_variables(variables: Iterable[Any], root_rank: int) -> None:
    """Assign `root_rank`'s values to every rank's variables (tf.Variable or keras.Variable), eagerly or
    inside a tf.function (whose automatic control dependencies run the assignments)."""
    variables = list(variables)
    if not variables:
        return
    label = collective_name(None, "broadcast_variables")
    with checking(label):
        values = [tf.convert_to_tensor(v) for v in variables]
        wires = [wire_dtype(v.dtype) for v in values]
        _check_root(root_rank)
    out = run_numpy(lambda arrays: _broadcast_arrays(label, arrays, wires, root_rank), values,
                    [v.dtype for v in values], [v.shape for v in values], "broadcast_variables")
    for variable, value in zip(variables, out, strict=True):
        variable.assign(value)


def barrier(name: str | None = None) -> None:
    """Wait (eagerly) until every rank has called barrier (the same number of times: unnamed ones are numbered)."""
    engine().barrier(collective_name(name, "barrier")).wait()
