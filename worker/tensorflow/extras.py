"""Horovod's smaller TensorFlow names: build queries, rank and size as ops, join, broadcast_ and the TF1 broadcast.

The build queries say what Sluice uses: none of MPI, Gloo, NCCL, oneCCL, DDL or ROCm, and no CUDA
path of its own for TF tensors (they cross through host memory). `rank_op` and its kin are read when
the graph runs, as Horovod's stateful ops are (a tf.function traced once stays right). `join()`
returns, as a scalar int32 tensor, the rank that joined last.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import tensorflow as tf

from sluice.errors import InvalidCallError
from sluice.worker.tensorflow.collectives import broadcast_variables
from sluice.worker.tensorflow.state import current_placement, engine, require


def mpi_built() -> bool:
    return False


def mpi_enabled() -> bool:
    return False


def mpi_threads_supported() -> bool:
    raise InvalidCallError("Horovod MPI is not enabled; Sluice does not use MPI (sluice launch starts the workers)")


def gloo_built() -> bool:
    return False


def gloo_enabled() -> bool:
    return False


def nccl_built() -> int:
    return 0


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    """False: TF tensors cross through host memory; Sluice has no CUDA path of its own for them."""
    return False


def rocm_built() -> bool:
    return False


def _run_time(read: Callable[[], int]) -> Any:
    """An int32 scalar read now when eager, else when the graph runs."""
    if tf.executing_eagerly():
        return tf.constant(read(), tf.int32)
    return tf.py_function(lambda: np.int32(read()), [], tf.int32)


def rank_op(name: str | None = None) -> Any:
    return _run_time(lambda: require().rank)


#: Horovod's error code of a process set that is not registered (its set ops return it)
UNKNOWN_SET = -3


def _set_ranks(process_set_id: int) -> list[int] | None:
    sets = require().process_sets
    return sets.ranks.get(process_set_id) if sets is not None else None


def size_op(process_set_id: int = 0, name: str | None = None) -> Any:
    """The number of workers in the process set (0: the job), or UNKNOWN_SET, read at run time."""
    return _run_time(lambda: len(_set_ranks(process_set_id) or ()) or UNKNOWN_SET)


def process_set_included_op(process_set_id: int = 0, name: str | None = None) -> Any:
    """1 where this worker is in the process set, else 0 (UNKNOWN_SET for a set not registered), at run time."""
    def included() -> int:
        ranks = _set_ranks(process_set_id)
        return UNKNOWN_SET if ranks is None else int(require().rank in ranks)
    return _run_time(included)


def local_rank_op(name: str | None = None) -> Any:
    return _run_time(lambda: current_placement().local_rank)


def local_size_op(name: str | None = None) -> Any:
    return _run_time(lambda: current_placement().local_size)


def join() -> Any:
    """This rank has no more batches: take part in the others' allreduces with zeros until every rank has
    joined (eagerly); the rank that joined last, as an int32 scalar."""
    return tf.constant(int(engine().join().result()), tf.int32)


def broadcast_(variables: Iterable[Any], root_rank: int, name: str | None = None) -> list[Any]:
    """`root_rank`'s values assigned to `variables` in place; their values after it."""
    variables = list(variables)
    broadcast_variables(variables, root_rank)
    return [v.read_value() if hasattr(v, "read_value") else tf.convert_to_tensor(v) for v in variables]


def broadcast_global_variables(root_rank: int) -> Any:
    """Horovod's TF1 call: every global variable of the graph; eager execution has none (its error)."""
    if tf.executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution. Please use "
                           "`hvd.broadcast_variables(<model/optimizer variables>)` instead.")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)
