"""The Keras sides of bench/train_throughput.py: the digits model in Keras 3 by sluice.keras, alone, or under TF's MWMS.

Every side trains examples/train_digits_keras.py's model (the PyTorch demo's layers, channels last)
with model.fit on the same batches as the PyTorch side (SGD lr 0.05, momentum 0.9, one TF intra-op
thread per process and two inter-op threads, jit_compile off), fed by the same tf.data pipeline
(this worker's batches, prefetched, tf.data's autotuning off: its thread makes a finished fit wait
for it, seconds at a time, on a loaded machine). Each worker runs one fit of `warmup` untimed steps
(the trace among them) and `repeats` x `steps` timed ones; a callback times each repetition between
two barriers, so the steady state is measured, not fit's set-up or the end of its epoch. TF is
imported in the children only: nothing of its runtime is ever forked.

  sluice   sluice.keras: DistributedOptimizer, W workers and S servers (LocalCluster)
  alone    W processes training Keras alone at once, exchanging nothing: the ceiling of scaling
  mwms     tf.distribute.MultiWorkerMirroredStrategy: W processes on 127.0.0.1 (TF_CONFIG, ports the
           OS chose), CPU collectives over gRPC (CommunicationImplementation.RING); the per-worker
           batches come from distribute_datasets_from_function. Keras 3.15's fit does not run under
           this strategy as shipped: its symbolic build reduces an (x, y) batch as one value, and its
           train step averages the scalar metrics over axis 0; so the model is built from a local
           batch first and the step's logs are each worker's own (reduction "first"), as
           sluice.keras's logs are. The gradients are what the strategy averages.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from bench.common import free_port, import_example
from testbed.children import Children
from testbed.cluster import LocalCluster

ALONE = "Keras alone x W (no exchange)"
MWMS = "tf.distribute.MultiWorkerMirroredStrategy (CPU, gRPC ring collectives)"
Data = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]


def _keras() -> Any:
    """TF quiet, one intra-op thread and two inter-op threads (the exchange waits in one), then keras."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    import keras

    return keras


def _model(keras: Any, optimizer: Any) -> Any:
    example: Any = import_example("train_digits_keras")
    keras.utils.set_random_seed(0)
    model = example.make_model()
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)
    return model


def total_steps(args: argparse.Namespace) -> int:
    """The steps of the one fit each worker runs: warm-up (at least one: the trace) and every timed repetition."""
    return int(max(args.warmup, 1) + args.repeats * args.steps)


def channels_last(data: tuple[torch.Tensor, torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """(steps, batch, 1, 8, 8) images and their labels as (steps * batch, 8, 8, 1) and (steps * batch,)."""
    images, labels = data
    return images.permute(0, 1, 3, 4, 2).reshape(-1, 8, 8, 1).numpy(), labels.reshape(-1).numpy()


def _dataset(data: tuple[torch.Tensor, torch.Tensor], batch: int) -> Any:
    """This worker's batches in order, prefetched, without tf.data's autotuning (nor sharding, for MWMS)."""
    import tensorflow as tf

    images, labels = channels_last(data)
    options = tf.data.Options()
    options.autotune.enabled = False
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return tf.data.Dataset.from_tensor_slices((images, labels)).batch(batch).prefetch(2).with_options(options)


def timed_fit(keras: Any, model: Any, dataset: Any, args: argparse.Namespace,
              barrier: Callable[[str], None]) -> dict[str, Any]:
    """One fit over `total_steps` batches; the seconds of each timed repetition (between barriers, from a
    callback) and the epoch's mean loss."""
    warm = max(args.warmup, 1)

    class Clock(keras.callbacks.Callback):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.seconds: list[float] = []
            self.started = 0.0

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            rep, offset = divmod(batch - warm, args.steps)
            if batch >= warm and offset == 0:
                barrier(f"start.{rep}")
                self.started = time.perf_counter()

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            rep, offset = divmod(batch - warm, args.steps)
            if batch >= warm and offset == args.steps - 1:
                barrier(f"end.{rep}")
                self.seconds.append(time.perf_counter() - self.started)

    clock = Clock()
    history = model.fit(dataset, epochs=1, steps_per_epoch=total_steps(args), verbose=0, callbacks=[clock])
    return {"seconds": clock.seconds, "loss": float(history.history["loss"][-1])}


# ---------------------------------------------------------------------------- sluice.keras
def _sluice_worker(data: Data, args: argparse.Namespace) -> dict[str, Any]:
    keras = _keras()
    import sluice.keras as hvd

    hvd.init()
    model = _model(keras, hvd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9)))
    hvd.broadcast_variables(model.variables, root_rank=0)
    result = timed_fit(keras, model, _dataset(data(hvd.rank(), hvd.size()), args.batch_size), args,
                       lambda name: hvd.barrier(name=name))
    hvd.shutdown()
    return result


