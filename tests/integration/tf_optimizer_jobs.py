"""The worker function of sluice.tensorflow's optimizer test: DistributedOptimizer, PartialDistributedGradientTape,
SyncBatchNormalization, their argument errors and their rank disagreements, on forked workers (TF imported there).

Each result is checked against one process computing the same thing on the whole (concatenated) batch, in
the same worker without Sluice; after every error an allreduce must give the right sum on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from tests.integration.tf_error_jobs import _raised
from tests.integration.tf_jobs import LR, STEPS, _loss, _mlp, _tf, data, shard


def _batches(rank: int, size: int, distributed: bool) -> list[tuple[np.ndarray, np.ndarray]]:
    x, y = data()
    if distributed:
        x, y = shard(x, rank, size), shard(y, rank, size)
    per = len(x) // STEPS
    return [(x[k * per: (k + 1) * per], y[k * per: (k + 1) * per]) for k in range(STEPS)]


def _legacy_training(tf: Any, hvd: Any, rank: int, size: int) -> tuple[list[list[Any]], list[Any]]:
    """STEPS of TF1 momentum SGD on the MLP in a tf.function (minimize); with hvd through DistributedOptimizer
    (the predivide factor split, which must not change the average)."""
    weights = _mlp(tf)
    opt = tf.compat.v1.train.MomentumOptimizer(LR, 0.9)
    if hvd is not None:
        opt = hvd.DistributedOptimizer(opt, gradient_predivide_factor=2.0)

    def minimize(xb: Any, yb: Any) -> None:
        opt.minimize(lambda: _loss(tf, weights, xb, yb), var_list=weights)

    step = tf.function(minimize)
    for xb, yb in _batches(rank, size, hvd is not None):
        step(tf.constant(xb), tf.constant(yb))
    facts = [isinstance(opt, tf.compat.v1.train.Optimizer), opt.get_slot_names(), len(opt.variables())]
    return [w.numpy().tolist() for w in weights], facts


def _legacy_eager(tf: Any, hvd: Any, rank: int) -> dict[str, Any]:
    """Eager compute_gradients (a callable loss) with op=Sum, and a local variable, scaled and not."""
    shared, local = tf.Variable([1.0, 1.0]), tf.Variable([1.0])
    out: dict[str, Any] = {}
    for scale in (True, False):
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0), op=hvd.Sum,
                                       scale_local_gradients=scale)
        opt.register_local_var(local)
        pairs = opt.compute_gradients(lambda: tf.reduce_sum((shared + local) * float(rank + 1)), [shared, local])
        out[f"scale_{scale}"] = [g.numpy().tolist() for g, _ in pairs]
    opt.apply_gradients(pairs)
    out["applied"] = [shared.numpy().tolist(), local.numpy().tolist()]
    return out


def _aggregation(tf: Any, hvd: Any, rank: int) -> dict[str, Any]:
    """Horovod's test_local_gradient_aggregation(_sparse), in a TF1 graph and session: backward_passes_per_step=4,
    average_aggregated_gradients; the variable steps by the workers' mean gradient once every 4 passes."""
    with tf.Graph().as_default():
        dense, sparse = tf.Variable([0.0]), tf.Variable([0.0, 0.0])
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(-1.0),
                                       backward_passes_per_step=4, average_aggregated_gradients=True,
                                       sparse_as_dense=True)
        loss = tf.reduce_sum(dense * float(rank)) + tf.reduce_sum(tf.gather(sparse, [1]) * float(rank + 1))
        pairs = opt.compute_gradients(loss, [dense, sparse])
        global_step = tf.compat.v1.get_variable("test_global_step", initializer=tf.constant(0, tf.int64),
                                                trainable=False)
        with tf.control_dependencies([g for g, _ in pairs]):
            before = global_step + 0
        with tf.control_dependencies([before]):
            update = opt.apply_gradients(pairs, global_step=global_step)
        seen: list[list[float]] = []
        steps = []
        with tf.compat.v1.Session() as session:
            session.run([tf.compat.v1.global_variables_initializer(), tf.compat.v1.local_variables_initializer()])
            for _ in range(10):
                step, _ = session.run((before, update))
                steps.append(int(step))
                seen.append([float(v) for v in session.run(dense)] + [float(v) for v in session.run(sparse)])
    return {"values": seen, "steps": steps}


