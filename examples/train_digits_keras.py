"""Train a small CNN on scikit-learn's bundled digits with Keras 3 model.fit through Sluice.

A Horovod Keras script switches to Sluice by changing its import to `import sluice.keras as hvd`.
Start it with: sluice launch -w 2 -s 1 -- python examples/train_digits_keras.py
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TF's C++ start-up chatter, on every worker

import keras
import numpy as np
import tensorflow as tf
from digits import load_digits  # examples/digits.py: scikit-learn's bundled digits

import sluice.keras as hvd


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=12, help="passes over the training set (default 12)")
    parser.add_argument("--batch-size", type=int, default=16, help="samples per worker per step (default 16)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    parser.add_argument("--threads", type=int, default=1, help="TF threads per worker (default 1)")
    parser.add_argument("--target", type=float, default=0.95, help="exit 1 if final test accuracy is lower")
    return parser.parse_args()


def make_model() -> keras.Model:
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"), keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10),
    ])


def load_data() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    images_8x8, targets = load_digits()
    images = (images_8x8[..., None] / 16.0).astype(np.float32)
    labels = targets
    order = np.random.default_rng(0).permutation(len(labels))
    test, train = order[:360], order[360:]
    return images[train], labels[train], images[test], labels[test]


class Report(keras.callbacks.Callback):
    """After each epoch: the test accuracy over every worker's share of the test set, printed by rank 0."""

    def __init__(self, x_test: np.ndarray, y_test: np.ndarray, samples_per_epoch: int) -> None:
        super().__init__()
        self.x_test, self.y_test, self.samples = x_test, y_test, samples_per_epoch
        self.accuracy, self.started = 0.0, 0.0

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.started = time.perf_counter()

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        elapsed = time.perf_counter() - self.started
        mine = np.arange(hvd.rank(), len(self.y_test), hvd.size())
        predicted = self.model.predict(self.x_test[mine], verbose=0).argmax(1)
        correct = hvd.allreduce(np.float32((predicted == self.y_test[mine]).sum()), name="test.correct", average=False)
        self.accuracy = float(correct) / len(self.y_test)
        if hvd.rank() == 0:
            print(f"epoch {epoch + 1:2d}  loss {(logs or {})['loss']:.4f}  test accuracy {self.accuracy:6.2%}  "
                  f"{self.samples / elapsed:8.0f} samples/s", flush=True)


def main() -> int:
    args = parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads + 1)  # one more for the gradient exchange
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    x_train, y_train, x_test, y_test = load_data()
    steps = (len(y_train) // size) // args.batch_size
    shard = np.arange(rank, len(y_train), size)[: steps * args.batch_size]  # as many full batches on every worker

    keras.utils.set_random_seed(rank)  # different starting points on purpose: the broadcast aligns them
    model = make_model()
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(args.lr, momentum=0.9))
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)
    if rank == 0:
        print(f"training on {len(y_train)} digits with {size} workers, {steps} steps per epoch", flush=True)
    report = Report(x_test, y_test, steps * args.batch_size * size)
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback(), report]
    model.fit(x_train[shard], y_train[shard], batch_size=args.batch_size, epochs=args.epochs, shuffle=True,
              callbacks=callbacks, verbose=0)
    hvd.shutdown()
    if report.accuracy < args.target:
        print(f"test accuracy {report.accuracy:.2%} is below the target {args.target:.0%}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