def measure_sluice_keras(data: Data, args: argparse.Namespace) -> dict[str, Any]:
    """W workers of a Sluice job (LocalCluster, S servers), sluice.keras's DistributedOptimizer."""
    config = {**args.config, "worker": {**args.config["worker"], "optimizer_on": "worker"}}
    with LocalCluster(args.workers, args.servers, config) as cluster:
        results = cluster.run(_sluice_worker, data, args, timeout=args.timeout)
        cluster.wait()
    out: dict[str, Any] = results[0]
    return out


# ---------------------------------------------------------------------------- Keras alone
def _alone_worker(rank: int, data: Data, args: argparse.Namespace, gate: Any) -> dict[str, Any]:
    keras = _keras()
    model = _model(keras, keras.optimizers.SGD(0.05, momentum=0.9))
    return timed_fit(keras, model, _dataset(data(rank, args.workers), args.batch_size), args,
                     lambda _name: gate.wait(args.timeout))


def measure_keras_alone(data: Data, args: argparse.Namespace) -> dict[str, Any]:
    """W processes each training plain Keras on its own batches at once, exchanging nothing: the
    throughput Sluice would reach if the gradient exchange cost nothing."""
    return _children(_alone_worker, data, args)


# ---------------------------------------------------------------------------- MultiWorkerMirroredStrategy
def _mirrored_worker(rank: int, data: Data, args: argparse.Namespace, gate: Any, ports: list[int]) -> dict[str, Any]:
    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                                          "task": {"type": "worker", "index": rank}})
    keras = _keras()
    import tensorflow as tf
    from keras.src.backend.tensorflow import trainer

    ring = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=ring)
    with strategy.scope():
        model = _model(keras, keras.optimizers.SGD(0.05, momentum=0.9))
    batches = data(rank, args.workers)
    dataset = strategy.distribute_datasets_from_function(lambda _context: _dataset(batches, args.batch_size))
    images, labels = channels_last((batches[0][:1], batches[1][:1]))
    with strategy.scope():  # built from a local batch: Keras's own build reduces the (x, y) batch as one value
        model._symbolic_build(data_batch=(tf.constant(images), tf.constant(labels)))
    model._maybe_symbolic_build = lambda iterator=None, data_batch=None: None
    reduce = trainer.reduce_per_replica  # each worker's own logs: Keras averages scalars over axis 0 here
    trainer.reduce_per_replica = lambda values, strategy, reduction: reduce(values, strategy, "first")
    result = timed_fit(keras, model, dataset, args, lambda _name: gate.wait(args.timeout))
    gate.wait(args.timeout)  # the first worker leads TF's coordination service: nobody leaves before the rest
    return result


def measure_mirrored(data: Data, args: argparse.Namespace) -> dict[str, Any]:
    """W processes training with tf.distribute.MultiWorkerMirroredStrategy on the same batches."""
    ports = [free_port() for _ in range(args.workers)]
    return _children(_mirrored_worker, data, args, ports)


def _children(worker: Callable[..., dict[str, Any]], data: Data, args: argparse.Namespace, *extra: Any
              ) -> dict[str, Any]:
    with Children() as children:
        gate = children.barrier(args.workers)
        for rank in range(args.workers):
            children.start(f"rank {rank}", worker, rank, data, args, gate, *extra)
        results = children.collect([f"rank {r}" for r in range(args.workers)], args.timeout)
    out: dict[str, Any] = results["rank 0"]
    return out
