"""Horovod's horovod.tensorflow.keras API over Sluice, published as `sluice.tensorflow.keras`.

`import sluice.tensorflow.keras as hvd`. The same implementation as sluice.keras (api.py), with
horovod.tensorflow.keras's differences: allreduce's `average` defaults to None (so `op=` alone
works), process sets (ProcessSet, add_process_set, remove_process_set) are exported, and Adasum and
PartialDistributedOptimizer are not.
"""

from __future__ import annotations

from sluice.worker.keras import callbacks as callbacks
from sluice.worker.keras import elastic as elastic
from sluice.worker.keras.functions import allgather, broadcast, load_model, reducescatter
from sluice.worker.keras.functions import tf_keras_allreduce as allreduce
from sluice.worker.keras.optimizer import DistributedOptimizer
from sluice.worker.tensorflow.api import (
    Average,
    Compression,
    ProcessSet,
    Sum,
    add_process_set,
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
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from sluice.worker.tensorflow.util import is_version_greater_equal_than

__all__ = [
    "Average", "Compression", "DistributedOptimizer", "ProcessSet", "Sum", "add_process_set", "allgather",
    "allreduce", "barrier", "broadcast", "broadcast_global_variables", "broadcast_variables", "ccl_built",
    "cross_rank", "cross_size", "cuda_built", "ddl_built", "global_process_set", "gloo_built", "gloo_enabled",
    "grouped_allreduce", "init", "is_homogeneous", "is_initialized", "is_version_greater_equal_than", "load_model",
    "local_rank", "local_size", "metrics", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "rank",
    "reducescatter", "remove_process_set", "rocm_built", "shutdown", "size", "start_timeline", "stop_timeline",
]
