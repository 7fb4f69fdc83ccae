"""Horovod's collective API for torch tensors, served by Sluice's collective engine (allreduce among workers).

Semantics follow horovod.torch: `op=Average` (the default) or `Sum`, names optional (unnamed ones
get the same sequence of names on every rank), `*_async` returns an int handle for `poll` and
`synchronize`, `*_` works in place. CPU tensors are reduced in place; CUDA tensors through a pinned
host copy.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from scheduler.errors import SluiceError
from worker.collective.engine import CollectiveEngine, OpHandle
from worker.staging import Staging, wire_dtype
from worker.torch_state import NAMES, require

#: Horovod's reduction ops (horovod.torch.Average, Sum)
Average, Sum = "average", "sum"

_handles: dict[int, tuple[OpHandle, Callable[[], Any]]] = {}
_handle_ids = itertools.count(1)
_handles_lock = threading.Lock()


def engine() -> CollectiveEngine:
    client = require()
    if client.collectives is None:
        raise SluiceError("the collective engine is not running (init() did not finish)")
    return client.collectives


def _op(average: bool | None, op: str | None) -> str:
    if average is not None and op is not None:
        raise SluiceError("give either average= (deprecated in Horovod) or op=, not both")
    if op is None:
        return Sum if average is False else Average
    if op not in (Average, Sum):
        raise SluiceError(f"op must be Average or Sum, got {op!r}")
    return op


def _name(name: str | None, kind: str) -> str:
    return name if name is not None else f"{kind}.noname.{next(NAMES)}"


def _register(handle: OpHandle, finish: Callable[[], Any]) -> int:
    with _handles_lock:
        number = next(_handle_ids)
        _handles[number] = (handle, finish)
    return number


def poll(handle: int) -> bool:
    """True when the operation of `handle` has finished (synchronize then returns at once)."""
    with _handles_lock:
        entry = _handles.get(handle)
    if entry is None:
        raise SluiceError(f"unknown or already synchronized handle {handle}")
    return entry[0].done()


def synchronize(handle: int) -> Any:
    """Wait for the operation of `handle` and return its output."""
    with _handles_lock:
        entry = _handles.pop(handle, None)
    if entry is None:
        raise SluiceError(f"unknown or already synchronized handle {handle}")
    entry[0].wait()
    return entry[1]()


# ---------------------------------------------------------------------------- allreduce
def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                             op: str | None = None) -> int:
    """One request for all of `tensors` (decided when every one is ready on every rank), in place."""
    if not tensors:
        raise SluiceError("grouped_allreduce needs at least one tensor")
    dtype = wire_dtype(tensors[0])
    if any(wire_dtype(t) != dtype for t in tensors):
        raise SluiceError("grouped_allreduce: every tensor of a group must have the same dtype")
    stages = [Staging(t) for t in tensors]
    arrays = [s.load(t) for s, t in zip(stages, tensors, strict=True)]
    handle = engine().allreduce(_name(name, "allreduce"), arrays, dtype, _op(average, op))

    def finish() -> list[torch.Tensor]:
        for stage, tensor in zip(stages, tensors, strict=True):
            stage.store(tensor)
        return list(tensors)

    return _register(handle, finish)


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: str | None = None) -> int:
    number = grouped_allreduce_async_([tensor], average, name, op)
    handle, finish = _handles[number]
    _handles[number] = (handle, lambda: finish()[0])
    return number


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: str | None = None) -> int:
    return allreduce_async_(tensor.detach().clone(), average, name, op)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: str | None = None) -> torch.Tensor:
    return synchronize(allreduce_async_(tensor, average, name, op))  # type: ignore[no-any-return]


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              op: str | None = None) -> torch.Tensor:
    return allreduce_(tensor.detach().clone(), average, name, op)


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                       op: str | None = None) -> list[torch.Tensor]:
    return synchronize(grouped_allreduce_async_(tensors, average, name, op))  # type: ignore[no-any-return]


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                            op: str | None = None) -> int:
    return grouped_allreduce_async_([t.detach().clone() for t in tensors], average, name, op)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                      op: str | None = None) -> list[torch.Tensor]:
    return grouped_allreduce_([t.detach().clone() for t in tensors], average, name, op)


# ---------------------------------------------------------------------------- gather, broadcast, alltoall
def _as_tensor(array: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    out = torch.from_numpy(np.ascontiguousarray(array))
    if like.dtype == torch.bfloat16:
        out = out.view(torch.int16).view(torch.bfloat16)
    return out.to(like.device)


def allgather_async(tensor: torch.Tensor, name: str | None = None) -> int:
    """Every rank's tensor concatenated along the first dimension, which may differ per rank."""
    if tensor.dim() == 0:
        raise SluiceError("allgather needs a tensor of at least one dimension")
    array = Staging(tensor).load(tensor).copy()
    handle = engine().allgather(_name(name, "allgather"), array, wire_dtype(tensor))
    return _register(handle, lambda: _as_tensor(handle.result(), tensor))


