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

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from sluice.errors import InvalidCallError
from sluice.worker.collective import process_set as process_set_api
from sluice.worker.collective.process_set import ProcessSet as ProcessSet
from sluice.worker.collective.process_set import global_process_set as global_process_set
from sluice.worker.collective.reduce import REDUCIBLE, scaled
from sluice.worker.staging import Staging, tensor_of, wire_dtype
from sluice.worker.torch.adasum import adasum_async_, check_adasum
from sluice.worker.torch.calls import engine, op_name, refusing, register, rewrap
from sluice.worker.torch.calls import poll as poll
from sluice.worker.torch.calls import synchronize as synchronize
from sluice.worker.torch.state import require
from sluice.worker.torch.updates import synchronize_parameters

#: Horovod's reduction ops (horovod.torch.Average, Sum, Min, Max, Product, Adasum)
Average, Sum, Min, Max, Product, Adasum = "average", "sum", "min", "max", "product", "adasum"
_OPS = (Average, Sum, Min, Max, Product, Adasum)


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Horovod's: a set of ranks that runs collectives on its own (`process_set=`); every worker calls it alike,
    in the same order. ValueError where a set of the same ranks exists."""
    return process_set_api.add_process_set(require(), process_set)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Horovod's: every worker calls it alike; False for the global set or a set not registered."""
    return process_set_api.remove_process_set(require(), process_set)


def resolve_op(average: bool | None, op: str | None) -> str:
    """Horovod's rules: average= (deprecated) or op=, Average by default."""
    if average is not None and op is not None:
        raise InvalidCallError("The op parameter supersedes average. Please provide only one of them.")
    if op is None:
        return Sum if average is False else Average
    if op not in _OPS:
        raise InvalidCallError(f"op must be one of hvd.Average, Sum, Min, Max, Product, Adasum; got {op!r}")
    return op


def _check_tensor(tensor: Any, what: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise InvalidCallError(f"{what} takes torch tensors, got {type(tensor).__name__}")
    return tensor


# ---------------------------------------------------------------------------- allreduce
#: dtypes reduced in a wider dtype (numpy has no arithmetic for them), and cast back
_WIDER = {torch.bool: torch.int32, **{d: torch.float32 for d in (
    torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz, torch.float8_e8m0fnu)}}


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                             op: str | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: Any = None, priority: int = 0) -> int:
    """One request for all of `tensors` (decided when every one is ready on every rank), in place:
    each is multiplied by `prescale_factor`, reduced by `op`, then multiplied by `postscale_factor`.
    Average is Horovod's: a sum, then one multiplication by postscale_factor / size (integers truncated)."""
    on = engine(process_set)
    call = op_name(name, "allreduce", on)
    with refusing(call, on):
        reduce_op = resolve_op(average, op)
        if reduce_op == Adasum and on.label:
            raise NotImplementedError("Adasum does not support non-global process sets yet.")
        if not isinstance(tensors, (list, tuple)) or not tensors:
            raise InvalidCallError("grouped_allreduce needs a list of at least one tensor")
        tensors = [_check_tensor(t, "allreduce") for t in tensors]
        if any(t.dtype != tensors[0].dtype for t in tensors):
            raise InvalidCallError("grouped_allreduce: every tensor of a group must have the same dtype")
        if reduce_op == Adasum:
            check_adasum(tensors)
    if reduce_op == Adasum:
        return adasum_async_(call, tensors, prescale_factor, postscale_factor)
    with refusing(call, on):
        wider = _WIDER.get(tensors[0].dtype)
        work = [t.detach().to(wider) for t in tensors] if wider is not None else list(tensors)
        dtype = wire_dtype(work[0])
        if dtype not in REDUCIBLE:
            raise InvalidCallError(f"Tensor type {tensors[0].dtype} is not supported by allreduce.")
        # Horovod's average: the sum, then one multiplication by postscale / size (no second rounding)
        after = postscale_factor / on.size if reduce_op == Average else postscale_factor
        stages = [Staging(t) for t in work]
        arrays = [s.load(t) for s, t in zip(stages, work, strict=True)]
    for array in arrays:
        if prescale_factor != 1.0:
            scaled(array, prescale_factor, dtype, array)
    node = require()
    # one large tensor of the job's: summed inside each host first where the job has hosts of several workers
    tiers = node.hierarchy() if len(arrays) == 1 and on is node.collectives and arrays[0].flags.c_contiguous else None
    if tiers is not None and tiers.takes(arrays[0].nbytes):
        handle = tiers.allreduce(call, arrays[0].reshape(-1), dtype, priority, (tuple(arrays[0].shape),),
                                 op=reduce_op, scale=(prescale_factor, postscale_factor))
    else:
        handle = on.allreduce(call, arrays, dtype, reduce_op, priority, scale=(prescale_factor, postscale_factor))
    trace = node.trace
    if trace is not None:
        trace.collective(call, "allreduce", priority, sum(a.nbytes for a in arrays), handle)

    def finish() -> list[torch.Tensor]:
        for array in arrays:
            if after != 1.0:
                scaled(array, after, dtype, array)
        for stage, part, tensor in zip(stages, work, tensors, strict=True):
            stage.store(part)
            if part is not tensor:
                with torch.no_grad():
                    tensor.copy_(part != 0 if tensor.dtype == torch.bool else part)
        return list(tensors)

    return register(handle, finish)


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: str | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: Any = None) -> int:
    number = grouped_allreduce_async_([tensor], average, name, op, prescale_factor, postscale_factor, process_set)
    rewrap(number, lambda outputs: outputs[0])
    return number


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: str | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: Any = None) -> int:
    return allreduce_async_(_copy(tensor), average, name, op, prescale_factor, postscale_factor, process_set)


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
    copies = [_copy(t) for t in tensors] if isinstance(tensors, (list, tuple)) else tensors
    return grouped_allreduce_async_(copies, average, name, op, prescale_factor, postscale_factor, process_set)


