"""Horovod's local gradient aggregation for TF1 optimizers: reduce once every `backward_passes_per_step` passes.

Graph mode only, as Horovod's LocalGradientAggregationHelper (DistributedOptimizer refuses it when
eager). Each gradient gets a local accumulator variable, and a counter counts the passes. Every
pass adds its gradients to the accumulators (cleared first where the counter is 0); the pass that
brings the counter to `backward_passes_per_step` reduces the accumulated gradients over the workers
(divided by the passes where `average_aggregated_gradients`) and sets the counter back to 0; the
others return their own gradients, which apply_gradients then does not apply: it applies only
where the counter is 0, and elsewhere steps the global step (and the optimizer's iterations, where
it has them) by itself, so they count every pass as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from sluice.errors import InvalidCallError

#: reduce(grads, variables) -> the grads reduced over the workers (local variables' kept), in order
ReduceVars = Callable[[list[Any], list[Any]], list[Any]]


class LocalAggregator:
    """Accumulates gradients over `passes` backward passes; reduces and applies once per `passes`."""

    def __init__(self, passes: int, reduce: ReduceVars, sparse_as_dense: bool, average_aggregated: bool,
                 name: str) -> None:
        if passes <= 0:
            raise InvalidCallError("backward_passes_per_step must be > 0")
        self.passes, self.reduce, self.sparse_as_dense = passes, reduce, sparse_as_dense
        self.average_aggregated, self.name = average_aggregated, name
        self.counter: Any = None
        self.sums: list[Any] = []

    def _dense(self, grad: Any) -> Any:
        if isinstance(grad, tf.IndexedSlices):
            if not self.sparse_as_dense:
                raise InvalidCallError("IndexedSlices are not supported when `backward_passes_per_step` > 1 "
                                       "and `sparse_as_dense` is False.")
            return tf.convert_to_tensor(grad)
        return grad

    def _local_variable(self, initial: Any, name: str) -> Any:
        return tf.compat.v1.Variable(initial, trainable=False, name=name,
                                     collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES])

    def _build(self, grads: Sequence[Any]) -> None:
        """The counter and one zeroed accumulator per gradient, once per graph (local variables)."""
        graph = tf.compat.v1.get_default_graph()
        if self.counter is not None and self.counter.graph is graph:
            return
        with tf.compat.v1.name_scope(f"{self.name}_aggregation"):
            self.counter = self._local_variable(tf.constant(0, tf.int32), "counter")
            self.sums = [self._local_variable(tf.zeros(g.shape, g.dtype), f"grad_{i}") for i, g in enumerate(grads)]

    def compute_gradients(self, grads: Sequence[Any], variables: Sequence[Any]) -> list[Any]:
        """This pass's gradients added to the accumulators; on every `passes`-th pass the accumulated
        gradients reduced over the workers, otherwise this pass's own (None stays None)."""
        present = [i for i, g in enumerate(grads) if g is not None]
        dense = [self._dense(grads[i]) for i in present]
        self._build(dense)

        def clear() -> Any:
            return tf.group(*[s.assign(tf.zeros_like(s)) for s in self.sums])

        cleared = tf.cond(tf.equal(self.counter, 0), clear, tf.no_op)
        with tf.control_dependencies([cleared]):
            added = tf.group(*[s.assign_add(g) for s, g in zip(self.sums, dense, strict=True)])
        with tf.control_dependencies([added]):
            counted = self.counter.assign_add(1)
        with tf.control_dependencies([counted]):
            def reduce_sums() -> list[Any]:
                summed = self.reduce([s.read_value() for s in self.sums], [variables[i] for i in present])
                with tf.control_dependencies([g for g in summed if g is not None]):
                    reset = self.counter.assign(0)
                with tf.control_dependencies([reset]):
                    divisor = float(self.passes) if self.average_aggregated else 1.0
                    return [g / tf.cast(divisor, g.dtype) for g in summed]

            def own() -> list[Any]:
                return [tf.identity(g) for g in dense]

            chosen = tf.cond(tf.equal(self.counter, self.passes), reduce_sums, own) if present else []
        result: list[Any] = [None] * len(grads)
        for index, grad in zip(present, tf.nest.flatten(chosen), strict=True):
            result[index] = grad
        return result

    def apply_gradients(self, apply: Callable[[], Any], optimizer: Any, grads_and_vars: Sequence[tuple[Any, Any]],
                        global_step: Any = None) -> Any:
        """`apply()` where this pass reduced (the counter is back at 0); elsewhere the global step and the
        optimizer's iterations (where it has them) are stepped instead, as an update would step them."""
        inputs = [g.values if isinstance(g, tf.IndexedSlices) else g for g, _ in grads_and_vars if g is not None]

        def skip() -> Any:
            iterations = getattr(optimizer, "iterations", None)
            return iterations.assign_add(1).op if iterations is not None else tf.no_op()

        def step_global() -> Any:
            if global_step is None:
                return tf.no_op()
            return global_step.assign_add(tf.constant(1, global_step.dtype.base_dtype), read_value=False)

        def applied() -> Any:
            return apply()

        with tf.control_dependencies(inputs):
            train = tf.cond(tf.equal(self.counter, 0), applied, skip)
        with tf.control_dependencies([train]):
            return tf.cond(tf.equal(self.counter, 0), tf.no_op, step_global)
