"""Horovod's PyTorch API over Sluice, published as `sluice.torch`: `import sluice.torch as hvd` and `hvd.init()`.

Gradients are pushed from autograd hooks as soon as each one is ready (optimizer.py); the next
forward pass waits, module by module, only for the parameters that module uses (a global forward
pre-hook). Collectives are in collectives.py (async and in-place forms) and autograd.py
(differentiable forms), the process-wide state in state.py. CUDA tensors travel through a pinned
host staging buffer; CPU tensors are sent and received in place.

What Sluice does not offer fails at the call, saying what to use instead: an MPI communicator.
`shutdown()` finishes this rank's updates in flight and makes every call but `init()` raise, as
Horovod's; `init()` afterwards rejoins with the same rank. The connection itself is kept until the
process exits (the job counts a worker as gone when its process ends).
"""

from __future__ import annotations

import atexit
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from sluice.errors import CollectiveError, SluiceError
from sluice.worker.collective.process_set import register_sets
from sluice.worker.node import WorkerNode
from sluice.worker.shim import show_our_logs, worker_settings
from sluice.worker.topology import Placement, placement
from sluice.worker.torch import elastic, offload, pipelining
from sluice.worker.torch.autograd import allgather, allreduce, alltoall, broadcast, grouped_allreduce, reducescatter
from sluice.worker.torch.collectives import (
    Adasum,
    Average,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    add_process_set,
    allgather_async,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall_async,
    barrier,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_parameters,
    global_process_set,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    join,
    poll,
    remove_process_set,
    synchronize,
)
from sluice.worker.torch.compression import Compression
from sluice.worker.torch.ddp import DDPHookState, ddp_hook
from sluice.worker.torch.objects import allgather_object, broadcast_object, broadcast_optimizer_state
from sluice.worker.torch.optimizer import DistributedOptimizer
from sluice.worker.torch.scatter import (
    grouped_allgather_async,
    grouped_reducescatter_async,
    reducescatter_async,
    sparse_allreduce_async,
)
from sluice.worker.torch.state import PARKED, STATE, log_metrics, require
from sluice.worker.torch.sync_batch_norm import SyncBatchNorm
from sluice.worker.torch.updates import synchronize_parameters, wait_for_parameters

#: Horovod's error for a collective that failed on every rank (the ranks disagreed, or one refused the call)
HorovodInternalError = CollectiveError

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DDPHookState",
    "DistributedOptimizer",
    "HorovodInternalError",
    "Max",
    "Min",
    "ProcessSet",
    "Product",
    "Sum",
    "SyncBatchNorm",
    "add_process_set",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "ccl_built",
    "check_extension",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "ddp_hook",
    "elastic",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "metrics",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "offload",
    "pipelining",
    "poll",
    "rank",
    "reducescatter",
    "reducescatter_async",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "sparse_allreduce_async",
    "start_timeline",
    "stop_timeline",
    "synchronize",
    "synchronize_parameters",
]


# ---------------------------------------------------------------------------- process set-up
def init(comm: Any = None, process_sets: Sequence[ProcessSet] | str | None = None) -> None:
    """Join the job this process was launched into (by `sluice launch`); again after shutdown().
    `process_sets` (Horovod's): sets to register at once, in the same order on every worker, or "dynamic"."""
    if comm is not None:
        raise SluiceError("init(comm=...) takes an MPI communicator, and Sluice does not use MPI: call hvd.init() "
                          "and choose the workers with sluice launch -w N")
    if STATE.node is not None:
        return
    if PARKED:
        STATE.node = PARKED.pop()
    else:
        show_our_logs()
        node = WorkerNode()
        STATE.settings = worker_settings(node)
        STATE.node = node
        if not _HOOKED:  # once a process: a job re-formed in place (reinit) makes a new node
            _HOOKED.append(True)
            torch.nn.modules.module.register_module_forward_pre_hook(wait_for_parameters)
            atexit.register(_close)
    assert STATE.node.process_sets is not None
    register_sets(STATE.node.process_sets, STATE.node.rank, process_sets)
    _pin_gpu()


def _pin_gpu() -> None:
    """Each worker on its own GPU, as Horovod's examples pin it (torch.cuda.set_device(hvd.local_rank())):
    the GPU of its local rank where the host shows as many; where fewer show (CUDA_VISIBLE_DEVICES chosen
    per worker), the worker keeps the one it was given."""
    if torch.cuda.is_available() and local_rank() < torch.cuda.device_count():
        torch.cuda.set_device(local_rank())


def shutdown() -> None:
    """Finish this rank's updates in flight and leave: calls but init() raise until init() again."""
    node = STATE.node
    if node is None:
        return
    synchronize_parameters()
    stop_timeline()
    STATE.node = None
    PARKED.append(node)