def allgather(tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
    return synchronize(allgather_async(tensor, name))  # type: ignore[no-any-return]


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> int:
    stage = Staging(tensor)
    array = stage.load(tensor)
    handle = engine().broadcast(_name(name, "broadcast"), array, root_rank, wire_dtype(tensor))

    def finish() -> torch.Tensor:
        stage.store(tensor)
        return tensor

    return _register(handle, finish)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> int:
    return broadcast_async_(tensor.detach().clone(), root_rank, name)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    return synchronize(broadcast_async_(tensor, root_rank, name))  # type: ignore[no-any-return]


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    return broadcast_(tensor.detach().clone(), root_rank, name)


def alltoall_async(tensor: torch.Tensor, splits: Sequence[int] | torch.Tensor | None = None,
                   name: str | None = None) -> int:
    """Row block i of `tensor` (sizes `splits`; None: equal blocks) goes to rank i."""
    size = require().size
    rows = tensor.shape[0] if tensor.dim() else 0
    if splits is None:
        if rows % size:
            raise SluiceError(f"alltoall without splits needs a first dimension divisible by {size}, got {rows}")
        split_list = [rows // size] * size
    else:
        split_list = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
    array = Staging(tensor).load(tensor).copy()
    handle = engine().alltoall(_name(name, "alltoall"), array, split_list, wire_dtype(tensor))

    def finish() -> tuple[torch.Tensor, torch.Tensor]:
        output, received = handle.result()
        return _as_tensor(output, tensor), torch.tensor(list(received), dtype=torch.int32)

    return _register(handle, finish)


def alltoall(tensor: torch.Tensor, splits: Sequence[int] | torch.Tensor | None = None,
             name: str | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The gathered blocks; with `splits` given, also the rows received from each rank (as Horovod)."""
    output, received = synchronize(alltoall_async(tensor, splits, name))
    return (output, received) if splits is not None else output


def join() -> int:
    """This rank has no more batches: take part in the others' collectives with zeros until every
    rank has joined; returns the rank that joined last."""
    return int(engine().join().result())


def barrier(name: str | None = None) -> None:
    """Wait until every rank has called barrier (the same number of times: unnamed ones are numbered)."""
    engine().barrier(_name(name, "barrier")).wait()


# ---------------------------------------------------------------------------- parameters and optimizer state
def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                         root_rank: int) -> None:
    """Overwrite every worker's tensors with `root_rank`'s (a state_dict or named_parameters)."""
    named = list(params.items()) if isinstance(params, Mapping) else list(params)
    handles = [broadcast_async_(tensor.data, root_rank, f"broadcast.{name}") for name, tensor in named]
    for number in handles:
        synchronize(number)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int) -> None:
    """Give every worker `root_rank`'s optimizer state and numeric hyper-parameters."""
    named: list[tuple[str, torch.Tensor]] = []
    scalars: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    for index, group in enumerate(optimizer.param_groups):
        for key, value in sorted(group.items()):
            if isinstance(value, int | float) and not isinstance(value, bool):
                holder = torch.tensor([float(value)], dtype=torch.float64)
                scalars.append((group, key, holder))
                named.append((f"optimizer.group{index}.{key}", holder))
    order = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    for param, state in optimizer.state.items():
        for key, value in sorted(state.items()):
            if torch.is_tensor(value):
                named.append((f"optimizer.state{order[id(param)]}.{key}", value))
    broadcast_parameters(named, root_rank)
    for group, key, holder in scalars:
        group[key] = type(group[key])(holder.item())
