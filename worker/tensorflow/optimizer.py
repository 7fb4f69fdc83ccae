"""horovod.tensorflow's DistributedOptimizer: a TF1 optimizer's gradients reduced over the workers; Keras's delegated.

For a `tf.compat.v1.train.Optimizer` (the TF1 API, which TF 2 keeps), the wrapper is itself such an
optimizer: `compute_gradients` asks the wrapped one for its gradients and reduces them through the
fused path DistributedGradientTape uses (gradients.py's GradientAverager: balanced fused groups,
priorities, routes), one tf.py_function in a graph or a tf.function; `apply_gradients`, `get_slot`,
`get_slot_names` and `variables` are the wrapped optimizer's, and `minimize` calls both. Eagerly,
as TF1 optimizers are, compute_gradients takes a callable loss. `register_local_var` keeps a
variable's gradient local (local.py). `backward_passes_per_step` > 1 aggregates locally in graph mode
(aggregation.py) and is refused when eager, as in Horovod. A Keras optimizer goes to sluice.keras's
DistributedOptimizer, as Horovod hands it to horovod.tensorflow.keras.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from sluice.errors import InvalidCallError
from sluice.worker.collective.process_set import global_process_set
from sluice.worker.tensorflow.aggregation import LocalAggregator
from sluice.worker.tensorflow.collectives import Average
from sluice.worker.tensorflow.compression import Compression, Compressor
from sluice.worker.tensorflow.gradients import GradientAverager, variable_names
from sluice.worker.tensorflow.local import LocalSources, check_reduction_args
from sluice.worker.tensorflow.sparse import SparseGradients


class _DistributedOptimizer(tf.compat.v1.train.Optimizer):  # type: ignore[misc]
    """A TF1 optimizer that reduces the wrapped optimizer's gradients over the workers before applying them."""

    def __init__(self, optimizer: Any, name: str | None, use_locking: bool, compression: type[Compressor],
                 sparse_as_dense: bool, op: str, gradient_predivide_factor: float, backward_passes_per_step: int,
                 average_aggregated_gradients: bool, process_set: Any, scale_local_gradients: bool) -> None:
        if name is None:
            name = f"Distributed{type(optimizer).__name__}"
        super().__init__(use_locking=use_locking, name=name)
        self._optimizer = optimizer
        # tf.IndexedSlices gathered, or made dense with sparse_as_dense (sparse.py), as the tape's
        self._average = SparseGradients(GradientAverager(compression, op, gradient_predivide_factor, process_set),
                                        sparse_as_dense,
                                        process_set)
        self._local = LocalSources(process_set, scale_local_gradients)
        self.process_set, self.scale_local_gradients = process_set, scale_local_gradients
        self._agg_helper: LocalAggregator | None = None
        if backward_passes_per_step != 1:
            if backward_passes_per_step > 1 and tf.executing_eagerly():
                raise InvalidCallError("backward_passes_per_step > 1 is not yet supported for _LegacyOptimizer "
                                       "with eager execution.")
            self._agg_helper = LocalAggregator(backward_passes_per_step, self._reduce, sparse_as_dense,
                                               average_aggregated_gradients, name)

    def register_local_var(self, var: Any) -> None:
        """Horovod's: `var`'s gradient is not reduced (it is divided by the set's size where
        scale_local_gradients)."""
        self._local.register(var)

    def _reduce(self, grads: list[Any], variables: list[Any]) -> list[Any]:
        names = variable_names(variables)
        return self._local.reduce(lambda gs, indices: self._average(gs, [names[i] for i in indices]),
                                  grads, variables)

    def compute_gradients(self, *args: Any, **kwargs: Any) -> list[tuple[Any, Any]]:
        """The wrapped optimizer's (gradient, variable) pairs, the gradients reduced over the workers."""
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        if not pairs:
            return list(pairs)
        grads, variables = [g for g, _ in pairs], [v for _, v in pairs]
        if self._agg_helper is not None:
            reduced = self._agg_helper.compute_gradients(grads, variables)
        else:
            reduced = self._reduce(grads, variables)
        return list(zip(reduced, variables, strict=True))

    def apply_gradients(self, grads_and_vars: Any, global_step: Any = None, name: str | None = None) -> Any:
        """The wrapped optimizer's apply_gradients (with local aggregation: once every backward_passes_per_step)."""
        if self._agg_helper is None:
            return self._optimizer.apply_gradients(grads_and_vars, global_step=global_step, name=name)
        pairs: Sequence[tuple[Any, Any]] = list(grads_and_vars)
        return self._agg_helper.apply_gradients(
            lambda: self._optimizer.apply_gradients(pairs, global_step=global_step, name=name),
            self._optimizer, pairs, global_step)

    def get_slot(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.variables(*args, **kwargs)


def DistributedOptimizer(optimizer: Any, name: str | None = None, use_locking: bool = False, device_dense: str = "",
                         device_sparse: str = "", compression: type[Compressor] = Compression.none,
                         sparse_as_dense: bool = False, backward_passes_per_step: int = 1, op: str = Average,
                         gradient_predivide_factor: float = 1.0, average_aggregated_gradients: bool = False,
                         num_groups: int = 0, groups: Any = None, process_set: Any = global_process_set,
                         scale_local_gradients: bool = True) -> Any:
    """Horovod's DistributedOptimizer: `optimizer`'s gradients are reduced (averaged by default) over the
    workers before they are applied. A `tf.compat.v1.train.Optimizer` is wrapped here; any other (a
    Keras optimizer) goes to sluice.keras's DistributedOptimizer. Balanced fusion (collective.fusion_bytes)
    takes the place of num_groups and groups, which are checked as Horovod checks them."""
    check_reduction_args(op, gradient_predivide_factor, num_groups, groups, process_set)
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        return _DistributedOptimizer(optimizer, name, use_locking, compression, sparse_as_dense, op,
                                     gradient_predivide_factor, backward_passes_per_step,
                                     average_aggregated_gradients, process_set, scale_local_gradients)
    from sluice.worker.keras.optimizer import DistributedOptimizer as keras_distributed

    options: dict[str, Any] = {
        "name": name, "device_dense": device_dense, "device_sparse": device_sparse, "compression": compression,
        "sparse_as_dense": sparse_as_dense, "gradient_predivide_factor": gradient_predivide_factor, "op": op,
        "backward_passes_per_step": backward_passes_per_step,
        "average_aggregated_gradients": average_aggregated_gradients}
    accepted = inspect.signature(keras_distributed).parameters
    for key, value in (("process_set", process_set), ("scale_local_gradients", scale_local_gradients)):
        if key in accepted:  # where sluice.keras takes them (the global set was checked above)
            options[key] = value
    return keras_distributed(optimizer, **options)
