"""The TensorFlow peer of bench/train_throughput.py's Keras cases: tf.distribute.MultiWorkerMirroredStrategy.

W processes on 127.0.0.1 (TF_CONFIG with ports the OS picked), the same model, optimizer and per-worker
batches as the sluice.keras side, one TF thread per process. Keras 3's model.fit does not run under
MultiWorkerMirroredStrategy as shipped (its train step gets PerReplica values it cannot convert;
bench/keras_training.py runs fit under it with two work-arounds, the `keras-vs-mwms` case), so this
side (`keras-vs-mwmsloop`) runs the loop TensorFlow's MWMS guide gives: each worker's own batches through
`distribute_datasets_from_function`, `strategy.run` of a tape step whose loss is averaged over the
global batch, and the Keras optimizer's apply_gradients, which sums the gradients over the replicas
(TF's collective ops, gRPC between the processes). It lacks fit's per-step callbacks, so it flatters
the peer, if anything.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.keras_training import _dataset, _keras, _model
from testbed.children import Children

MWMS = "tf.distribute.MultiWorkerMirroredStrategy x W (custom loop)"


def _ports(count: int) -> list[int]:
    """Ports free now on 127.0.0.1 (bound, read, closed: TF's servers bind them a moment later)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _mwms_worker(rank: int, ports: list[int], data: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]],
                 args: argparse.Namespace, gate: Any) -> dict[str, Any]:
    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                                          "task": {"type": "worker", "index": rank}})
    keras = _keras()
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = _model(keras, keras.optimizers.SGD(0.05, momentum=0.9))
    batches = data(rank, args.workers)
    batch, size = args.batch_size, args.workers
    dataset = strategy.distribute_datasets_from_function(lambda _context: _dataset(batches, batch))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def one_step(batches: Any) -> Any:
        def replica(x: Any, y: Any) -> Any:
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(loss_fn(y, model(x, training=True)), global_batch_size=batch * size)
            grads = tape.gradient(loss, model.trainable_variables)
            model.optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            return loss

        return strategy.reduce("SUM", strategy.run(replica, args=next(batches)), axis=None)

    step = tf.function(one_step)

    batches = iter(dataset)
    for _ in range(max(args.warmup, 1)):  # the trace is never timed
        loss = step(batches)
    seconds = []
    for _ in range(args.repeats):
        gate.wait(args.timeout)
        started = time.perf_counter()
        for _ in range(args.steps):
            loss = step(batches)
        float(loss)  # the last step has finished
        gate.wait(args.timeout)
        seconds.append(time.perf_counter() - started)
    gate.wait(args.timeout)  # no worker leaves while another still needs it
    return {"seconds": seconds, "loss": float(loss)}


def measure_keras_mwms(data: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]],
                       args: argparse.Namespace) -> dict[str, Any]:
    """W processes training under MultiWorkerMirroredStrategy on the same batches as sluice.keras."""
    ports = _ports(args.workers)
    with Children() as children:
        gate = children.barrier(args.workers)
        for rank in range(args.workers):
            children.start(f"rank {rank}", _mwms_worker, rank, ports, data, args, gate)
        results = children.collect([f"rank {r}" for r in range(args.workers)], args.timeout)
    out: dict[str, Any] = results["rank 0"]
    return out
