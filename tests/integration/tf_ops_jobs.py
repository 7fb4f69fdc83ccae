"""The worker function of sluice.tensorflow's added collectives test, run in forked workers (TF imported there only).

One job covers alltoall, reducescatter, grouped_reducescatter, grouped_allgather, allgather_object,
broadcast_object, broadcast_object_fn, op=Adasum and tf.IndexedSlices (allreduce, grouped_allreduce and
DistributedGradientTape's sparse_as_dense): values eagerly and in a tf.function, a gradient per op,
and error cases from Horovod's test_tensorflow.py, each followed by a collective that must succeed on
every rank. Values are returned as lists; tests/integration/test_tensorflow_ops.py checks them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

#: the dtypes Adasum is checked on, with the vectors' length
ADASUM_DTYPES, ADASUM_LENGTH = ("float16", "bfloat16", "float32", "float64"), 7


def adasum_vector(rank: int, index: int) -> np.ndarray:
    """Rank's `index`th vector for the Adasum checks (the test recomputes the formula from it)."""
    return np.random.default_rng(10 * rank + index).standard_normal(ADASUM_LENGTH)


def _raised(call: Callable[[], Any]) -> str:
    import tensorflow as tf

    try:
        call()
    except tf.errors.FailedPreconditionError:
        return "FailedPreconditionError"
    except tf.errors.InvalidArgumentError:
        return "InvalidArgumentError"
    except tf.errors.UnknownError:
        return "UnknownError"
    except NotImplementedError:
        return "NotImplementedError"
    except TypeError:
        return "TypeError"
    except ValueError:
        return "ValueError"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def _lists(values: Any) -> Any:
    return [v.numpy().tolist() for v in values]


def _alltoall(tf: Any, hvd: Any, rank: int, size: int) -> dict[str, Any]:
    rows = tf.constant([[i, i] for i in range(size) for _ in range(rank + 1)], tf.float32)
    out: dict[str, Any] = {}
    collected, received = hvd.alltoall(rows, [rank + 1] * size)
    out["alltoall"] = [collected.numpy().tolist(), received.numpy().tolist()]
    out["alltoall_equal"] = hvd.alltoall(tf.range(2 * size) + 10 * rank).numpy().tolist()  # no splits: a tensor
    traced = tf.function(lambda x, s: hvd.alltoall(x, s))
    out["alltoall_traced"] = [_lists(traced(rows, tf.constant([rank + 1] * size))) for _ in range(2)]
    x = tf.Variable(tf.range(3 * size, dtype=tf.float64))  # the last `size` rows are not sent
    with tf.GradientTape() as tape:
        got, _ = hvd.alltoall(x, [2] * size)
        loss = tf.reduce_sum(got * tf.cast(tf.range(tf.shape(got)[0]) + 1, tf.float64))
    out["alltoall_grad"] = tape.gradient(loss, x).numpy().tolist()
    return out


def _reducescatter(tf: Any, hvd: Any, rank: int, size: int) -> dict[str, Any]:
    base = tf.reshape(tf.range(10, dtype=tf.float32), [5, 2]) * (rank + 1)  # 5 rows: 3 and 2 on two ranks
    out: dict[str, Any] = {"rs_sum": hvd.reducescatter(base, op=hvd.Sum).numpy().tolist(),
                           "rs_average": hvd.reducescatter(base).numpy().tolist(),
                           "rs_scaled": hvd.reducescatter(base, op=hvd.Sum, prescale_factor=2.0,
                                                          postscale_factor=0.25).numpy().tolist()}
    pair = [tf.ones([4]) * (rank + 1), tf.ones([3, 2], tf.float64) * rank]
    out["grouped_rs"] = _lists(hvd.grouped_reducescatter(pair, op=hvd.Sum))
    traced = tf.function(lambda a, b: [*hvd.grouped_reducescatter([a, b]), hvd.reducescatter(a, op=hvd.Sum)])
    out["rs_traced"] = [_lists(traced(*pair)) for _ in range(2)]
    for op in ("Sum", "Average"):
        v = tf.Variable(tf.ones([4, 2]))
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(hvd.reducescatter(v, op=getattr(hvd, op), postscale_factor=0.5) * (rank + 1))
        out[f"rs_grad_{op}"] = tape.gradient(loss, v).numpy().tolist()
    a, b = tf.Variable(tf.ones([3])), tf.Variable(tf.ones([2, 2], tf.float64))

    def grouped_grad() -> Any:
        with tf.GradientTape() as tape:
            ra, rb = hvd.grouped_reducescatter([a, b], op=hvd.Sum)
            loss = tf.reduce_sum(ra) + tf.cast(tf.reduce_sum(rb), tf.float32)
        return tape.gradient(loss, [a, b])

    out["grouped_rs_grad"] = _lists(tf.function(grouped_grad)())
    return out


