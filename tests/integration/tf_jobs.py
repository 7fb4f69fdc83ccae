"""Worker functions for the TensorFlow and Keras shims' tests, run in forked workers (TF is imported there only).

Training runs compare N workers, each on its shard of every global batch, with one process on the
whole batch (computed in the same worker, without Sluice): a small MLP, SGD, a few steps.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

STEPS, BATCH, FEATURES, CLASSES, LR = 6, 16, 8, 4, 0.1


def _tf() -> Any:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    return tf


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((STEPS * BATCH, FEATURES)).astype(np.float32)
    return x, (x[:, :CLASSES].argmax(1) + (x[:, 4] > 1)).astype(np.int64) % CLASSES


def shard(array: np.ndarray, rank: int, size: int) -> np.ndarray:
    """Rank's rows of every global batch, in order: fit(batch_size=BATCH // size, shuffle=False) sees them."""
    per = BATCH // size
    return np.concatenate([array[k * BATCH + rank * per: k * BATCH + (rank + 1) * per] for k in range(STEPS)])


# ---------------------------------------------------------------------------- sluice.tensorflow
def _mlp(tf: Any) -> list[Any]:
    rng = np.random.default_rng(1)
    shapes = {"w1": (FEATURES, 16), "b1": (16,), "w2": (16, CLASSES), "b2": (CLASSES,)}
    return [tf.Variable(rng.standard_normal(s).astype(np.float32) * 0.5, name=n) for n, s in shapes.items()]


def _loss(tf: Any, weights: list[Any], x: Any, y: Any) -> Any:
    w1, b1, w2, b2 = weights
    logits = tf.nn.relu(x @ w1 + b1) @ w2 + b2
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))


def _tape_training(tf: Any, hvd: Any, rank: int, size: int, graph: bool) -> list[np.ndarray]:
    """STEPS of SGD on the MLP; with hvd, each worker on its shard through DistributedGradientTape."""
    x, y = data()
    if hvd is not None:
        x, y = shard(x, rank, size), shard(y, rank, size)
    per = len(x) // STEPS
    weights = _mlp(tf)

    def step(xb: Any, yb: Any) -> None:
        with tf.GradientTape() as tape:
            loss = _loss(tf, weights, xb, yb)
        if hvd is not None:
            tape = hvd.DistributedGradientTape(tape)
        for w, g in zip(weights, tape.gradient(loss, weights), strict=True):
            w.assign_sub(LR * g)

    run = tf.function(step) if graph else step
    for k in range(STEPS):
        run(tf.constant(x[k * per: (k + 1) * per]), tf.constant(y[k * per: (k + 1) * per]))
    return [w.numpy() for w in weights]


def tensorflow_api() -> dict[str, Any]:
    """The collectives' values, DistributedGradientTape training (eager and in a tf.function) with its
    single-process reference, and what XLA gets."""
    tf = _tf()
    import sluice.tensorflow as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    out: dict[str, Any] = {"placement": [hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()],
                           "initialized": hvd.is_initialized()}
    base = tf.range(6, dtype=tf.float32) + rank
    out["average"] = hvd.allreduce(base).numpy().tolist()
    out["sum"] = hvd.allreduce(base, op=hvd.Sum, name="sum").numpy().tolist()
    out["scaled"] = hvd.allreduce(base, prescale_factor=3.0, postscale_factor=0.5, name="scaled").numpy().tolist()
    out["int_sum"] = hvd.allreduce(tf.constant([1, 2]) * (rank + 1), op=hvd.Sum).numpy().tolist()
    out["fp16"] = hvd.allreduce(base, compression=hvd.Compression.fp16).numpy().dtype.name
    grouped = hvd.grouped_allreduce([tf.ones(2) * rank, tf.ones((2, 2), tf.float64) * (rank + 1)], op=hvd.Sum)
    out["grouped"] = [g.numpy().tolist() for g in grouped]
    out["allgather"] = hvd.allgather(tf.fill([rank + 1, 2], rank)).numpy().tolist()
    out["broadcast"] = hvd.broadcast(tf.fill([3], float(rank)), root_rank=size - 1).numpy().tolist()

    @tf.function
    def in_graph(x: Any) -> Any:
        return hvd.allreduce(x, op=hvd.Sum), hvd.allgather(x), hvd.broadcast(x, root_rank=0)

    out["in_graph"] = [[t.numpy().tolist() for t in in_graph(tf.fill([2], float(rank)))] for _ in range(2)]
    variables = [tf.Variable(tf.fill([3], float(rank))), tf.Variable([rank, rank])]
    hvd.broadcast_variables(variables, root_rank=1)
    out["broadcast_variables"] = [v.numpy().tolist() for v in variables]
    in_fn = tf.Variable(tf.fill([2], float(rank)))
    tf.function(lambda: hvd.broadcast_variables([in_fn], root_rank=0))()
    out["broadcast_variables_in_graph"] = in_fn.numpy().tolist()

    w = tf.Variable([[1.0, 2.0]])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * float(rank + 1))
    tape = hvd.DistributedGradientTape(tape, compression=hvd.Compression.fp16)
    out["tape_isinstance"] = isinstance(tape, tf.GradientTape)
    out["tape_fp16"] = tape.gradient(loss, [w])[0].numpy().tolist()  # mean of (r + 1), as float32 again

    out["reference"] = [a.tolist() for a in _tape_training(tf, None, rank, size, graph=False)]
    out["eager"] = [a.tolist() for a in _tape_training(tf, hvd, rank, size, graph=False)]
    out["graph"] = [a.tolist() for a in _tape_training(tf, hvd, rank, size, graph=True)]

    @tf.function(jit_compile=True)
    def compiled(x: Any) -> Any:
        return hvd.allreduce(x)

    try:
        compiled(base)
        out["xla"] = "no error"
    except Exception as exc:
        out["xla"] = str(exc)
    from sluice.worker.tensorflow.state import require

    out["steps_timed"] = require().step_times.count  # the Prometheus endpoint's sluice_step_seconds
    hvd.barrier()
    hvd.shutdown()
    out["initialized_after"] = hvd.is_initialized()
    return out


def tape_training_only() -> dict[str, Any]:
    """The tape's training alone (e.g. through the servers), with its reference."""
    tf = _tf()
    import sluice.tensorflow as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    from sluice.worker.tensorflow.gradients import _REDUCERS

    out = {"reference": [a.tolist() for a in _tape_training(tf, None, rank, size, graph=False)],
           "graph": [a.tolist() for a in _tape_training(tf, hvd, rank, size, graph=True)],
           "routes": sorted({s.route for reducer, _ in _REDUCERS.values() for s in reducer.sets})}
    hvd.shutdown()
    return out
