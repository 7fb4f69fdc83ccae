"""Horovod's elastic Keras API (horovod.keras.elastic, horovod.tensorflow.keras.elastic): KerasState, callbacks, run.

KerasState is sluice.tensorflow's TensorFlowKerasState (worker/tensorflow/elastic.py): the model's and
the optimizer's variables and plain attributes, committed to this host under `sluice launch
--elastic` and restored by `run` in the next generation (with --in-place, by the survivors in their
own processes, model.fit's traced step kept). The callbacks keep the state in step with
model.fit, as Horovod's: put them in this order, UpdateEpochStateCallback, UpdateBatchStateCallback,
CommitStateCallback, and give fit `epochs=total - state.epoch`:

- UpdateEpochStateCallback: `state.epoch` counts the epochs done, across re-formed jobs;
- UpdateBatchStateCallback: `state.batch` is the last batch done in this epoch (0 after an epoch);
  after a re-forming it also shortens the first epoch's `steps` by the batches done, where fit knows
  its steps (in Keras 3 fit's `steps` parameter is what the progress bar shows: the epoch itself
  runs its full length from the start of the data, as it does under Horovod);
- CommitStateCallback: `state.commit()` every `batches_per_commit` batches and at each epoch's end.
"""

from __future__ import annotations

from typing import Any

import keras

from sluice.worker.tensorflow.elastic import TensorFlowKerasState, run

__all__ = ["CommitStateCallback", "KerasState", "UpdateBatchStateCallback", "UpdateEpochStateCallback", "run"]


class KerasState(TensorFlowKerasState):
    """A built Keras model, its optimizer (`optimizer`, else the model's) and plain attributes (batch,
    epoch, ...) as one elastic state."""

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any) -> None:
        super().__init__(model, optimizer=optimizer, backend=keras.backend, **kwargs)


class CommitStateCallback(keras.callbacks.Callback):  # type: ignore[misc]
    """Commit `state` every `batches_per_commit` batches, at each batch's end, and at each epoch's end."""

    def __init__(self, state: Any, batches_per_commit: int = 1) -> None:
        super().__init__()
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.batches_remaining = self.batches_per_commit  # every worker counts from here after a re-forming

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):  # type: ignore[misc]
    """Set `state.batch` to the batch just done, and to 0 at each epoch's end."""

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state
        self.steps_per_epoch: int | None = None

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if (self.params or {}).get("steps"):
            if self.steps_per_epoch is None:
                self.steps_per_epoch = self.params["steps"]
            self.params["steps"] = self.steps_per_epoch - self.state.batch

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.state.batch = batch

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):  # type: ignore[misc]
    """Set `state.epoch` to the epochs done: the state's epoch when fit began plus fit's epochs done."""

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.state.epoch = self.initial_epoch + epoch + 1