def _grouped_allgather(tf: Any, hvd: Any, rank: int, size: int) -> dict[str, Any]:
    tensors = [tf.fill([rank + 1], float(rank)), tf.fill([1, 2], rank)]
    out: dict[str, Any] = {"gag": _lists(hvd.grouped_allgather(tensors))}
    traced = tf.function(lambda a, b: hvd.grouped_allgather([a, b]))
    out["gag_traced"] = [_lists(traced(*tensors)) for _ in range(2)]
    v = tf.Variable(tf.fill([rank + 1, 2], 1.0))
    with tf.GradientTape() as tape:
        (gathered,) = hvd.grouped_allgather([v])
        loss = tf.reduce_sum(gathered * tf.cast(tf.range(tf.shape(gathered)[0])[:, None] + 1, tf.float32))
    out["gag_grad"] = tape.gradient(loss, v).numpy().tolist()  # averaged, this rank's rows
    # the existing collectives' gradients (Horovod's): allreduce, allgather, broadcast
    w = tf.Variable([1.0, 2.0])

    def grads() -> Any:
        with tf.GradientTape(persistent=True) as tape:
            s = tf.reduce_sum(hvd.allreduce(w, op=hvd.Sum) * (rank + 1))
            m = tf.reduce_sum(hvd.allreduce(w * (rank + 1), op=hvd.Max))
            g = tf.reduce_sum(hvd.allgather(w) * (rank + 1))
            b = tf.reduce_sum(hvd.broadcast(w, root_rank=1) * (rank + 1))
        return [tape.gradient(t, w) for t in (s, m, g, b)]

    out["collective_grads"] = _lists(tf.function(grads)())
    return out


def _objects(tf: Any, hvd: Any, rank: int, size: int) -> dict[str, Any]:
    obj = {"rank": rank, "pair": (rank, "x"), "array": np.arange(3) * rank, "tensor": tf.ones([2], tf.bfloat16) * rank,
           "nested": [{"b": b"\x00\x01", "f": 0.5, "none": None}]}
    got = hvd.broadcast_object(obj, root_rank=1)
    out: dict[str, Any] = {"bo": [got["rank"], got["pair"], got["array"].tolist(),
                                  [got["tensor"].dtype.name, got["tensor"].numpy().astype(float).tolist()],
                                  got["nested"]]}
    gathered = hvd.allgather_object(obj)
    out["ago"] = [[o["pair"], o["array"].tolist(), o["tensor"].numpy().astype(float).tolist()] for o in gathered]
    fn = hvd.broadcast_object_fn(root_rank=0)
    out["bo_fn"] = [fn(f"call{i} from {rank}") for i in range(2)]
    out["bo_traced"] = int(tf.function(lambda: tf.constant(hvd.broadcast_object(rank * 10, root_rank=1)))())
    return out