def _copy(tensor: Any) -> Any:
    """A detached copy of a tensor (anything else as it is, for the call's checks to refuse)."""
    return tensor.detach().clone() if isinstance(tensor, torch.Tensor) else tensor


# ---------------------------------------------------------------------------- gather, broadcast, alltoall
def _ranks_text(members: list[int]) -> str:
    return f"0..{members[-1]}" if members == list(range(len(members))) else str(members)


def _as_tensor(array: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    return tensor_of(array, like.dtype).to(like.device)


def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: Any = None) -> int:
    """Every rank's tensor concatenated along the first dimension, which may differ per rank."""
    on = engine(process_set)
    call = op_name(name, "allgather", on)
    with refusing(call, on):
        if _check_tensor(tensor, "allgather").dim() == 0:
            raise InvalidCallError("allgather needs a tensor of at least one dimension")
        array = Staging(tensor).load(tensor).copy()
    handle = on.allgather(call, array, wire_dtype(tensor))
    return register(handle, lambda: _as_tensor(handle.result(), tensor))


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None) -> int:
    on = engine(process_set)
    call = op_name(name, "broadcast", on)
    with refusing(call, on):
        if type(root_rank) is not int or root_rank not in on.members:
            raise InvalidCallError(f"broadcast received invalid root rank {root_rank} for provided process set "
                                   f"(ranks {_ranks_text(on.members)})")
        stage = Staging(_check_tensor(tensor, "broadcast"))
        array = stage.load(tensor)
    handle = on.broadcast(call, array, root_rank, wire_dtype(tensor))

    def finish() -> torch.Tensor:
        stage.store(tensor)
        return tensor

    return register(handle, finish)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None) -> int:
    return broadcast_async_(_copy(tensor), root_rank, name, process_set)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None) -> torch.Tensor:
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))  # type: ignore[no-any-return]


def alltoall_splits(splits: Sequence[int] | torch.Tensor | None, rows: int, size: int) -> list[int]:
    """Horovod's alltoall splits: None means equal blocks; a tensor of integers or a sequence of ints."""
    if splits is None:
        if rows % size:
            raise InvalidCallError("splits not provided, but first dimension of tensor is not an even multiple "
                                   f"of the number of workers ({rows} rows, {size} workers).")
        return [rows // size] * size
    if isinstance(splits, torch.Tensor):
        if splits.dim() > 1:
            raise InvalidCallError("alltoall expects a 1D splits tensor")
        if splits.dtype.is_floating_point or splits.dtype.is_complex or splits.dtype == torch.bool:
            raise InvalidCallError("alltoall expects splits to contain 32-bit integer elements.")
        return [int(s) for s in splits.tolist()]
    if not all(isinstance(s, (int, np.integer)) for s in splits):
        raise InvalidCallError(f"alltoall expects splits to be integers, got {list(splits)!r:.80}")
    return [int(s) for s in splits]


def alltoall_async(tensor: torch.Tensor, splits: Sequence[int] | torch.Tensor | None = None,
                   name: str | None = None, process_set: Any = None) -> int:
    """Row block i of `tensor` (sizes `splits`; None: equal blocks) goes to rank i."""
    on = engine(process_set)
    call = op_name(name, "alltoall", on)
    with refusing(call, on):
        rows = _check_tensor(tensor, "alltoall").shape[0] if tensor.dim() else 0
        split_list = alltoall_splits(splits, rows, on.size)
        array = Staging(tensor).load(tensor).copy()
        handle = on.alltoall(call, array, split_list, wire_dtype(tensor))

    def finish() -> tuple[torch.Tensor, torch.Tensor]:
        output, received = handle.result()
        return _as_tensor(output, tensor), torch.tensor(list(received), dtype=torch.int32)

    return register(handle, finish)


def join(device: Any = None) -> int:
    """This rank has no more batches: take part in the others' collectives, and in their rounds on the
    parameter servers, with zeros until every rank has joined; returns the rank that joined last."""
    node = require()
    synchronize_parameters()  # this worker's last pushes are answered before the servers count it out
    joining = engine().join()  # on its way to the coordinators before the servers let the others go on
    if node.ps.servers:
        node.ps_join.enter()
    last = int(joining.result())
    if node.ps.servers:
        node.ps_join.leave(node.control_settings.op_timeout)
        node.ps_join.catch_up(engine(), op_name(None, "join_rounds"))
    return last


def barrier(process_set: Any = None, name: str | None = None) -> None:
    """Wait until every rank (of `process_set`) has called barrier (the same number of times: unnamed ones are
    numbered). The set comes first, as in Horovod's barrier(process_set=global_process_set)."""
    on = engine(process_set_api.barrier_set(process_set))
    call = op_name(name, "barrier", on)
    on.barrier(call).wait()


# ---------------------------------------------------------------------------- parameters and optimizer state
def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor] | torch.Tensor],
                         root_rank: int) -> None:
    """Overwrite every worker's tensors with `root_rank`'s: a state_dict (by sorted key, as Horovod), or
    (name, tensor) pairs such as named_parameters(), or bare tensors (numbered alike on every rank)."""
    named = sorted(params.items()) if isinstance(params, Mapping) else [
        p if isinstance(p, tuple) else (None, p) for p in params]
    handles = [broadcast_async_(tensor.data, root_rank, None if name is None else f"broadcast.{name}")
               for name, tensor in named]
    for number in handles:
        synchronize(number)
