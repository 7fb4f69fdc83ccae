"""Horovod-shaped PyTorch API over Sluice: `import worker.torch_shim as hvd` and `hvd.init()`.

Gradients are pushed from autograd hooks as soon as each one is ready (`torch_optimizer.py`); the
next forward pass waits, module by module, only for the parameters that module uses (a global
forward pre-hook). Collectives are in `torch_collectives.py`, the process-wide state in
`torch_state.py`. CUDA tensors travel through a pinned host staging buffer; CPU tensors are sent
and received in place.
"""

from __future__ import annotations

import atexit
import logging
from typing import Any

import torch

from worker.client import Client
from worker.config import WorkerConfig
from worker.torch_collectives import (
    Average,
    Sum,
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_optimizer_state,
    broadcast_parameters,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    join,
    poll,
    synchronize,
)
from worker.torch_objects import allgather_object, broadcast_object
from worker.torch_optimizer import DistributedOptimizer, synchronize_parameters, wait_for_parameters
from worker.torch_state import PENDING, STATE, log_metrics, require

__all__ = [
    "Average", "DistributedOptimizer", "Sum", "allgather", "allgather_async", "allgather_object", "allreduce",
    "allreduce_", "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async", "barrier", "broadcast",
    "broadcast_", "broadcast_async", "broadcast_async_", "broadcast_object", "broadcast_optimizer_state",
    "broadcast_parameters", "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "init", "join", "local_rank", "local_size", "metrics", "poll", "rank", "shutdown",
    "size", "synchronize", "synchronize_parameters",
]

#: for tests and tools that look inside: the client, and the updates still in flight
_require = require
_pending_params = PENDING


# ---------------------------------------------------------------------------- process set-up
def init() -> None:
    """Join the job this process was launched into (by `sluice launch`)."""
    if STATE.client is not None:
        return
    _show_our_logs()
    client = Client()
    section = client.env.section("worker")
    if "priority_overrides" in section:
        section["priority_overrides"] = tuple(section["priority_overrides"])
    STATE.settings = WorkerConfig(**section)
    STATE.client = client
    torch.nn.modules.module.register_module_forward_pre_hook(wait_for_parameters)
    atexit.register(shutdown)


def _show_our_logs() -> None:
    """Our INFO lines (calibration, the priority map, metrics) reach stderr unless the script set up logging."""
    ours = logging.getLogger("sluice")
    if not logging.getLogger().handlers and not ours.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        ours.addHandler(handler)
        ours.setLevel(logging.INFO)


def shutdown() -> None:
    client = STATE.client
    if client is not None:
        if client.rank == 0:
            log_metrics(client.transport.stats(), "at the end")
        client.close()
        STATE.client = None


def metrics(reset: bool = False) -> dict[str, Any]:
    """This worker's transport metrics since the start (or the last reset): bytes and messages per
    channel, and the queueing delay per priority (see transport/metrics.py; `delay_table` summarises)."""
    return require().transport.stats(reset)


def rank() -> int:
    return require().rank


def size() -> int:
    return require().size


def local_rank() -> int:
    return rank()


def local_size() -> int:
    return size()

