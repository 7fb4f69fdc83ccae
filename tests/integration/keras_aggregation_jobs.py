"""The worker function of sluice.keras's optimizer options test: backward passes, local layers, errors, overlap.

Run in forked workers (TF and Keras are imported there only). Every check compares with one process
on the whole batches, computed in the same worker without Sluice, or with values written out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from tests.integration.keras_jobs import _compile, _model, _weights
from tests.integration.tf_jobs import BATCH, LR, STEPS, _tf, data, shard

PASSES = 3  # backward passes per step: STEPS = 6 passes make two updates


def _raised(call: Callable[[], Any]) -> str:
    try:
        call()
    except Exception as exc:
        return type(exc).__name__ + ("(ValueError)" if isinstance(exc, ValueError) else "")
    return "no error"


def _accumulated_reference(tf: Any, keras: Any, x: np.ndarray, y: np.ndarray, passes: int, average: bool,
                           seed: int) -> list[list[Any]]:
    """One process, whole batches: each `passes` passes' gradients summed (or averaged), then one SGD step."""
    model, optimizer = _model(keras, seed), keras.optimizers.SGD(LR, momentum=0.5)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    per, total = len(x) // STEPS, None
    for k in range(STEPS):
        with tf.GradientTape() as tape:
            loss = loss_fn(y[k * per: (k + 1) * per], model(x[k * per: (k + 1) * per], training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        total = grads if total is None else [a + b for a, b in zip(total, grads, strict=True)]
        if (k + 1) % passes == 0:
            optimizer.apply_gradients(zip([g / passes if average else g for g in total], model.trainable_variables,
                                          strict=True))
            total = None
    return _weights(model)


def _aggregation(tf: Any, keras: Any, hvd: Any, rank: int, size: int) -> dict[str, Any]:
    """backward_passes_per_step=3 through model.fit (traced, summed) and a custom loop (eager, averaged)."""
    x, y = data()
    xs, ys = shard(x, rank, size), shard(y, rank, size)
    out: dict[str, Any] = {}
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(LR, momentum=0.5), backward_passes_per_step=PASSES)
    model = _compile(keras, _model(keras, 31), optimizer)
    model.fit(xs, ys, batch_size=BATCH // size, epochs=1, shuffle=False, verbose=0)
    out["fit"], out["fit_iterations"] = _weights(model), int(optimizer.iterations.numpy())
    out["fit_reference"] = _accumulated_reference(tf, keras, x, y, PASSES, False, 31)

    model = _model(keras, 32)
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(LR, momentum=0.5), backward_passes_per_step=PASSES,
                                         average_aggregated_gradients=True)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    per = len(xs) // STEPS
    for k in range(STEPS):
        with tf.GradientTape() as tape:
            loss = loss_fn(ys[k * per: (k + 1) * per], model(xs[k * per: (k + 1) * per], training=True))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables,
                                      strict=True))
        if k == 1:  # after two passes of three: nothing applied yet
            out["loop_unchanged"] = _weights(model) == _weights(_model(keras, 32))
    out["loop"], out["loop_iterations"] = _weights(model), int(optimizer.iterations.numpy())
    out["loop_reference"] = _accumulated_reference(tf, keras, x, y, PASSES, True, 32)

    # a non-finite gradient spoils its own update only: the next passes accumulate from zeros (traced)
    variable = tf.Variable([0.0, 0.0])
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), backward_passes_per_step=2)

    def _step(grad: Any) -> None:
        optimizer.apply_gradients([(grad, variable)])

    step: Any = tf.function(_step)
    step(tf.constant([np.inf, 1.0]))
    step(tf.constant([1.0, 1.0]))
    spoiled = variable.numpy().tolist()
    variable.assign([0.0, 0.0])
    step(tf.constant([1.0 + rank, 2.0]))
    step(tf.constant([3.0, 4.0 * (rank + 1)]))
    out["non_finite"] = [spoiled, variable.numpy().tolist(), int(optimizer.iterations.numpy())]
    return out


