"""horovod.tensorflow's SyncBatchNormalization: Keras 3 batch normalization whose training statistics span every worker.

In training, each worker sums, per channel, its element count, its values and their squares (where
a mask is given, only the masked-in ones, as Keras does); one allreduce of the three sums gives the
whole global batch's mean and (biased) variance, so workers may hold batches of different sizes
(Horovod averages the workers' moments, which is the same only for equal batches). The allreduce
carries its gradient: the sum over the workers of the gradients of the three sums, so gradients flow
exactly as they would through one process running the concatenated batch. The moving statistics,
inference and everything else are keras.layers.BatchNormalization's. With one worker, the plain
layer's statistics.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from sluice.errors import InvalidCallError
from sluice.worker.tensorflow.collectives import Sum, grouped_allreduce
from sluice.worker.tensorflow.state import NAMES, engine


def summed(tensor: Any, name: str) -> Any:
    """`tensor` summed over the workers, with its gradient: the upstream gradients summed the same way."""

    @tf.custom_gradient  # type: ignore[untyped-decorator]
    def allreduce_sum(x: Any) -> Any:
        def grad(upstream: Any) -> Any:
            return grouped_allreduce([upstream], op=Sum, name=f"{name}.grad")[0]

        return grouped_allreduce([x], op=Sum, name=name)[0], grad

    return allreduce_sum(tensor)


class SyncBatchNormalization(keras.layers.BatchNormalization):  # type: ignore[misc]
    """Synchronous batch normalization: the statistics are the whole global batch's during training."""

    def __init__(self, fused: bool | None = False, **kwargs: Any) -> None:
        if fused in (True, None):
            raise InvalidCallError("SyncBatchNormalization does not support fused=True.")
        # Keras 3 names the layer sync_batch_normalization(_n) by itself, as Horovod's default name
        super().__init__(**kwargs)
        #: the collective's name, drawn in construction order (alike on every rank)
        self._sluice_name = f"tf.sync_batch_norm.{next(NAMES)}"

    def _moments(self, inputs: Any, mask: Any) -> tuple[Any, Any]:
        if engine().size == 1:
            return super()._moments(inputs, mask)  # type: ignore[no-any-return]
        axes = self._reduction_axes
        if mask is None:
            sums = tf.reduce_sum(inputs, axes)
            squares = tf.reduce_sum(tf.square(inputs), axes)
            count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(inputs), axes)), inputs.dtype)
            counts = tf.fill(tf.shape(sums), count)
        else:  # Keras's masked moments: the mask (one dimension less) spreads along the last axis
            weights = tf.cast(tf.broadcast_to(tf.expand_dims(tf.cast(mask, tf.bool), -1), tf.shape(inputs)),
                              inputs.dtype)
            sums = tf.reduce_sum(inputs * weights, axes)
            squares = tf.reduce_sum(tf.square(inputs) * weights, axes)
            counts = tf.reduce_sum(weights, axes)
        total_count, total, total_squares = tf.unstack(summed(tf.stack([counts, sums, squares]), self._sluice_name))
        # Keras's formulas: sum((x - mean)^2) / count, with its guard against an all-masked batch
        divisor = total_count + keras.backend.epsilon() if mask is not None else total_count
        mean = total / divisor
        deviations = total_squares - 2.0 * mean * total + tf.square(mean) * total_count
        return mean, tf.maximum(deviations / divisor, 0.0)
