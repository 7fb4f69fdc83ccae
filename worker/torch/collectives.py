"""Horovod's collective API for torch tensors, served by Sluice's collective engine (allreduce among workers).

Semantics follow horovod.torch: `op=Average` (the default), `Sum`, `Min`, `Max` or `Product`, with
`prescale_factor` and `postscale_factor`; names optional (unnamed ones get the same sequence of names
on every rank); `*_async` returns an int handle for `poll` and `synchronize`; `*_` works in place.
CPU tensors are reduced in place; CUDA tensors through a pinned host copy. Dtypes numpy cannot
reduce are reduced in a wider one and cast back: float8 in float32, bool in int32 (Sum and Max are a
logical or, Min and Product an and). The differentiable forms (`allreduce`, `allgather`, ...) are in
autograd.py.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from sluice.errors import SluiceError
from sluice.worker.collective.engine import CollectiveEngine, OpHandle
from sluice.worker.collective.reduce import REDUCIBLE, scaled
from sluice.worker.staging import Staging, tensor_of, wire_dtype
from sluice.worker.torch.state import NAMES, require

#: Horovod's reduction ops (horovod.torch.Average, Sum, Min, Max, Product; Adasum is refused)
Average, Sum, Min, Max, Product, Adasum = "average", "sum", "min", "max", "product", "adasum"
_OPS = (Average, Sum, Min, Max, Product)


class ProcessSet:
    """Horovod's process set: Sluice offers the global one only (every worker of the job)."""

    def __init__(self, ranks: Sequence[int] | None = None) -> None:
        if ranks is not None:
            raise SluiceError(_NO_PROCESS_SETS)
        self.ranks = None
        self.process_set_id = 0

    def included(self) -> bool:
        return True


_NO_PROCESS_SETS = ("process sets are not offered by Sluice: every collective runs over all workers of the job "
                    "(hvd.global_process_set). Run groups that must reduce apart as separate jobs (sluice launch)")
global_process_set = ProcessSet()


def add_process_set(process_set: Any) -> ProcessSet:
    raise SluiceError(_NO_PROCESS_SETS)


def remove_process_set(process_set: Any) -> bool:
    raise SluiceError(_NO_PROCESS_SETS)


def check_process_set(process_set: Any) -> None:
    if process_set is not None and process_set is not global_process_set:
        raise SluiceError(_NO_PROCESS_SETS)


_handles: dict[int, tuple[OpHandle, Callable[[], Any]]] = {}
_handle_ids = itertools.count(1)
_handles_lock = threading.Lock()


def engine() -> CollectiveEngine:
    node = require()
    if node.collectives is None:
        raise SluiceError("the collective engine is not running (init() did not finish)")
    return node.collectives


