"""Sparse gradients (tf.IndexedSlices) in DistributedGradientTape, as Horovod's `sparse_as_dense` chooses.

With `sparse_as_dense=True` every gradient goes through the tape's averager, which makes sparse ones
dense (tf.convert_to_tensor) and fuses them with the rest. With False (Horovod's default) the dense
gradients go through the averager, and then the sparse ones through allreduce's path for
tf.IndexedSlices (collectives.py): one grouped allgather of their values (divided by the size for
Average) and one of their indices, so a large embedding's gradient moves only its touched rows.
A gradient_predivide_factor other than 1 then raises NotImplementedError, as in Horovod (no scale
factors on tf.IndexedSlices).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from sluice.worker.tensorflow.calls import not_converted
from sluice.worker.tensorflow.collectives import grouped_allreduce


class SparseGradients:
    """The tape's reduction, with tf.IndexedSlices gathered unless `sparse_as_dense`. `average` is the
    tape's GradientAverager (gradients.py): called with (gradients, names), it has `op`, `prescale`
    and `postscale`."""

    def __init__(self, average: Any, sparse_as_dense: bool, process_set: Any) -> None:
        self.average, self.sparse_as_dense, self.process_set = average, sparse_as_dense, process_set

    @not_converted  # AutoGraph need not convert the averager either (seconds per trace)
    def __call__(self, grads: Sequence[Any], names: Sequence[str]) -> list[Any]:
        sparse = [] if self.sparse_as_dense else [i for i, g in enumerate(grads) if isinstance(g, tf.IndexedSlices)]
        if not sparse or self.average.on is None:  # (outside the process set: the gradients stay as they are)
            return list(self.average(grads, names))
        result: list[Any] = self.average([None if i in sparse else g for i, g in enumerate(grads)], names)
        gathered = grouped_allreduce([grads[i] for i in sparse], op=self.average.op,
                                     prescale_factor=self.average.prescale, postscale_factor=self.average.postscale,
                                     process_set=self.process_set)
        for index, value in zip(sparse, gathered, strict=True):
            result[index] = value
        return result
