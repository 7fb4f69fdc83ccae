"""Horovod's Keras callbacks: broadcast the start state, average the epoch's metrics, schedule the learning rate.

BroadcastGlobalVariablesCallback also settles jit_compile: model.fit builds its train step after
the callbacks get the model and before training begins, so when the model would compile its step
with XLA (jit_compile=True, which Keras 3's "auto" picks when a GPU is visible) the callback turns
that off, with a warning saying why: the gradient exchange runs in Python (tf.py_function), which
XLA cannot compile. Without the callback, such a step fails when traced, saying what to set.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from sluice.worker.tensorflow.collectives import broadcast_variables, grouped_allreduce
from sluice.worker.tensorflow.state import require

__all__ = ["BestModelCheckpoint", "BroadcastGlobalVariablesCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback", "MetricAverageCallback"]

log = logging.getLogger("sluice.worker")


def turn_off_xla(model: Any) -> None:
    """Make model.fit build its train step without XLA, which cannot run the gradient exchange."""
    if getattr(model, "jit_compile", False):
        log.warning("sluice.keras: turning jit_compile off for %s: DistributedOptimizer exchanges gradients in "
                    "Python (tf.py_function), which XLA cannot compile; pass jit_compile=False to "
                    "model.compile to silence this", getattr(model, "name", "the model"))
        model.jit_compile = False
        model.train_function = None  # built again, without XLA, by the next fit


def _variable_ids(variable: Any) -> set[int]:
    """Who a variable is: a keras.Variable and the tf.Variable it holds are the same one."""
    held = variable.value if isinstance(variable, keras.Variable) else None
    return {id(variable)} | ({id(held)} if isinstance(held, tf.Variable) else set())


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):  # type: ignore[misc]
    """Give every worker `root_rank`'s model and optimizer variables when training begins, so that all
    start from the same state (their models may have been initialised differently). `local_variables`
    (Horovod's): model variables that keep each worker's own values; the optimizer's variables are all
    broadcast, as in Horovod. Horovod broadcasts after the first batch, whose step has then run from
    unequal weights; here it is before it (fit builds the optimizer first, so its slots are included)."""

    def __init__(self, root_rank: int, device: str = "", local_variables: Any = None) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.broadcast_done = False
        self._local_ids: set[int] = set()
        if local_variables is None:
            local_variables = []
        elif isinstance(local_variables, tf.Variable | keras.Variable):
            local_variables = [local_variables]
        else:
            local_variables = list(local_variables)
            if not all(isinstance(v, tf.Variable | keras.Variable) for v in local_variables):
                raise ValueError("All local variables must be of tf.Variable type.")
        for variable in local_variables:
            self.register_local_var(variable)

    def register_local_var(self, var: Any) -> None:
        """Leave `var` out of the broadcast: each worker keeps its own value."""
        self._local_ids |= _variable_ids(var)

    def set_model(self, model: Any) -> None:
        super().set_model(model)
        turn_off_xla(model)

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        if self.broadcast_done:
            return
        broadcast_variables([v for v in self.model.variables if not _variable_ids(v) & self._local_ids],
                            self.root_rank)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None:  # built by fit before this (slots), with its iterations and learning rate
            broadcast_variables(optimizer.variables, self.root_rank)
        self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):  # type: ignore[misc]
    """At the end of every epoch, replace each numeric metric in the logs by its mean over the workers (put
    it before the callbacks that read the metrics: checkpoints, early stopping, schedules); one request
    for all of them. Other values (Horovod would fail on them) stay as they are."""

    def __init__(self, device: str = "") -> None:
        super().__init__()
        self.device = device

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if not logs:
            return
        names = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and np.issubdtype(np.asarray(v).dtype, np.number))
        if not names:
            return
        values = tf.constant([float(logs[k]) for k in names], tf.float64)
        (mean,) = grouped_allreduce([values])  # one request for all of them (the names agree on every rank)
        for name, value in zip(names, mean.numpy().tolist(), strict=True):
            logs[name] = value


class LearningRateScheduleCallback(keras.callbacks.Callback):  # type: ignore[misc]
    """Horovod's schedule: from `start_epoch` to `end_epoch` (exclusive), lr = initial_lr * multiplier(epoch),
    set at every epoch's start (staircase) or every batch's with the fractional epoch (epoch + batch /
    steps_per_epoch; fit's steps when not given). A constant `multiplier` m is an exponential decay:
    m ** (epoch - start_epoch). `momentum_correction` is accepted and not applied: Keras 3 optimizers
    read their momentum as a constant that the traced train step keeps."""

    def __init__(self, initial_lr: float, multiplier: float | Callable[[float], float], start_epoch: int = 0,
                 end_epoch: int | None = None, staircase: bool = True, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None) -> None:
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr, self.start_epoch, self.end_epoch = initial_lr, start_epoch, end_epoch
        self.staircase, self.momentum_correction, self.steps_per_epoch = staircase, momentum_correction, steps_per_epoch
        if callable(multiplier):
            self.multiplier: Callable[[float], float] = multiplier
        else:
            base = float(multiplier)
            self.multiplier = lambda epoch: base ** (epoch - start_epoch)
        self.current_epoch: int | None = None

    def _autodetect_steps_per_epoch(self) -> int:
        params = self.params or {}
        if params.get("steps"):
            return int(params["steps"])
        if params.get("samples") and params.get("batch_size"):
            return int(params["samples"]) // int(params["batch_size"])
        raise ValueError("Could not autodetect the number of steps per epoch. Please specify the steps_per_epoch "
                         f"parameter to the {type(self).__name__}() or upgrade to the latest version of Keras.")

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._autodetect_steps_per_epoch()

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        epoch = self.current_epoch
        if epoch is None or epoch < self.start_epoch or (self.end_epoch is not None and epoch >= self.end_epoch):
            return
        if self.staircase:
            if batch == 0:
                self._set(epoch)
        else:
            assert self.steps_per_epoch
            self._set(epoch + batch / self.steps_per_epoch)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if logs is not None:
            logs["lr"] = self.learning_rate()

    def learning_rate(self) -> float:
        return float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))

    def _set(self, epoch: float) -> None:
        self.model.optimizer.learning_rate = self.initial_lr * self.multiplier(epoch)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Horovod's warm-up (Goyal et al., 2017): the learning rate grows from initial_lr / size to
    initial_lr over the first `warmup_epochs`, batch by batch: before batch b of epoch e,
    lr = initial_lr / size * (x * (size - 1) / warmup_epochs + 1) with x = e + (b + 1) / steps_per_epoch
    (so the last warm-up batch runs at initial_lr exactly, as Horovod's does). `size` is read when
    the rate is set; `verbose` > 0 prints the end of the warm-up on rank 0."""

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None, verbose: int = 0) -> None:
        super().__init__(initial_lr, self._warmup, 0, warmup_epochs, False, momentum_correction, steps_per_epoch)
        self.warmup_epochs, self.verbose = warmup_epochs, verbose

    def _warmup(self, epoch: float) -> float:
        assert self.steps_per_epoch
        size = require().size
        epoch += 1.0 / self.steps_per_epoch
        return 1.0 / size * (epoch * (size - 1) / self.warmup_epochs + 1)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == self.warmup_epochs - 1 and self.verbose > 0 and require().rank == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {self.learning_rate():g}.")


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):  # type: ignore[misc]
    """Horovod's: a ModelCheckpoint that keeps the best model only (save_best_only), whose `filepath` is set
    after it is made (Horovod's Spark estimator sets it); training refuses to begin without one. Keras 3
    wants a path ending in `.keras` (`.weights.h5` with save_weights_only)."""

    def __init__(self, monitor: str = "val_loss", verbose: int = 0, save_weights_only: bool = False,
                 mode: str = "auto", save_freq: str | int = "epoch") -> None:
        placeholder = "best.weights.h5" if save_weights_only else "best.keras"  # Keras 3 checks the path here
        super().__init__(filepath=placeholder, monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=save_weights_only, mode=mode, save_freq=save_freq)
        self.filepath: str | None = None

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        wanted: Iterable[str] = (".weights.h5",) if self.save_weights_only else (".keras", ".h5")
        if not self.filepath or not any(str(self.filepath).endswith(ending) for ending in wanted):
            raise ValueError(f"BestModelCheckpoint saves to its `filepath`, which is {self.filepath!r}: set it to a "
                             f"path ending in {' or '.join(wanted)} before training")
        super().on_train_begin(logs)