def _partial(tf: Any, keras: Any, hvd: Any, rank: int, size: int) -> dict[str, Any]:
    """PartialDistributedOptimizer with the first layer local: eagerly, one step; through model.fit with two
    passes per step, averaged; each against the gradients of this shard and of the whole batch."""
    x, y = data()
    xs, ys = shard(x, rank, size), shard(y, rank, size)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def gradients(model: Any, xb: np.ndarray, yb: np.ndarray) -> list[np.ndarray]:
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        return [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]

    out: dict[str, Any] = {}
    model = _model(keras, 41)
    before = [w.copy() for w in model.get_weights()]
    own, whole = gradients(model, xs[:BATCH // size], ys[:BATCH // size]), gradients(model, x[:BATCH], y[:BATCH])
    optimizer = hvd.PartialDistributedOptimizer(keras.optimizers.SGD(1.0), local_layers=model.layers[0])
    optimizer.apply_gradients(zip([tf.constant(g) for g in own], model.trainable_variables, strict=True))
    applied = [(b - a).tolist() for b, a in zip(before, model.get_weights(), strict=True)]
    out["eager"] = [applied, [(g / size).tolist() for g in own[:2]] + [g.tolist() for g in whole[2:]]]

    model = _model(keras, 42)
    before = [w.copy() for w in model.get_weights()]
    halves = [slice(k * BATCH // size, (k + 1) * BATCH // size) for k in range(2)]
    own_sums: list[Any] = [sum(g) for g in zip(*(gradients(model, xs[h], ys[h]) for h in halves), strict=True)]
    whole_sums: list[Any] = [sum(g) for g in zip(*(gradients(model, x[k * BATCH: (k + 1) * BATCH],
                                                             y[k * BATCH: (k + 1) * BATCH]) for k in range(2)),
                                                 strict=True)]
    optimizer = hvd.PartialDistributedOptimizer(keras.optimizers.SGD(LR), local_layers=[model.layers[0]],
                                                backward_passes_per_step=2, average_aggregated_gradients=True)
    _compile(keras, model, optimizer).fit(xs[:BATCH], ys[:BATCH], batch_size=BATCH // size, shuffle=False, verbose=0)
    applied = [((b - a) / LR).tolist() for b, a in zip(before, model.get_weights(), strict=True)]
    out["fit"] = [applied, [(g / size / 2).tolist() for g in own_sums[:2]] + [(g / 2).tolist() for g in whole_sums[2:]]]
    return out


def _errors(tf: Any, keras: Any, hvd: Any, rank: int) -> dict[str, Any]:
    """Horovod's refusals, and ranks that disagree inside a traced step; each followed by a collective."""
    sgd = keras.optimizers.SGD
    out: dict[str, Any] = {
        "passes_zero": _raised(lambda: hvd.DistributedOptimizer(sgd(0.1), backward_passes_per_step=0)),
        "op_min": _raised(lambda: hvd.DistributedOptimizer(sgd(0.1), op=hvd.Adasum)),
        "local_layers": _raised(lambda: hvd.PartialDistributedOptimizer(sgd(0.1), local_layers=["dense"])),
        "wrapped_twice": _raised(lambda: hvd.DistributedOptimizer(hvd.DistributedOptimizer(sgd(0.1)))),
    }
    embedding = keras.Sequential([keras.Input((2,), dtype="int32"), keras.layers.Embedding(5, 3)])
    optimizer = hvd.DistributedOptimizer(sgd(0.1), backward_passes_per_step=2)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(embedding(tf.constant([[1, 2]])))
    grads = tape.gradient(loss, embedding.trainable_variables)
    out["sparse_passes"] = _raised(lambda: optimizer.apply_gradients(
        zip(grads, embedding.trainable_variables, strict=True)))
    out["after_sparse"] = hvd.allreduce(tf.constant([1.0 + rank]), average=False).numpy().tolist()

    # the ranks' gradients disagree in shape: the traced step fails on every rank; the next ones run
    optimizer = hvd.DistributedOptimizer(sgd(0.1))
    odd = tf.Variable(tf.zeros([2 + 38 * rank]))

    def _disagree() -> None:
        optimizer.apply_gradients([(tf.ones_like(odd), odd)])

    disagree: Any = tf.function(_disagree)
    out["disagree"] = _raised(disagree)
    out["after_disagree"] = hvd.allreduce(tf.constant([1.0 + rank]), average=False).numpy().tolist()
    even = tf.Variable(tf.zeros([3]))
    other = hvd.DistributedOptimizer(sgd(1.0))

    def _agree() -> None:
        other.apply_gradients([(tf.ones_like(even) * (rank + 1), even)])

    agree: Any = tf.function(_agree)
    agree()
    out["agree_after"] = even.numpy().tolist()
    return out


def _overlap(tf: Any, keras: Any, hvd: Any) -> dict[str, Any]:
    """The traced step's graph: one send per fused group, fed by that group's gradients only, and one wait."""
    model = _model(keras, 51)
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(LR))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    made: list[Any] = []

    def _step(xb: Any, yb: Any) -> None:
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        made.extend(grads)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))

    step: Any = tf.function(_step)
    x, y = data()
    graph = step.get_concrete_function(tf.TensorSpec([None, x.shape[1]], tf.float32),
                                       tf.TensorSpec([None], tf.int64)).graph
    sends = [op for op in graph.get_operations() if op.type == "PyFunc" and "gradient_send" in op.name]
    waits = [op for op in graph.get_operations() if op.type == "PyFunc" and "gradient_wait" in op.name]

    def ancestors(op: Any) -> set[Any]:
        seen, todo = set(), [op]
        while todo:
            current = todo.pop()
            for parent in [t.op for t in current.inputs] + list(current.control_inputs):
                if parent not in seen:
                    seen.add(parent)
                    todo.append(parent)
        return seen

    first = ancestors(sends[0])
    step(x[:BATCH], y[:BATCH])  # and it runs
    return {"sends": len(sends), "waits": len(waits),
            "first_needs_last_layer": made[-1].op in first, "first_needs_first_layer": made[0].op in first}


def keras_optimizer_options() -> dict[str, Any]:
    tf = _tf()
    import keras

    import sluice.keras as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    out = {"aggregation": _aggregation(tf, keras, hvd, rank, size), "partial": _partial(tf, keras, hvd, rank, size),
           "errors": _errors(tf, keras, hvd, rank), "overlap": _overlap(tf, keras, hvd)}
    hvd.shutdown()
    return out
