"""The worker function of the TF error conformance test: Horovod's TF error cases, eager and in a tf.function.

From Horovod's test_tensorflow.py (test_horovod_allreduce_error, _type_error, allgather's and
broadcast's): ranks that disagree raise tf.errors.FailedPreconditionError on every rank when eager (in a
tf.function a py_function can only say UnknownError); a call one rank cannot run (a root that is no
rank, a scalar to allgather) fails on every rank; after each case an unnamed and a named allreduce
must give the right sum on every rank, eagerly and traced.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


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
    except ValueError:
        return "ValueError"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def tf_error_cases() -> dict[str, Any]:
    import tensorflow as tf

    import sluice.tensorflow as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    cases: dict[str, Callable[[], Any]] = {
        "allreduce_shape": lambda: hvd.allreduce(tf.ones([17 + rank] * 3)),
        "allreduce_ndim": lambda: hvd.allreduce(tf.ones([17, 23 * 57] if rank == 0 else [17, 23, 57])),
        "allreduce_dtype": lambda: hvd.allreduce(tf.ones([17], tf.int32 if rank % 2 == 0 else tf.float32)),
        "allreduce_op": lambda: hvd.allreduce(tf.ones([4]), op=hvd.Sum if rank == 0 else hvd.Average),
        "allgather_shape": lambda: hvd.allgather(tf.ones([rank + 1, 10 * (rank + 1)])),
        "allgather_dtype": lambda: hvd.allgather(tf.ones([2], tf.int32 if rank % 2 == 0 else tf.float32)),
        "broadcast_shape": lambda: hvd.broadcast(tf.ones([17 + rank]), 0),
        "broadcast_root_mismatch": lambda: hvd.broadcast(tf.ones([3]), rank),
        "broadcast_invalid_root": lambda: hvd.broadcast(tf.ones([3]), size),
        "one_rank_scalar_allgather": lambda: hvd.allgather(tf.ones([]) if rank == 0 else tf.ones([2])),
        "graph_allreduce_shape": tf.function(lambda: hvd.allreduce(tf.ones([3 + rank]))),
    }
    out: dict[str, Any] = {}
    for case, call in cases.items():
        raised = _raised(call)
        unnamed = hvd.allreduce(tf.fill([3], float(rank + 1)), op=hvd.Sum).numpy().tolist()
        traced = tf.function(lambda: hvd.allreduce(tf.ones([2]), op=hvd.Sum, name=None))().numpy().tolist()
        out[case] = [raised, unnamed, traced]
    hvd.shutdown()
    return out


def tf_api_extras() -> dict[str, Any]:
    """Horovod's smaller TF names: Min, Max, Product; the build queries; rank/size as ops, eager and traced;
    join; broadcast_ in place; broadcast_global_variables' eager error; mpi_threads_supported's error."""
    import tensorflow as tf

    import sluice.tensorflow as hvd

    hvd.init()
    rank = hvd.rank()
    values = tf.constant([rank + 1.0, 4.0 - rank, -1.0 * rank])
    out: dict[str, Any] = {op: hvd.allreduce(values, op=getattr(hvd, op)).numpy().tolist()
                           for op in ("Min", "Max", "Product")}
    out["queries"] = [hvd.mpi_built(), hvd.mpi_enabled(), hvd.gloo_built(), hvd.gloo_enabled(), hvd.nccl_built(),
                      hvd.ddl_built(), hvd.ccl_built(), hvd.cuda_built(), hvd.rocm_built()]
    traced = tf.function(lambda: [hvd.rank_op(), hvd.size_op(), hvd.local_rank_op(), hvd.local_size_op()])
    out["ops"] = [int(t) for t in (hvd.rank_op(), hvd.size_op(), hvd.local_rank_op(), hvd.local_size_op())]
    out["ops_traced"] = [int(t) for t in traced()]
    variable = tf.Variable([float(rank)] * 2)
    out["broadcast_"] = [v.numpy().tolist() for v in hvd.broadcast_([variable], root_rank=1)] + [
        variable.numpy().tolist()]
    out["global_variables"] = _raised(lambda: hvd.broadcast_global_variables(0))
    out["mpi_threads"] = _raised(hvd.mpi_threads_supported)
    out["join"] = int(hvd.join())
    hvd.shutdown()
    return out
