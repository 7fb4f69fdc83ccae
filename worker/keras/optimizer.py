"""Keras 3 DistributedOptimizer and PartialDistributedOptimizer: the optimizer's own class, whose `apply` reduces first.

Keras 3 removed the hooks Horovod wrapped (get_gradients, _aggregate_gradients); every update goes
through `apply(grads, trainable_variables)` (apply_gradients calls it), so that is what is wrapped.
The wrapper is a subclass of the optimizer's class made on the fly, named and placed like it, so
isinstance holds and serialization writes the plain optimizer (a saved model loads anywhere;
`load_model` here wraps it again). Inside model.fit's traced step each fused group of gradients
leaves as soon as backward has made it (worker/tensorflow/overlap.py), which XLA cannot compile;
see callbacks.py for what happens with jit_compile=True. Horovod's options: `register_local_var`
and PartialDistributedOptimizer's `local_layers` keep gradients local (worker/tensorflow/local.py),
sparse gradients are gathered unless `sparse_as_dense` (worker/tensorflow/sparse.py), and
`backward_passes_per_step` accumulates locally (aggregation.py).
"""

from __future__ import annotations

from typing import Any

import keras

from sluice.errors import InvalidCallError, SluiceError
from sluice.worker.collective.process_set import global_process_set
from sluice.worker.keras.aggregation import Aggregation
from sluice.worker.tensorflow.collectives import Average
from sluice.worker.tensorflow.compression import Compression, Compressor
from sluice.worker.tensorflow.gradients import GradientAverager, variable_names
from sluice.worker.tensorflow.local import LocalSources, check_reduction_args
from sluice.worker.tensorflow.sparse import SparseGradients


class _DistributedOptimizer:
    """Mixed in front of the user's optimizer class."""

    _sluice_average: SparseGradients
    _sluice_local: LocalSources
    _sluice_aggregation: Aggregation | None = None
    built: bool
    _trainable_variables: list[Any]
    _iterations: Any

    def register_local_var(self, var: Any) -> None:
        """Horovod's: `var`'s gradient is not reduced; it stays this worker's (divided by the number of
        workers where scale_local_gradients), e.g. a model-parallel layer's weights."""
        self._sluice_local.register(var)
        held = getattr(var, "value", None)  # a keras.Variable's tf.Variable is the same variable
        if held is not None and held is not var:
            self._sluice_local.register(held)

    def build(self, variables: Any) -> None:
        super().build(variables)  # type: ignore[misc]
        if self._sluice_aggregation is not None:
            self._sluice_aggregation.build(self._trainable_variables)

    def _sluice_reduce(self, grads: list[Any], variables: list[Any] | None) -> list[Any]:
        names = variable_names(variables) if variables is not None and len(variables) == len(grads) else \
            [f"gradient{i}" for i in range(len(grads))]
        if variables is None or len(variables) != len(grads) or not len(self._sluice_local):
            return self._sluice_average(grads, names)
        return self._sluice_local.reduce(
            lambda gs, indices: self._sluice_average(gs, [names[i] for i in indices]), grads, variables)

    def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
        grads = list(grads)
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
        if self._sluice_aggregation is None:
            known = trainable_variables if trainable_variables is not None else \
                (self._trainable_variables if self.built else None)
            return super().apply(self._sluice_reduce(grads, known), trainable_variables)  # type: ignore[misc]
        if not self.built:  # as Keras's apply builds, before the accumulators are needed
            if trainable_variables is None:
                raise InvalidCallError("When passing `grads` without `variables`, the optimizer must already be "
                                       "built on a list of variables. Call `optimizer.build(trainable_variables)` "
                                       "first.")
            with keras.name_scope(self.name, caller=self):  # type: ignore[attr-defined]
                self.build(trainable_variables)
        variables = trainable_variables if trainable_variables is not None else list(self._trainable_variables)
        slots = [self._get_variable_index(v) for v in variables]  # type: ignore[attr-defined]

        def apply_reduced(reduced: list[Any]) -> None:
            super(_DistributedOptimizer, self).apply(reduced, variables)  # type: ignore[misc]

        self._sluice_aggregation.step(grads, slots, lambda gs: self._sluice_reduce(gs, variables), apply_reduced,
                                      lambda: self._iterations.assign_add(1))
        return None