def resolve_op(average: bool | None, op: str | None) -> str:
    """Horovod's rules: average= (deprecated) or op=, Average by default."""
    if average is not None and op is not None:
        raise SluiceError("give either average= (deprecated in Horovod) or op=, not both")
    if op is None:
        return Sum if average is False else Average
    if op == Adasum:
        raise SluiceError("op=Adasum is not offered by Sluice: use op=hvd.Average (the default) or hvd.Sum; "
                          "with DistributedOptimizer, gradient_predivide_factor scales as Adasum users often need")
    if op not in _OPS:
        raise SluiceError(f"op must be one of hvd.Average, Sum, Min, Max, Product; got {op!r}")
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
#: dtypes reduced in a wider dtype (numpy has no arithmetic for them), and cast back
_WIDER = {torch.bool: torch.int32, **{d: torch.float32 for d in (
    torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz, torch.float8_e8m0fnu)}}


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                             op: str | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: Any = None, priority: int = 0) -> int:
    """One request for all of `tensors` (decided when every one is ready on every rank), in place:
    each is multiplied by `prescale_factor`, reduced by `op`, then multiplied by `postscale_factor`."""
    check_process_set(process_set)
    reduce_op = resolve_op(average, op)
    if not tensors:
        raise SluiceError("grouped_allreduce needs at least one tensor")
    if any(t.dtype != tensors[0].dtype for t in tensors):
        raise SluiceError("grouped_allreduce: every tensor of a group must have the same dtype")
    wider = _WIDER.get(tensors[0].dtype)
    work = [t.detach().to(wider) for t in tensors] if wider is not None else list(tensors)
    dtype = wire_dtype(work[0])
    if dtype not in REDUCIBLE:
        raise SluiceError(f"allreduce of {tensors[0].dtype} is not supported")
    stages = [Staging(t) for t in work]
    arrays = [s.load(t) for s, t in zip(stages, work, strict=True)]
    for array in arrays:
        if prescale_factor != 1.0:
            scaled(array, prescale_factor, dtype, array)
    op_name = _name(name, "allreduce")
    handle = engine().allreduce(op_name, arrays, dtype, reduce_op, priority)
    trace = require().trace
    if trace is not None:
        trace.collective(op_name, "allreduce", priority, sum(a.nbytes for a in arrays), handle)

    def finish() -> list[torch.Tensor]:
        for array in arrays:
            if postscale_factor != 1.0:
                scaled(array, postscale_factor, dtype, array)
        for stage, part, tensor in zip(stages, work, tensors, strict=True):
            stage.store(part)
            if part is not tensor:
                with torch.no_grad():
                    tensor.copy_(part != 0 if tensor.dtype == torch.bool else part)
        return list(tensors)

    return _register(handle, finish)


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: str | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: Any = None) -> int:
    number = grouped_allreduce_async_([tensor], average, name, op, prescale_factor, postscale_factor, process_set)
    handle, finish = _handles[number]
    _handles[number] = (handle, lambda: finish()[0])
    return number


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: str | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: Any = None) -> int:
    return allreduce_async_(tensor.detach().clone(), average, name, op, prescale_factor, postscale_factor,
                            process_set)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: str | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: Any = None) -> torch.Tensor:
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,  # type: ignore[no-any-return]
                                        postscale_factor, process_set))


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                       op: str | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: Any = None) -> list[torch.Tensor]:
    return synchronize(grouped_allreduce_async_(tensors, average, name, op,  # type: ignore[no-any-return]
                                                prescale_factor, postscale_factor, process_set))


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                            op: str | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: Any = None) -> int:
    return grouped_allreduce_async_([t.detach().clone() for t in tensors], average, name, op, prescale_factor,
                                    postscale_factor, process_set)


# ---------------------------------------------------------------------------- gather, broadcast, alltoall
def _as_tensor(array: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    return tensor_of(array, like.dtype).to(like.device)


def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: Any = None) -> int:
    """Every rank's tensor concatenated along the first dimension, which may differ per rank."""
    check_process_set(process_set)
    if tensor.dim() == 0:
        raise SluiceError("allgather needs a tensor of at least one dimension")
    array = Staging(tensor).load(tensor).copy()
    handle = engine().allgather(_name(name, "allgather"), array, wire_dtype(tensor))
    return _register(handle, lambda: _as_tensor(handle.result(), tensor))


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None) -> int:
    check_process_set(process_set)
    stage = Staging(tensor)
    array = stage.load(tensor)
    handle = engine().broadcast(_name(name, "broadcast"), array, root_rank, wire_dtype(tensor))

    def finish() -> torch.Tensor:
        stage.store(tensor)
        return tensor

    return _register(handle, finish)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None) -> int:
    return broadcast_async_(tensor.detach().clone(), root_rank, name, process_set)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None) -> torch.Tensor:
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))  # type: ignore[no-any-return]


def alltoall_async(tensor: torch.Tensor, splits: Sequence[int] | torch.Tensor | None = None,
                   name: str | None = None, process_set: Any = None) -> int:
    """Row block i of `tensor` (sizes `splits`; None: equal blocks) goes to rank i."""
    check_process_set(process_set)
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


def join(device: Any = None) -> int:
    """This rank has no more batches: take part in the others' collectives with zeros until every
    rank has joined; returns the rank that joined last."""
    return int(engine().join().result())


def barrier(name: str | None = None, process_set: Any = None) -> None:
    """Wait until every rank has called barrier (the same number of times: unnamed ones are numbered)."""
    check_process_set(process_set)
    engine().barrier(_name(name, "barrier")).wait()


# ---------------------------------------------------------------------------- parameters and optimizer state
def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                         root_rank: int) -> None:
    """Overwrite every worker's tensors with `root_rank`'s (a state_dict or named_parameters)."""
    named = list(params.items()) if isinstance(params, Mapping) else list(params)
    handles = [broadcast_async_(tensor.data, root_rank, f"broadcast.{name}") for name, tensor in named]
    for number in handles:
        synchronize(number)