def _partial_tape(tf: Any, keras: Any, hvd: Any, rank: int, size: int) -> dict[str, Any]:
    """PartialDistributedGradientTape with the first layer local, against the whole batch's gradients (the
    shared layer: their average) and this shard's (the local layer: divided by the size, or not)."""
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(4)])
    (x, y), = _batches(0, 1, False)[:1]
    mine = slice(rank * len(x) // size, (rank + 1) * len(x) // size)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def grads(rows: slice, wrap: Callable[[Any], Any] | None = None) -> Any:
        with tf.GradientTape() as tape:
            loss = loss_fn(y[rows], model(x[rows], training=True))
        tape = wrap(tape) if wrap is not None else tape
        return tape, loss, [g.numpy() for g in tape.gradient(loss, model.trainable_weights)]

    out: dict[str, Any] = {"whole": [g.tolist() for g in grads(slice(None))[2]],
                           "own": [g.tolist() for g in grads(mine)[2]]}
    for scale in (True, False):
        def partial(tape: Any, scale: bool = scale) -> Any:
            return hvd.PartialDistributedGradientTape(tape, local_layers=model.layers[0],
                                                      scale_local_gradients=scale)

        out[f"partial_{scale}"] = [g.tolist() for g in grads(mine, partial)[2]]
    with tf.GradientTape(persistent=True) as tape:
        loss = loss_fn(y[mine], model(x[mine], training=True))
    tape = hvd.PartialDistributedGradientTape(tape, local_layers=[model.layers[0]])
    local, shared = tape.get_local_and_global_gradients(loss, model.trainable_weights)
    out["split"] = [[v.path for v, _ in local], [v.path for v, _ in shared]]
    out["layer_paths"] = [v.path for v in model.trainable_weights]
    return out


def _bn_case(tf: Any, keras: Any, hvd: Any, rank: int, size: int, graph: bool, masked: bool) -> dict[str, Any]:
    """SyncBatchNormalization on this rank's rows (rank r holds 3 + 2r) against BatchNormalization on all rows:
    outputs, moving statistics after two steps, input gradients and (summed over the ranks) gamma's and beta's."""
    rng = np.random.default_rng(4)
    counts = [3 + 2 * r for r in range(size)]
    start, stop = sum(counts[:rank]), sum(counts[: rank + 1])
    x = rng.standard_normal((sum(counts), 3, 4)) * 2.0 + 1.0
    weights = rng.standard_normal(x.shape)
    mask = rng.random(x.shape[:2]) > 0.3 if masked else None
    reference = keras.layers.BatchNormalization(momentum=0.5, dtype="float64")
    sync = hvd.SyncBatchNormalization(momentum=0.5, dtype="float64")

    def run(layer: Any, rows: slice, distributed: bool) -> list[Any]:
        inputs = tf.constant(x[rows])
        with tf.GradientTape() as tape:
            tape.watch(inputs)
            kwargs = {"mask": tf.constant(mask[rows])} if mask is not None else {}
            out = layer(inputs, training=True, **kwargs)
            loss = tf.reduce_sum(out * weights[rows])
        if distributed:  # gamma's and beta's gradients summed over the ranks; the inputs' stay this rank's own
            tape = hvd.DistributedGradientTape(tape, op=hvd.Sum, scale_local_gradients=False)
            tape.register_local_source(inputs)
        grads = tape.gradient(loss, [inputs, layer.gamma, layer.beta])
        return [out, *grads]

    def twice(layer: Any, rows: slice, distributed: bool) -> list[Any]:
        def once() -> list[Any]:
            return run(layer, rows, distributed)

        step = tf.function(once) if graph else once
        step()  # traced once, run twice
        return [t.numpy().tolist() for t in step()] + [
            layer.moving_mean.numpy().tolist(), layer.moving_variance.numpy().tolist()]

    want = twice(reference, slice(None), False)
    want[0], want[1] = (np.array(want[0])[start:stop].tolist(), np.array(want[1])[start:stop].tolist())
    return {"got": twice(sync, slice(start, stop), True), "want": want}


def _arguments(tf: Any, keras: Any, hvd: Any) -> dict[str, str]:
    """Horovod's argument errors (ValueError), raised by every rank at the call, before any collective."""
    def legacy() -> Any:
        return tf.compat.v1.train.GradientDescentOptimizer(0.1)

    with tf.GradientTape() as tape:
        pass
    return {
        "optimizer_predivide_sum": _raised(lambda: hvd.DistributedOptimizer(legacy(), op=hvd.Sum,
                                                                            gradient_predivide_factor=2.0)),
        "keras_predivide_sum": _raised(lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd.Sum,
                                                                        gradient_predivide_factor=2.0)),
        "tape_predivide_sum": _raised(lambda: hvd.DistributedGradientTape(tape, op=hvd.Sum,
                                                                          gradient_predivide_factor=0.5)),
        "groups_negative": _raised(lambda: hvd.DistributedOptimizer(legacy(), groups=-1)),
        "num_groups_negative": _raised(lambda: hvd.PartialDistributedGradientTape(tape, num_groups=-2)),
        "op_min": _raised(lambda: hvd.DistributedOptimizer(legacy(), op=hvd.Min)),
        "passes_eager": _raised(lambda: hvd.DistributedOptimizer(legacy(), backward_passes_per_step=2)),
        "passes_zero": _raised(lambda: hvd.DistributedOptimizer(legacy(), backward_passes_per_step=0)),
        "local_layers": _raised(lambda: hvd.PartialDistributedGradientTape(tape, local_layers=["dense"])),
        "fused": _raised(lambda: hvd.SyncBatchNormalization(fused=True)),
        "fused_none": _raised(lambda: hvd.SyncBatchNormalization(fused=None)),
    }