def _wrap(optimizer: Any, name: str | None, compression: type[Compressor], sparse_as_dense: bool,
          gradient_predivide_factor: float, op: str, backward_passes_per_step: int,
          average_aggregated_gradients: bool, num_groups: int, groups: Any, process_set: Any,
          scale_local_gradients: bool) -> Any:
    check_reduction_args(op, gradient_predivide_factor, num_groups, groups, process_set)
    aggregation = Aggregation(backward_passes_per_step, average_aggregated_gradients, sparse_as_dense) \
        if backward_passes_per_step != 1 else None
    if isinstance(optimizer, _DistributedOptimizer):
        raise SluiceError("this optimizer is a DistributedOptimizer already")
    base: Any = optimizer.__class__
    # named and placed as the base class: serialization then records the plain optimizer
    cls: Any = type(base.__name__, (_DistributedOptimizer, base),
                    {"__module__": base.__module__, "__qualname__": base.__qualname__})
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    wrapped = cls.from_config(config)
    wrapped._sluice_aggregation = aggregation
    wrapped._sluice_average = SparseGradients(GradientAverager(compression, op, gradient_predivide_factor,
                                                               process_set),
                                              sparse_as_dense, process_set)
    wrapped._sluice_local = LocalSources(process_set, scale_local_gradients)
    return wrapped


def DistributedOptimizer(optimizer: Any, name: str | None = None, device_dense: str = "", device_sparse: str = "",
                         compression: type[Compressor] = Compression.none, sparse_as_dense: bool = False,
                         gradient_predivide_factor: float = 1.0, op: str = Average, backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False, num_groups: int = 0, groups: Any = None,
                         process_set: Any = global_process_set, scale_local_gradients: bool = True) -> Any:
    """A copy of `optimizer` (same class, same config, fresh state) that averages the gradients over the
    workers before each update, in balanced fused groups (collective.fusion_bytes), which take the
    place of Horovod's num_groups and groups (checked as Horovod checks them). With
    `backward_passes_per_step` N > 1, gradients accumulate locally and are reduced and applied on
    every N-th pass (divided by N where `average_aggregated_gradients`), as Horovod's."""
    return _wrap(optimizer, name, compression, sparse_as_dense, gradient_predivide_factor, op,
                 backward_passes_per_step, average_aggregated_gradients, num_groups, groups, process_set,
                 scale_local_gradients)


def PartialDistributedOptimizer(optimizer: Any, name: str | None = None, device_dense: str = "",
                                device_sparse: str = "", compression: type[Compressor] = Compression.none,
                                sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                                op: str = Average, backward_passes_per_step: int = 1,
                                average_aggregated_gradients: bool = False, groups: Any = None,
                                process_set: Any = global_process_set, local_layers: Any = None,
                                scale_local_gradients: bool = True) -> Any:
    """Horovod's: a DistributedOptimizer whose `local_layers` (a Keras layer or a list of them) keep their
    trainable weights' gradients local: not reduced, divided by the number of workers where
    `scale_local_gradients`. Without local layers it is a DistributedOptimizer."""
    if local_layers is None:
        local_layers = []
    elif isinstance(local_layers, keras.layers.Layer):
        local_layers = [local_layers]
    elif not all(isinstance(layer, keras.layers.Layer) for layer in local_layers):
        raise InvalidCallError("All local layers must be of tf.keras.layers.Layer type.")
    wrapped = _wrap(optimizer, name, compression, sparse_as_dense, gradient_predivide_factor, op,
                    backward_passes_per_step, average_aggregated_gradients, 0, groups, process_set,
                    scale_local_gradients)
    for layer in local_layers:
        for variable in layer.trainable_weights:
            wrapped.register_local_var(variable)
    return wrapped


def load_model(filepath: str, custom_optimizers: list[type] | None = None, custom_objects: dict[str, Any] | None = None,
               compression: type[Compressor] = Compression.none) -> Any:
    """keras.models.load_model, with the model's optimizer made a DistributedOptimizer that keeps the
    saved optimizer state (slots, iterations, learning rate)."""
    objects = dict(custom_objects or {})
    objects.update({cls.__name__: cls for cls in custom_optimizers or ()})
    model = keras.models.load_model(filepath, custom_objects=objects)
    saved = getattr(model, "optimizer", None)
    if saved is None:
        return model
    wrapped = DistributedOptimizer(saved, compression=compression)
    if saved.built:
        wrapped.build(model.trainable_variables)
        for mine, theirs in zip(wrapped.variables, saved.variables, strict=True):
            mine.assign(theirs)
    model.optimizer = wrapped
    model.train_function = None  # a step built for the plain optimizer would bypass the wrapper
    return model
