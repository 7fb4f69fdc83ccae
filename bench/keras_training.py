"""The Keras side of bench/train_throughput.py: the digits demo model in Keras 3, through sluice.keras or alone.

Both sides train examples/train_digits_keras.py's model (the PyTorch demo's layers, channels last)
with model.fit on the same batches as the PyTorch side (SGD lr 0.05, momentum 0.9, one TF thread
per process, jit_compile off), timing `steps` steps between two barriers after untimed warm-up
steps (which include the trace). TF is imported in the children only: nothing of its runtime is
ever forked.
"""

from __future__ import annotations

import argparse
import importlib
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from testbed.children import Children
from testbed.cluster import LocalCluster

ALONE = "Keras alone x W (no exchange)"


def _keras() -> Any:
    """TF quiet and single-threaded (one more inter-op thread: the gradient exchange blocks one), then keras."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    import keras

    return keras


def _model(keras: Any, optimizer: Any) -> Any:
    example: Any = importlib.import_module("examples.train_digits_keras")
    keras.utils.set_random_seed(0)
    model = example.make_model()
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)
    return model


def channels_last(data: tuple[torch.Tensor, torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """(steps, batch, 1, 8, 8) images and their labels as (steps * batch, 8, 8, 1) and (steps * batch,)."""
    images, labels = data
    return images.permute(0, 1, 3, 4, 2).reshape(-1, 8, 8, 1).numpy(), labels.reshape(-1).numpy()


def timed_fit(model: Any, images: np.ndarray, labels: np.ndarray, args: argparse.Namespace,
              barrier: Callable[[str], None]) -> dict[str, Any]:
    """Seconds of each repetition of args.steps steps of model.fit, between barriers, and the last loss."""
    batch = args.batch_size
    warm = max(args.warmup, 1) * batch  # at least one step: the trace is never timed
    history = model.fit(images[:warm], labels[:warm], batch_size=batch, epochs=1, shuffle=False, verbose=0)
    timed = slice(warm, warm + args.steps * batch)
    seconds = []
    for rep in range(args.repeats):
        barrier(f"start.{rep}")
        started = time.perf_counter()
        history = model.fit(images[timed], labels[timed], batch_size=batch, epochs=1, shuffle=False, verbose=0)
        barrier(f"end.{rep}")
        seconds.append(time.perf_counter() - started)
    return {"seconds": seconds, "loss": float(history.history["loss"][-1])}


def _sluice_worker(data: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]],
                   args: argparse.Namespace) -> dict[str, Any]:
    keras = _keras()
    import sluice.keras as hvd

    hvd.init()
    model = _model(keras, hvd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9)))
    hvd.broadcast_variables(model.variables, root_rank=0)
    images, labels = channels_last(data(hvd.rank(), hvd.size()))
    result = timed_fit(model, images, labels, args, hvd.barrier)
    hvd.shutdown()
    return result


def measure_sluice_keras(data: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]],
                         args: argparse.Namespace) -> dict[str, Any]:
    """W workers of a Sluice job (LocalCluster, S servers), sluice.keras's DistributedOptimizer."""
    config = {**args.config, "worker": {**args.config["worker"], "optimizer_on": "worker"}}
    with LocalCluster(args.workers, args.servers, config) as cluster:
        results = cluster.run(_sluice_worker, data, args, timeout=args.timeout)
        cluster.wait()
    out: dict[str, Any] = results[0]
    return out


def _alone_worker(rank: int, data: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]],
                  args: argparse.Namespace, gate: Any) -> dict[str, Any]:
    keras = _keras()
    model = _model(keras, keras.optimizers.SGD(0.05, momentum=0.9))
    images, labels = channels_last(data(rank, args.workers))
    return timed_fit(model, images, labels, args, lambda _name: gate.wait(args.timeout))


def measure_keras_alone(data: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]],
                        args: argparse.Namespace) -> dict[str, Any]:
    """W processes each training plain Keras on its own batches at once, exchanging nothing: the
    throughput Sluice would reach if the gradient exchange cost nothing."""
    with Children() as children:
        gate = children.barrier(args.workers)
        for rank in range(args.workers):
            children.start(f"rank {rank}", _alone_worker, rank, data, args, gate)
        results = children.collect([f"rank {r}" for r in range(args.workers)], args.timeout)
    out: dict[str, Any] = results["rank 0"]
    return out