def reinit_in_place() -> None:
    """Drop this process's connection for good, failed as it is (an elastic job re-forms in place), so
    that the next init() joins the re-formed job with a new one."""
    node, STATE.node = STATE.node, None
    if node is not None:
        PARKED.append(node)
    while PARKED:
        PARKED.pop().close()


#: whether this process registered its forward hook and exit handler
_HOOKED: list[bool] = []


def _close() -> None:
    """At exit: close the connection for good (parked or not)."""
    shutdown()
    while PARKED:
        node = PARKED.pop()
        if node.rank == 0:
            log_metrics(node.stats(), "at the end", node.rank)
        node.close()


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Record this rank's timeline into `file_path` (a Chrome trace: open it in https://ui.perfetto.dev):
    per tensor and step, when it was ready, queued, pushed, at the server, pulled and applied, with its
    priority and channel. Each rank that calls it writes its own file (rank r > 0: `file_path` with
    `.rank<r>` before the extension); `sluice launch --timeline PATH` records every process, servers
    included, into one file. `mark_cycles` is accepted for Horovod's sake (Sluice has no cycles)."""
    node = require()
    path = Path(file_path)
    if node.rank:
        path = path.with_name(f"{path.stem}.rank{node.rank}{path.suffix}")
    node.start_trace(str(path))


def stop_timeline() -> None:
    """Stop recording and close the file (it is valid JSON from then on)."""
    node = STATE.node
    if node is not None:
        node.stop_trace()


def is_initialized() -> bool:
    return STATE.node is not None


def metrics(reset: bool = False) -> dict[str, Any]:
    """This worker's transport metrics since the start (or the last reset): bytes and messages per
    channel, and the queueing delay per priority (see transport/metrics.py; `delay_table` summarises)."""
    return require().transport.stats(reset)


# ---------------------------------------------------------------------------- where this worker is
def _placement() -> Placement:
    node = require()
    return placement(node.hosts("worker"), node.rank)


def rank() -> int:
    return require().rank


def size() -> int:
    return require().size


def local_rank() -> int:
    """This worker's index among the workers on its host (the GPU to pick, by Horovod's convention)."""
    return _placement().local_rank


def local_size() -> int:
    return _placement().local_size


def cross_rank() -> int:
    """This host's index among the hosts that run a worker of this local rank."""
    return _placement().cross_rank


def cross_size() -> int:
    return _placement().cross_size


def is_homogeneous() -> bool:
    """Every host runs as many workers."""
    return _placement().homogeneous


# ---------------------------------------------------------------------------- what this build has, truthfully
def mpi_built() -> bool:
    """Sluice uses no MPI (the launcher and ZeroMQ take its place)."""
    return False


def mpi_enabled() -> bool:
    return False


def mpi_threads_supported() -> bool:
    return False


def gloo_built() -> bool:
    """Sluice's own allreduce takes Gloo's place."""
    return False


def gloo_enabled() -> bool:
    return False


def nccl_built() -> int:
    """Horovod's answer: NCCL's version code (major * 10000 + minor * 100 + patch) where this process sums CUDA
    gradients inside its host with it (a GPU, torch built with NCCL, collective.local_group not "sluice"), else 0."""
    if not (torch.cuda.is_available() and torch.distributed.is_nccl_available()):
        return 0
    node = STATE.node
    if node is not None and node.collective_settings.local_group == "sluice":
        return 0
    major, minor, patch = torch.cuda.nccl.version()[:3]  # type: ignore[no-untyped-call]
    return int(major * 10000 + minor * 100 + patch)


def check_extension(ext_name: str, ext_env_var: str, pkg_path: str, *args: Any) -> None:
    """Horovod's check that its compiled extension loaded: Sluice has none to check."""


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def rocm_built() -> bool:
    return False


def cuda_built() -> bool:
    """True: CUDA tensors are accepted everywhere (fused gradients stay on the device, each worker's share
    through pinned host memory; the other ops staged through it)."""
    return True


def grouped_allgather(tensors: list[torch.Tensor], name: str | None = None, process_set: Any = None) -> list[
        torch.Tensor]:
    """allgather of each tensor (one operation each); differentiable."""
    return [allgather(t, None if name is None else f"{name}.{i}", process_set) for i, t in enumerate(tensors)]


def grouped_reducescatter(tensors: list[torch.Tensor], name: str | None = None, compression: Any = None,
                          op: str | None = Average, process_set: Any = None, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """reducescatter of each tensor; differentiable."""
    return [reducescatter(t, None if name is None else f"{name}.{i}", compression or Compression.none, op,
                          process_set, prescale_factor, postscale_factor) for i, t in enumerate(tensors)]


#: Horovod names Sluice does not offer, and what to use instead (sluice.torch's __getattr__ raises with it)
NOT_OFFERED = {
    "PartialDistributedOptimizer": "PartialDistributedOptimizer is not offered: pass only the parameters to "
                                   "reduce to DistributedOptimizer, and step the others with a plain optimizer",
}
