"""DistributedOptimizer for Keras 3: the optimizer's own class, whose `apply` averages the gradients first.

Keras 3 removed the hooks Horovod wrapped (get_gradients, _aggregate_gradients); every update goes
through `apply(grads, trainable_variables)` (apply_gradients calls it), so that is what is wrapped.
The wrapper is a subclass of the optimizer's class made on the fly, named and placed like it, so
isinstance holds and serialization writes the plain optimizer (a saved model loads anywhere;
`load_model` here wraps it again). model.fit traces the step into a tf.function: the gradients
then cross into Python in one tf.py_function, which XLA cannot compile; see callbacks.py for what
happens with jit_compile=True.
"""

from __future__ import annotations

from typing import Any

import keras

from sluice.errors import SluiceError
from sluice.worker.tensorflow.collectives import Average
from sluice.worker.tensorflow.compression import Compression, Compressor
from sluice.worker.tensorflow.gradients import GradientAverager, variable_names


class _DistributedOptimizer:
    """Mixed in front of the user's optimizer class."""

    _sluice_average: GradientAverager
    built: bool
    _trainable_variables: list[Any]

    def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
        grads = list(grads)
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
        known = trainable_variables if trainable_variables is not None else \
            (self._trainable_variables if self.built else None)
        names = variable_names(known) if known is not None and len(known) == len(grads) else \
            [f"gradient{i}" for i in range(len(grads))]
        return super().apply(self._sluice_average(grads, names), trainable_variables)  # type: ignore[misc]


def DistributedOptimizer(optimizer: Any, name: str | None = None, device_dense: str = "", device_sparse: str = "",
                         compression: type[Compressor] = Compression.none, sparse_as_dense: bool = False,
                         gradient_predivide_factor: float = 1.0, op: str = Average, backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False, num_groups: int = 0, groups: Any = None) -> Any:
    """A copy of `optimizer` (same class, same config, fresh state) that averages the gradients over the
    workers before each update, in balanced fused groups (collective.fusion_bytes), which take the
    place of Horovod's num_groups and groups. For Horovod's backward_passes_per_step use Keras's own
    gradient_accumulation_steps (every micro-step is then averaged: the same result, more traffic)."""
    if backward_passes_per_step != 1:
        raise SluiceError("backward_passes_per_step is not supported: give the optimizer Keras's "
                          "gradient_accumulation_steps instead")
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
    wrapped._sluice_average = GradientAverager(compression, op, gradient_predivide_factor)
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
