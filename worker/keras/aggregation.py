"""Horovod's backward_passes_per_step for a Keras 3 optimizer: accumulate locally, exchange and apply every N-th pass.

As horovod.tensorflow's gradient aggregation (gradient_aggregation_eager.py eagerly, and the graph
helper inside a tf.function, such as model.fit's train step): every variable the optimizer was
built for gets a local accumulator (a plain tf.Variable, so neither the optimizer's saved variables
nor its broadcast change), and a counter counts the passes. Each pass adds its gradients to the
accumulators; the pass that brings the counter to N reduces the accumulated gradients over the
workers (divided by N where `average_aggregated_gradients`), sets the accumulators back to zeros
and the counter to 0, and applies the result; the other passes only step the optimizer's
`iterations`, which so counts every pass, as Horovod's. Setting the sums to zeros (not subtracting)
means a non-finite gradient spoils only the update of its own N passes: the next N start clean.
Sparse gradients (tf.IndexedSlices) are made dense with `sparse_as_dense`, and refused otherwise
with Horovod's ValueError.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from sluice.errors import InvalidCallError

#: reduce(grads) -> the grads (None stays None) reduced over the workers, in order
Reduce = Callable[[list[Any]], list[Any]]


class Aggregation:
    """The accumulators and pass counter of one DistributedOptimizer with backward_passes_per_step > 1."""

    def __init__(self, passes: int, average_aggregated: bool, sparse_as_dense: bool) -> None:
        if not isinstance(passes, int) or passes <= 0:
            raise InvalidCallError("backward_passes_per_step must be > 0")
        self.passes, self.average_aggregated, self.sparse_as_dense = passes, average_aggregated, sparse_as_dense
        self.counter: Any = None
        self.sums: list[Any] = []

    def build(self, variables: Sequence[Any]) -> None:
        """One zeroed accumulator per variable (the optimizer's order) and the counter; once."""
        if self.counter is not None:
            return
        with tf.init_scope():  # made outside any tf.function being traced, as the optimizer's own
            self.counter = tf.Variable(0, dtype=tf.int64, trainable=False, name="aggregation_counter")
            self.sums = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False, name=f"aggregated_{i}")
                         for i, v in enumerate(variables)]

    def _dense(self, grad: Any, into: Any) -> Any:
        if isinstance(grad, tf.IndexedSlices):
            if not self.sparse_as_dense:
                raise InvalidCallError("IndexedSlices are not supported when `backward_passes_per_step` > 1 "
                                       "and `sparse_as_dense` is False.")
            grad = tf.convert_to_tensor(grad)
        return tf.cast(grad, into.dtype)

    def step(self, grads: Sequence[Any], slots: Sequence[int], reduce: Reduce, apply: Callable[[list[Any]], Any],
             skip: Callable[[], Any]) -> None:
        """One pass: `grads` (None: no gradient) go into the accumulators at `slots`; on the N-th pass
        `apply(reduced)` runs, on the others `skip()` (which steps the iterations)."""
        present = [k for k, g in enumerate(grads) if g is not None]
        for k in present:
            self.sums[slots[k]].assign_add(self._dense(grads[k], self.sums[slots[k]]))
        self.counter.assign_add(1)

        def exchange() -> None:
            summed = [self.sums[slots[k]].read_value() if grads[k] is not None else None for k in range(len(grads))]
            reduced = reduce(summed)
            if self.average_aggregated:
                reduced = [None if g is None else g / tf.cast(self.passes, g.dtype) for g in reduced]
            with tf.control_dependencies([g for g in reduced if g is not None]):  # read before they are cleared
                for k in present:
                    self.sums[slots[k]].assign(tf.zeros_like(self.sums[slots[k]]))
                self.counter.assign(0)
            apply(reduced)

        def skipped() -> None:
            skip()

        if tf.executing_eagerly():
            exchange() if int(self.counter.numpy()) == self.passes else skipped()
        else:
            tf.cond(tf.equal(self.counter, self.passes), exchange, skipped)