def _disagreements(tf: Any, hvd: Any, rank: int) -> dict[str, list[Any]]:
    """Ranks whose gradients or batch-norm channels differ: every rank fails at the same call (eager:
    FailedPreconditionError; in a tf.function: UnknownError), and then an allreduce gives the right sum."""
    # a name no earlier gradient had; sizes that differ after the fusion buffer's 64-byte alignment
    variable = tf.Variable(tf.ones([2 + 30 * rank]), name="disagreeing")
    opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1))

    def step() -> None:
        opt.apply_gradients(opt.compute_gradients(tf.reduce_sum(variable), [variable]))

    traced = tf.function(step)
    layer = hvd.SyncBatchNormalization()
    cases: dict[str, Callable[[], Any]] = {
        "optimizer_shapes": lambda: opt.compute_gradients(lambda: tf.reduce_sum(variable * 2.0), [variable]),
        "optimizer_shapes_traced": traced,
        "sync_bn_channels": lambda: layer(tf.ones([2, 3 + rank]), training=True),
    }
    out: dict[str, list[Any]] = {}
    for case, call in cases.items():
        raised = _raised(call)
        after = hvd.allreduce(tf.fill([2], float(rank + 1)), op=hvd.Sum).numpy().tolist()
        out[case] = [raised, after]
    return out


def tf_optimizers() -> dict[str, Any]:
    tf = _tf()
    import keras

    import sluice.tensorflow as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    out: dict[str, Any] = {}
    out["legacy_reference"], _ = _legacy_training(tf, None, rank, size)
    out["legacy"], out["legacy_facts"] = _legacy_training(tf, hvd, rank, size)
    out["legacy_eager"] = _legacy_eager(tf, hvd, rank)
    out["aggregation"] = _aggregation(tf, hvd, rank)
    keras_opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0))
    variable = keras.Variable([0.0, 0.0])
    keras_opt.apply_gradients([(tf.fill([2], float(rank + 1)), variable)])
    out["keras"] = [isinstance(keras_opt, keras.optimizers.SGD), type(keras_opt).__module__,
                    variable.numpy().tolist()]
    out["partial"] = _partial_tape(tf, keras, hvd, rank, size)
    out["sync_bn"] = {f"{'graph' if graph else 'eager'}{'_masked' if masked else ''}":
                      _bn_case(tf, keras, hvd, rank, size, graph, masked)
                      for graph, masked in ((False, False), (True, False), (False, True))}
    out["arguments"] = _arguments(tf, keras, hvd)
    out["disagreements"] = _disagreements(tf, hvd, rank)
    hvd.shutdown()
    return out
