"""Horovod's horovod.keras API over Sluice, published as `sluice.keras`: `import sluice.keras as hvd`.

For Keras 3 on the TensorFlow backend. The process set-up, queries and reduction ops are
sluice.tensorflow's; allreduce, allgather, broadcast and reducescatter take a value as Horovod's
Keras functions do (functions.py: allreduce averages by default, `average=True`); DistributedOptimizer
wraps a Keras 3 optimizer (optimizer.py); `callbacks` holds Horovod's callbacks (callbacks.py) and
`elastic` its elastic state and callbacks (elastic.py). Besides Horovod's names, sluice.keras keeps
Sluice's barrier, broadcast_variables, grouped_allreduce, is_homogeneous and metrics.
horovod.tensorflow.keras's variant is tf_api.py.
"""

from __future__ import annotations

from sluice.worker.keras import callbacks as callbacks
from sluice.worker.keras import elastic as elastic
from sluice.worker.keras.functions import allgather, allreduce, broadcast, load_model, reducescatter
from sluice.worker.keras.optimizer import DistributedOptimizer, PartialDistributedOptimizer
from sluice.worker.tensorflow.api import (
    Adasum,
    Average,
    Compression,
    Sum,
    barrier,
    broadcast_global_variables,
    broadcast_variables,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    grouped_allreduce,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    metrics,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)

__all__ = [
    "Adasum", "Average", "Compression", "DistributedOptimizer", "PartialDistributedOptimizer", "Sum",
    "allgather", "allreduce", "barrier",
    "broadcast", "broadcast_global_variables", "broadcast_variables", "ccl_built", "cross_rank",
    "cross_size", "cuda_built", "ddl_built", "global_process_set", "gloo_built", "gloo_enabled",
    "grouped_allreduce", "init", "is_homogeneous", "is_initialized", "load_model", "local_rank", "local_size",
    "metrics", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "rank", "reducescatter",
    "rocm_built", "shutdown", "size", "start_timeline", "stop_timeline",
]