def _adasum(tf: Any, hvd: Any, rank: int, size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for dtype in ADASUM_DTYPES:
        pair = [tf.cast(tf.constant(adasum_vector(rank, i)), dtype) for i in range(2)]
        single = hvd.allreduce(pair[0], op=hvd.Adasum)
        grouped = hvd.grouped_allreduce(pair, op=hvd.Adasum, prescale_factor=0.5, postscale_factor=2.0)
        out[f"adasum_{dtype}"] = [single.dtype.name] + [t.numpy().astype(float).tolist() for t in [single, *grouped]]
    traced = tf.function(lambda x: hvd.allreduce(x, op=hvd.Adasum))
    out["adasum_traced"] = [traced(tf.constant(adasum_vector(rank, 0))).numpy().tolist() for _ in range(2)]
    v = tf.Variable(tf.constant(adasum_vector(rank, 0)))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(hvd.allreduce(v, op=hvd.Adasum) * float(rank + 1))
    out["adasum_grad"] = tape.gradient(loss, v).numpy().tolist()  # Adasum of the (parallel) upstreams
    return out


def _sparse(tf: Any, hvd: Any, rank: int, size: int) -> dict[str, Any]:
    values = tf.stack([tf.constant([1.0, 2.0, 3.0])] * 2)
    slices = tf.IndexedSlices(values, tf.constant([rank, rank + 1]), dense_shape=tf.constant([size + 1, 3]))

    def dense(result: Any) -> list[Any]:
        return [type(result).__name__, tf.convert_to_tensor(result).numpy().tolist()]

    out: dict[str, Any] = {"sparse_sum": dense(hvd.allreduce(slices, op=hvd.Sum)),
                           "sparse_average": dense(hvd.allreduce(slices))}
    mixed = hvd.grouped_allreduce([tf.ones([2]) * rank, slices], op=hvd.Sum)
    out["sparse_grouped"] = [mixed[0].numpy().tolist(), dense(mixed[1])]
    out["sparse_traced"] = dense(tf.function(lambda: hvd.allreduce(slices))())
    table, w = tf.Variable(tf.ones([4, 2])), tf.Variable([1.0])
    ids = tf.constant([[0, 1], [1, 3]][rank])

    def tape_grads(sparse_as_dense: bool) -> Any:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(table, ids) * (rank + 1)) + tf.reduce_sum(w * rank)
        tape = hvd.DistributedGradientTape(tape, sparse_as_dense=sparse_as_dense)
        return tape.gradient(loss, [table, w])

    for as_dense in (False, True):
        g_table, g_w = tape_grads(as_dense)
        out[f"tape_sparse_as_dense_{as_dense}"] = [*dense(g_table), g_w.numpy().tolist()]
    # autograph=False: AutoGraph would convert the tape's own code (gradients.py) for seconds, to the same graph
    g_table, g_w = tf.function(lambda: tape_grads(False), autograph=False)()
    out["tape_sparse_traced"] = [*dense(g_table), g_w.numpy().tolist()]
    return out


def _errors(tf: Any, hvd: Any, rank: int, size: int) -> dict[str, Any]:
    slices = tf.IndexedSlices(tf.ones([1, 3]), tf.constant([rank]))
    cases: dict[str, Callable[[], Any]] = {
        "alltoall_splits_sum": lambda: hvd.alltoall(tf.ones([size - 1]), [1] * size),
        "alltoall_equal_split": lambda: hvd.alltoall(tf.ones([size + 1])),
        "alltoall_splits_count": lambda: hvd.alltoall(tf.ones([4]), [1] * (size + 1)),
        "alltoall_dtype": lambda: hvd.alltoall(tf.ones([size], tf.int32 if rank % 2 == 0 else tf.float32)),
        "alltoall_one_rank_splits": lambda: hvd.alltoall(tf.ones([size]), [1] * size if rank else [5] * size),
        "alltoall_traced_splits": lambda: tf.function(lambda s: hvd.alltoall(tf.ones([size]), s))(
            tf.constant([3] * size)),
        "rs_scalar": lambda: hvd.reducescatter(tf.constant(1.0)),
        "rs_op": lambda: hvd.reducescatter(tf.ones([4]), op=hvd.Max),
        "rs_shape": lambda: hvd.reducescatter(tf.ones([17 + rank] * 3)),
        "grouped_rs_one_rank_scalar": lambda: hvd.grouped_reducescatter([tf.ones([2]), tf.constant(1.0)]
                                                                         if rank == 0 else [tf.ones([2])] * 2),
        "gag_dtype": lambda: hvd.grouped_allgather([tf.ones([2]), tf.ones([1], tf.int32 if rank else tf.float32)]),
        "gag_empty": lambda: hvd.grouped_allgather([]),
        "bo_unsupported_root": lambda: hvd.broadcast_object({1, 2} if rank == 0 else None, root_rank=0),
        "ago_one_rank_unsupported": lambda: hvd.allgather_object(object() if rank == size - 1 else rank),
        "adasum_int": lambda: hvd.allreduce(tf.ones([3], tf.int32), op=hvd.Adasum),
        "adasum_mismatch": lambda: hvd.allreduce(tf.ones([3]), op=hvd.Adasum if rank == 0 else hvd.Sum),
        "sparse_op": lambda: hvd.allreduce(slices, op=hvd.Min),
        "sparse_adasum": lambda: hvd.allreduce(slices, op=hvd.Adasum),
        "sparse_scale": lambda: hvd.allreduce(slices, op=hvd.Sum, prescale_factor=0.5),
    }
    out: dict[str, Any] = {}
    for case, call in cases.items():
        raised = _raised(call)
        after = hvd.allreduce(tf.fill([2], float(rank + 1)), op=hvd.Sum).numpy().tolist()
        out[case] = [raised, after]
    return out


