"""The worker function of the TensorFlow and Keras process-set test (3 workers): Horovod's static and dynamic
sets, the collectives on a set (eager and traced), a DistributedGradientTape and a Keras DistributedOptimizer
of a set, and a set's error followed by collectives that succeed."""

from __future__ import annotations

from typing import Any

import numpy as np


def tf_process_sets() -> dict[str, Any]:
    import os

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    import sluice.tensorflow as hvd

    static = hvd.ProcessSet([0, 2])
    hvd.init(process_sets=[static])
    rank, out = hvd.rank(), {}
    odd = hvd.add_process_set([1])
    mine = static if rank != 1 else odd
    out["ids"] = [static.process_set_id, odd.process_set_id, int(hvd.size_op(static.process_set_id)),
                  int(hvd.process_set_included_op(static.process_set_id))]
    value = tf.fill([3], float(rank + 1))
    out["sum"] = hvd.allreduce(value, op=hvd.Sum, process_set=mine).numpy().tolist()
    out["average"] = hvd.allreduce(value, process_set=mine).numpy().tolist()
    traced = tf.function(lambda t: hvd.allreduce(t, op=hvd.Sum, process_set=mine))
    out["traced"] = [traced(value).numpy().tolist() for _ in range(2)]
    out["allgather"] = hvd.allgather(tf.fill([rank + 1], rank), process_set=mine).numpy().tolist()
    out["broadcast"] = hvd.broadcast(tf.fill([2], float(rank)), mine.ranks[-1], process_set=mine).numpy().tolist()
    out["alltoall"] = hvd.alltoall(tf.range(mine.size() * 2) + 10 * rank, process_set=mine).numpy().tolist()
    out["reducescatter"] = hvd.reducescatter(tf.ones([4, 1]) * (rank + 1), op=hvd.Sum,
                                             process_set=mine).numpy().tolist()
    hvd.barrier(process_set=mine)
    # unnamed calls on the odd set alone must not move the job's names
    if rank == 1:
        for _ in range(3):
            hvd.allreduce(tf.ones([1]), process_set=odd)
    out["job"] = hvd.allreduce(tf.ones([2]), op=hvd.Sum).numpy().tolist()
    if rank != 1:  # an error inside the set: both members raise, the set and the job go on
        try:
            hvd.allreduce(tf.ones([2 + rank]), process_set=static)
            out["set_error"] = "ok"
        except tf.errors.FailedPreconditionError as exc:
            out["set_error"] = f"FailedPreconditionError: {exc.message}"
        out["after_error"] = hvd.allreduce(tf.ones([2]), op=hvd.Sum, process_set=static).numpy().tolist()
    # a tape of the set, eager and traced: the gradient of the set's batches
    w = tf.Variable(tf.ones([2, 1]))
    x = tf.fill([1, 2], float(rank + 1))

    def tape_grad() -> Any:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.matmul(x, w))
        return hvd.DistributedGradientTape(tape, process_set=static).gradient(loss, [w])[0]

    out["tape"] = tape_grad().numpy().reshape(-1).tolist()
    out["tape_traced"] = tf.function(tape_grad)().numpy().reshape(-1).tolist()
    # Keras: one fit of a linear model through a DistributedOptimizer of the set
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, kernel_initializer="ones")])
    import sluice.keras as khvd

    model.compile(optimizer=khvd.DistributedOptimizer(keras.optimizers.SGD(0.1), process_set=static), loss="mse")
    data = np.full((4, 2), float(rank + 1), np.float32)
    model.fit(data, np.zeros((4, 1), np.float32), batch_size=4, epochs=2, verbose=0, shuffle=False)
    out["keras"] = [float(v) for v in np.concatenate([np.ravel(v) for v in model.get_weights()])]
    out["removed"] = hvd.remove_process_set(odd)
    out["last"] = hvd.allreduce(tf.ones([1]), op=hvd.Sum).numpy().tolist()
    hvd.shutdown()
    return out


def keras_reference(ranks: list[int]) -> list[float]:
    """The same two steps in one process, each gradient the average of `ranks`' batches' gradients."""
    w, b = np.ones(2), 0.0
    for _ in range(2):
        gw, gb = np.zeros(2), 0.0
        for r in ranks:
            x = np.full(2, float(r + 1))
            err = 2 * (x @ w + b)  # mse of a batch of equal rows, against 0
            gw, gb = gw + err * x / len(ranks), gb + err / len(ranks)
        w, b = w - 0.1 * gw, b - 0.1 * gb
    return [*w.tolist(), b]
