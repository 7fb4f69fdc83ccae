"""Horovod's Keras functions of values: allreduce, allgather, broadcast and reducescatter of a value, and load_model.

As horovod.keras and horovod.tensorflow.keras define them: each takes a tensor-compatible value (a
number, a numpy array, a list, a tensor), makes it a constant and runs sluice.tensorflow's
collective on it, eagerly, returning a tensor. `name` names that constant, as in Horovod, not the
collective: unnamed collectives are numbered alike on every rank. The two modules differ in
allreduce's `average` default: True in horovod.keras, so that `op=` needs `average=None` there
(ValueError otherwise, as Horovod raises), None in horovod.tensorflow.keras.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from sluice.errors import InvalidCallError
from sluice.worker.keras import optimizer
from sluice.worker.tensorflow import collectives, ops
from sluice.worker.tensorflow.collectives import Average
from sluice.worker.tensorflow.compression import Compression, Compressor


def allreduce(value: Any, name: str | None = None, average: bool | None = True, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, op: str | None = None,
              compression: type[Compressor] = Compression.none) -> Any:
    """horovod.keras's allreduce: the value reduced over the workers (averaged by default; `average=False`
    sums; `op=` with `average=None`)."""
    return collectives.allreduce(tf.constant(value), average=average, compression=compression, op=op,
                                 prescale_factor=prescale_factor, postscale_factor=postscale_factor)


def tf_keras_allreduce(value: Any, name: str | None = None, average: bool | None = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0, op: str | None = None,
                       compression: type[Compressor] = Compression.none) -> Any:
    """horovod.tensorflow.keras's allreduce: the value reduced over the workers by `op` (default Average;
    `average` is Horovod's deprecated flag)."""
    return allreduce(value, name, average, prescale_factor, postscale_factor, op, compression)


def allgather(value: Any, name: str | None = None) -> Any:
    """Every worker's value concatenated along the first dimension (which may differ per worker)."""
    return collectives.allgather(tf.constant(value))


def broadcast(value: Any, root_rank: int, name: str | None = None) -> Any:
    """`root_rank`'s value on every worker."""
    return collectives.broadcast(tf.constant(value), root_rank)


def reducescatter(value: Any, name: str | None = None, op: str = Average) -> Any:
    """The value reduced over the workers (Average or Sum), this worker's block of its first dimension."""
    return ops.reducescatter(tf.constant(value), op=op)


def load_model(filepath: str, custom_optimizers: list[type] | None = None,
               custom_objects: dict[str, Any] | None = None, compression: type[Compressor] = Compression.none,
               legacy_opts: bool = False) -> Any:
    """A saved Keras model whose optimizer is made a DistributedOptimizer keeping the saved optimizer state
    (slots, iterations, learning rate). `legacy_opts` asks for tf.keras's legacy optimizers, which Keras 3
    does not have: ValueError."""
    if legacy_opts:
        raise InvalidCallError("legacy_opts=True loads keras.optimizers.legacy optimizers, which Keras 3 does not "
                               "have: save and load the model with a Keras 3 optimizer")
    return optimizer.load_model(filepath, custom_optimizers, custom_objects, compression)
