"""Worker functions for sluice.keras's tests, run in forked workers (TF and Keras are imported there only)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tests.integration.tf_jobs import BATCH, CLASSES, FEATURES, LR, STEPS, _tf, data, shard


def _model(keras: Any, seed: int) -> Any:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(16, activation="relu"),
                             keras.layers.Dense(CLASSES)])


def _compile(keras: Any, model: Any, optimizer: Any, jit_compile: bool = False) -> Any:
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=jit_compile)
    return model


def _weights(model: Any) -> list[list[Any]]:
    return [w.tolist() for w in model.get_weights()]


def _sgd(keras: Any) -> Any:
    return keras.optimizers.SGD(LR, momentum=0.5)


def _custom_loop(tf: Any, keras: Any, model: Any, optimizer: Any, x: np.ndarray, y: np.ndarray) -> None:
    """Eager steps: tape.gradient, then optimizer.apply_gradients (the DistributedOptimizer averages)."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    per = len(x) // STEPS
    for k in range(STEPS):
        with tf.GradientTape() as tape:
            loss = loss_fn(y[k * per: (k + 1) * per], model(x[k * per: (k + 1) * per], training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))


class _LearningRates:
    """A callback that records the learning rate each batch starts with (after the warm-up set it)."""

    def __new__(cls, keras: Any) -> Any:
        class Recorder(keras.callbacks.Callback):  # type: ignore[misc]
            def __init__(self) -> None:
                super().__init__()
                self.seen: list[float] = []

            def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
                self.seen.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))

        return Recorder()


def keras_api(folder: str) -> dict[str, Any]:
    """model.fit and a custom loop against one process on the whole batch; the callbacks; serialization;
    load_model; jit_compile."""
    tf = _tf()
    import keras

    import sluice.keras as hvd
    from sluice.keras.callbacks import BroadcastGlobalVariablesCallback, LearningRateWarmupCallback

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    x, y = data()
    xs, ys = shard(x, rank, size), shard(y, rank, size)
    out: dict[str, Any] = {}

    # model.fit: different starting points on purpose (the broadcast aligns them), metrics averaged
    reference = _compile(keras, _model(keras, 100), _sgd(keras))
    history = reference.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    out["fit_reference"], out["fit_reference_loss"] = _weights(reference), history.history["loss"]
    model = _compile(keras, _model(keras, 100 + rank), hvd.DistributedOptimizer(_sgd(keras)))
    history = model.fit(xs, ys, batch_size=BATCH // size, epochs=1, shuffle=False, verbose=0,
                        callbacks=[BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()])
    out["fit"], out["fit_loss"] = _weights(model), history.history["loss"]
    optimizer = model.optimizer
    out["isinstance"] = isinstance(optimizer, keras.optimizers.SGD) and type(optimizer) is not keras.optimizers.SGD
    serialized = keras.optimizers.serialize(optimizer)
    out["serialized"] = [serialized["class_name"], serialized["config"]["momentum"]]
    out["deserialized"] = type(keras.optimizers.deserialize(serialized)).__name__
    path = str(Path(folder) / f"model{rank}.keras")
    model.save(path)
    loaded = hvd.load_model(path)
    out["loaded"] = [type(loaded.optimizer) is not keras.optimizers.SGD, int(loaded.optimizer.iterations.numpy()),
                     _weights(loaded) == out["fit"]]

    # a custom loop: eager apply_gradients
    reference = _model(keras, 7)
    _custom_loop(tf, keras, reference, _sgd(keras), x, y)
    model = _model(keras, 7)
    _custom_loop(tf, keras, model, hvd.DistributedOptimizer(_sgd(keras)), xs, ys)
    out["loop_reference"], out["loop"] = _weights(reference), _weights(model)

    # the metric average, alone
    logs = {"loss": float(rank), "accuracy": 2.0 * rank, "note": "text"}
    hvd.callbacks.MetricAverageCallback().on_epoch_end(0, logs)
    out["metric_average"] = logs

    # the warm-up: 3 batches an epoch (found by itself), 2 warm-up epochs, then the full rate
    model = _compile(keras, _model(keras, 3), hvd.DistributedOptimizer(keras.optimizers.SGD(LR)))
    recorder = _LearningRates(keras)
    history = model.fit(xs[: 3 * BATCH // size], ys[: 3 * BATCH // size], batch_size=BATCH // size, epochs=3,
                        shuffle=False, verbose=0, callbacks=[LearningRateWarmupCallback(LR, warmup_epochs=2),
                                                             recorder])
    out["warmup"], out["warmup_logged"] = recorder.seen, history.history["lr"]

    # jit_compile=True: refused with what to set; the broadcast callback turns it off instead
    model = _compile(keras, _model(keras, 5), hvd.DistributedOptimizer(_sgd(keras)), jit_compile=True)
    try:
        model.fit(xs, ys, batch_size=BATCH // size, epochs=1, verbose=0)
        out["xla_error"] = "no error"
    except Exception as exc:
        out["xla_error"] = str(exc)
    model.fit(xs, ys, batch_size=BATCH // size, epochs=1, shuffle=False, verbose=0,
              callbacks=[BroadcastGlobalVariablesCallback(0)])
    out["xla_off"] = [model.jit_compile, _weights(model)]
    hvd.shutdown()
    return out