def _helpers(tf: Any, hvd: Any, rank: int, size: int) -> dict[str, Any]:
    """Horovod's small re-exported helpers, and its TF1 session hook (every global variable from rank 1)."""
    v = tf.Variable(1.0)
    refs = hvd.vars_to_refs([v, [v]])
    out: dict[str, Any] = {
        "split_list": [list(part) for part in hvd.split_list(list(range(5)), 3)],
        "power_of_2": [hvd.check_num_rank_power_of_2(n) for n in (0, 1, 3, 4)],
        "average_compat": [hvd.handle_average_backwards_compatibility(None, False),
                           hvd.handle_average_backwards_compatibility(hvd.Sum, None),
                           _raised(lambda: hvd.handle_average_backwards_compatibility(hvd.Sum, True))],
        "refs": [hvd.refs_to_vars(refs)[0] is v, hvd.refs_to_vars(refs)[1][0] is v],
        "queries": [hvd.gpu_available("tensorflow"), hvd.check_extension("x", "X", __file__)],
    }
    with tf.Graph().as_default():
        var = tf.compat.v1.get_variable("hooked", initializer=tf.constant([float(rank)] * 2))
        hook = hvd.BroadcastGlobalVariablesHook(1)
        with tf.compat.v1.train.MonitoredSession(hooks=[hook]) as session:
            out["hook"] = session.run(var).tolist()
    return out


def tensorflow_ops() -> dict[str, Any]:
    """Every section's values, gradients and errors on this rank."""
    import os

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    import sluice.tensorflow as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    out: dict[str, Any] = {}
    for section in (_alltoall, _reducescatter, _grouped_allgather, _objects, _adasum, _sparse, _errors, _helpers):
        out.update(section(tf, hvd, rank, size))
    hvd.shutdown()
    return out


def tf_adasum() -> dict[str, Any]:
    """Adasum on this job's size (3 workers): a float64 vector alone, a float32 pair grouped with
    scale factors, and traced."""
    import os

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    import sluice.tensorflow as hvd

    hvd.init()
    rank = hvd.rank()
    single = hvd.allreduce(tf.constant(adasum_vector(rank, 0)), op=hvd.Adasum).numpy().tolist()
    pair = [tf.constant(adasum_vector(rank, i).astype(np.float32)) for i in range(2)]
    grouped = hvd.grouped_allreduce(pair, op=hvd.Adasum, prescale_factor=0.5, postscale_factor=2.0)
    traced = tf.function(lambda x: hvd.allreduce(x, op=hvd.Adasum))(tf.constant(adasum_vector(rank, 1)))
    out = {"single": single, "grouped": [t.numpy().astype(float).tolist() for t in grouped],
           "traced": traced.numpy().tolist()}
    hvd.shutdown()
    return out
