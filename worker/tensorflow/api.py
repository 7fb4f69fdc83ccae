"""Horovod's TensorFlow 2 API over Sluice, published as `sluice.tensorflow`: `import sluice.tensorflow as hvd`.

Pure Python, no compiled op: tensors cross into numpy (zero-copy reads of CPU eager tensors), and
inside a tf.function each collective is one tf.py_function. Gradients (DistributedGradientTape, and
sluice.keras's DistributedOptimizer) travel as the PyTorch shim's do: balanced fused groups, with
priorities from the variables' order, through the collective engine's allreduce or the servers'
push_pull (collective.mode). XLA (`jit_compile=True`) cannot call Python, so none of this runs
inside an XLA-compiled function: such a trace fails at once, saying what to set.
"""

from __future__ import annotations

from typing import Any

from sluice.worker.tensorflow.collectives import (
    Average,
    Max,
    Min,
    Product,
    Sum,
    allgather,
    allreduce,
    barrier,
    broadcast,
    broadcast_variables,
    grouped_allreduce,
)
from sluice.worker.tensorflow.compression import Compression
from sluice.worker.tensorflow.extras import (
    broadcast_,
    broadcast_global_variables,
    ccl_built,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    join,
    local_rank_op,
    local_size_op,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank_op,
    rocm_built,
    size_op,
)
from sluice.worker.tensorflow.gradients import DistributedGradientTape
from sluice.worker.tensorflow.state import STATE, current_placement, init, require, shutdown

__all__ = [
    "Average", "Compression", "DistributedGradientTape", "Max", "Min", "Product", "Sum", "allgather", "allreduce",
    "barrier", "broadcast", "broadcast_", "broadcast_global_variables", "broadcast_variables", "ccl_built",
    "cross_rank", "cross_size", "cuda_built", "ddl_built", "gloo_built", "gloo_enabled", "grouped_allreduce", "init",
    "is_homogeneous", "is_initialized", "join", "local_rank", "local_rank_op", "local_size", "local_size_op",
    "metrics", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "rank", "rank_op", "rocm_built",
    "shutdown", "size", "size_op",
]


def is_initialized() -> bool:
    return STATE.node is not None


def rank() -> int:
    return require().rank


def size() -> int:
    return require().size


def local_rank() -> int:
    """This worker's index among the workers on its host (the GPU to pick, by Horovod's convention)."""
    return current_placement().local_rank


def local_size() -> int:
    return current_placement().local_size


def cross_rank() -> int:
    """This host's index among the hosts that run a worker of this local rank."""
    return current_placement().cross_rank


def cross_size() -> int:
    return current_placement().cross_size


def is_homogeneous() -> bool:
    """Every host runs as many workers."""
    return current_placement().homogeneous


def metrics(reset: bool = False) -> dict[str, Any]:
    """This worker's transport metrics since the start (or the last reset), as sluice.torch's metrics()."""
    return require().transport.stats(reset)
