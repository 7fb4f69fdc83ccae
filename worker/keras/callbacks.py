"""Horovod's Keras callbacks: broadcast the start state, average the epoch's metrics, warm the learning rate up.

BroadcastGlobalVariablesCallback also settles jit_compile: model.fit builds its train step after
the callbacks get the model and before training begins, so when the model would compile its step
with XLA (jit_compile=True, which Keras 3's "auto" picks when a GPU is visible) the callback turns
that off, with a warning saying why: the gradient exchange runs in Python (tf.py_function), which
XLA cannot compile. Without the callback, such a step fails when traced, saying what to set.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from sluice.errors import SluiceError
from sluice.worker.tensorflow.collectives import broadcast_variables, grouped_allreduce
from sluice.worker.tensorflow.state import require

log = logging.getLogger("sluice.worker")


def turn_off_xla(model: Any) -> None:
    """Make model.fit build its train step without XLA, which cannot run the gradient exchange."""
    if getattr(model, "jit_compile", False):
        log.warning("sluice.keras: turning jit_compile off for %s: DistributedOptimizer exchanges gradients in "
                    "Python (tf.py_function), which XLA cannot compile; pass jit_compile=False to "
                    "model.compile to silence this", getattr(model, "name", "the model"))
        model.jit_compile = False
        model.train_function = None  # built again, without XLA, by the next fit


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):  # type: ignore[misc]
    """Give every worker `root_rank`'s model and optimizer variables when training begins, so that all
    start from the same state (their models may have been initialised differently)."""

    def __init__(self, root_rank: int, device: str = "") -> None:
        super().__init__()
        self.root_rank = root_rank
        self.broadcast_done = False

    def set_model(self, model: Any) -> None:
        super().set_model(model)
        turn_off_xla(model)

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        if self.broadcast_done:
            return
        broadcast_variables(self.model.variables, self.root_rank)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None:  # built by fit before this (slots), with its iterations and learning rate
            broadcast_variables(optimizer.variables, self.root_rank)
        self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):  # type: ignore[misc]
    """At the end of every epoch, replace each metric in the logs by its mean over the workers (put it
    before the callbacks that read the metrics: checkpoints, early stopping, schedules)."""

    def __init__(self, device: str = "") -> None:
        super().__init__()

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
    """Horovod's schedule: from `start_epoch` to `end_epoch`, lr = initial_lr * multiplier(epoch), set at
    every epoch's start (staircase) or every batch's with the fractional epoch (epoch + batch /
    steps_per_epoch). `momentum_correction` is accepted and not applied: Keras 3 optimizers read their
    momentum as a constant that the traced train step keeps."""

    def __init__(self, initial_lr: float, multiplier: float | Callable[[float], float], start_epoch: int = 0,
                 end_epoch: int | None = None, staircase: bool = True, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None) -> None:
        super().__init__()
        self.initial_lr, self.start_epoch, self.end_epoch = initial_lr, start_epoch, end_epoch
        self.staircase, self.steps_per_epoch = staircase, steps_per_epoch
        self.multiplier: Callable[[float], float] = multiplier if callable(multiplier) else (lambda _: multiplier)
        self.current_epoch = 0

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self.params.get("steps") if self.params else None
            if not self.steps_per_epoch:
                raise SluiceError("steps_per_epoch is needed: fit could not tell how many steps an epoch has")

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        epoch = self.current_epoch
        if epoch < self.start_epoch or (self.end_epoch is not None and epoch >= self.end_epoch):
            return
        if self.staircase:
            if batch == 0:
                self._set(self.current_epoch)
        else:
            assert self.steps_per_epoch
            self._set(self.current_epoch + batch / self.steps_per_epoch)

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
    (so the last warm-up batch runs at initial_lr exactly, as Horovod's does)."""

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None, verbose: int = 0) -> None:
        super().__init__(initial_lr, self._warmup, 0, warmup_epochs, False, momentum_correction, steps_per_epoch)
        self.size, self.warmup_epochs, self.verbose = require().size, warmup_epochs, verbose

    def _warmup(self, epoch: float) -> float:
        assert self.steps_per_epoch
        epoch += 1.0 / self.steps_per_epoch
        return 1.0 / self.size * (epoch * (self.size - 1) / self.warmup_epochs + 1)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0:  # type: ignore[operator]
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {self.learning_rate():g}.")
