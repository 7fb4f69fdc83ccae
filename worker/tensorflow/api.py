"""Horovod's TensorFlow 2 API over Sluice, published as `sluice.tensorflow`: `import sluice.tensorflow as hvd`.

Pure Python, no compiled op: tensors cross into numpy (zero-copy reads of CPU eager tensors), and
inside a tf.function each collective is one tf.py_function. Gradients (DistributedGradientTape, and
sluice.keras's DistributedOptimizer) travel as the PyTorch shim's do: balanced fused groups, with
priorities from the variables' order, through the collective engine's allreduce or the servers'
push_pull (collective.mode). XLA (`jit_compile=True`) cannot call Python, so none of this runs
inside an XLA-compiled function: such a trace fails at once, saying what to set.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sluice.worker.tensorflow.collectives import (
    Adasum,
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
    grouped_allgather,
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
    process_set_included_op,
    rank_op,
    rocm_built,
    size_op,
)
from sluice.worker.tensorflow.gradients import DistributedGradientTape, PartialDistributedGradientTape
from sluice.worker.tensorflow.objects import allgather_object, broadcast_object, broadcast_object_fn
from sluice.worker.tensorflow.ops import alltoall, grouped_reducescatter, reducescatter
from sluice.worker.tensorflow.optimizer import DistributedOptimizer
from sluice.worker.tensorflow.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)
from sluice.worker.tensorflow.state import STATE, current_placement, init, require, shutdown
from sluice.worker.tensorflow.sync_batch_norm import SyncBatchNormalization
from sluice.worker.tensorflow.util import (
    BroadcastGlobalVariablesHook,
    check_extension,
    check_num_rank_power_of_2,
    gpu_available,
    handle_average_backwards_compatibility,
    refs_to_vars,
    split_list,
    vars_to_refs,
)

__all__ = [
    "Adasum", "Average", "BroadcastGlobalVariablesHook", "Compression", "DistributedGradientTape",
    "DistributedOptimizer", "Max", "Min", "PartialDistributedGradientTape", "ProcessSet", "Product", "Sum",
    "SyncBatchNormalization", "add_process_set", "allgather", "allgather_object", "allreduce", "alltoall", "barrier",
    "broadcast", "broadcast_", "broadcast_global_variables", "broadcast_object", "broadcast_object_fn",
    "broadcast_variables", "ccl_built", "check_extension", "check_num_rank_power_of_2", "cross_rank", "cross_size",
    "cuda_built", "ddl_built", "global_process_set", "gloo_built", "gloo_enabled", "gpu_available",
    "grouped_allgather", "grouped_allreduce", "grouped_reducescatter", "handle_average_backwards_compatibility",
    "init", "is_homogeneous", "is_initialized", "join", "local_rank", "local_rank_op", "local_size", "local_size_op",
    "metrics", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "process_set_included_op", "rank",
    "rank_op", "reducescatter", "refs_to_vars", "remove_process_set", "rocm_built", "shutdown", "size", "size_op",
    "split_list", "start_timeline", "stop_timeline", "vars_to_refs"
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


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Record this rank's timeline into `file_path` (a Chrome trace: open it in https://ui.perfetto.dev), as
    sluice.torch's: rank r > 0 writes `file_path` with `.rank<r>` before the extension; `sluice launch
    --timeline PATH` records every process into one file. `mark_cycles` is accepted (Sluice has no cycles)."""
    node = require()
    path = Path(file_path)
    if node.rank:
        path = path.with_name(f"{path.stem}.rank{node.rank}{path.suffix}")
    node.start_trace(str(path))


def stop_timeline() -> None:
    """Stop recording and close the file (it is valid JSON from then on)."""
    if STATE.node is not None:
        STATE.node.stop_trace()
