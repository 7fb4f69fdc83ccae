"""Horovod's gradient-reduction argument checks and worker-local gradients, shared by the TF tapes and optimizer.

`check_reduction_args` raises Horovod's ValueError (here InvalidCallError, a ValueError) for what
horovod.tensorflow's DistributedGradientTape and DistributedOptimizer refuse, and for what Sluice's
gradient reduction cannot do (ops other than Average and Sum). `LocalSources` is Horovod's
register_local_source / register_local_var: the gradients of registered sources are not reduced; each
is kept as this worker computed it, divided by the process set's size when `scale_local_gradients`
(Horovod's pull 3695: the reduced gradients are averages, so the local ones match their scale).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from sluice.errors import InvalidCallError
from sluice.worker.tensorflow.collectives import Average, Sum
from sluice.worker.tensorflow.state import member_engine, process_set_ranks

#: reduce(grads, indices) -> the grads (of the sources at those indices) reduced over the workers, in order
Reduce = Callable[[list[Any], list[int]], list[Any]]
Pair = tuple[Any, Any]


def check_reduction_args(op: str, gradient_predivide_factor: float, num_groups: int, groups: Any,
                         process_set: Any) -> Any:
    """Horovod's checks of DistributedGradientTape's and DistributedOptimizer's arguments; returns the
    groups Horovod would use (`num_groups` stands in for them, with its DeprecationWarning). Sluice's
    balanced fusion (collective.fusion_bytes) takes the place of the groups: they are checked, not used."""
    if gradient_predivide_factor != 1.0 and op != Average:
        raise InvalidCallError("gradient_predivide_factor not supported with op != Average")
    if op not in (Average, Sum):
        raise InvalidCallError(f"gradients are reduced by op=Average or op=Sum in Sluice, got {op!r}")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
                      DeprecationWarning, stacklevel=3)
        if groups is None:
            groups = num_groups
    if groups is not None and not (isinstance(groups, list) or groups > 0):
        raise InvalidCallError("groups should be a non-negative integer or a list of list of tf.Variable.")
    member_engine(process_set)  # a set that is not registered fails here, at construction
    return groups


def scale_values(grad: Any, factor: float) -> Any:
    """`grad` times `factor` (tf.IndexedSlices: their values)."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * tf.cast(factor, grad.values.dtype), grad.indices, grad.dense_shape)
    grad = tf.convert_to_tensor(grad)
    return grad * tf.cast(factor, grad.dtype)


class LocalSources:
    """The sources (variables) registered as worker-local; each object is kept, so its id stays its own."""

    def __init__(self, process_set: Any, scale_local_gradients: bool) -> None:
        self.process_set, self.scale = process_set, scale_local_gradients
        self._sources: dict[int, Any] = {}

    def register(self, source: Any) -> None:
        self._sources[id(source)] = source

    def __contains__(self, source: Any) -> bool:
        return id(source) in self._sources

    def __len__(self) -> int:
        return len(self._sources)

    def reduce(self, reduce: Reduce, grads: Sequence[Any], sources: Sequence[Any]) -> list[Any]:
        """`grads` (one per source) with those of the non-local sources reduced by `reduce` and those of
        the local ones kept (divided by the set's size where scale_local_gradients)."""
        if len(grads) != len(sources):
            raise InvalidCallError(f"{len(grads)} gradients for {len(sources)} sources")
        shared = [i for i, source in enumerate(sources) if source not in self]
        result = list(grads)
        if len(shared) == len(sources):
            return reduce(result, shared)
        reduced = reduce([grads[i] for i in shared], shared) if shared else []
        for index, grad in zip(shared, reduced, strict=True):
            result[index] = grad
        if self.scale:
            size = len(process_set_ranks(self.process_set))
            for index, grad in enumerate(grads):
                if grad is not None and sources[index] in self:
                    result[index] = scale_values(grad, 1.0 / size)
        return result

    def split(self, sources: Sequence[Any], grads: Sequence[Any]) -> tuple[list[Pair], list[Pair]]:
        """(source, gradient) pairs: the local sources', then the others'."""
        local = [(s, g) for s, g in zip(sources, grads, strict=True) if s in self]
        return local, [(s, g) for s, g in zip(sources, grads, strict=True) if s not in self]
