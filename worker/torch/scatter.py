"""Horovod's reducescatter, grouped allgather and sparse allreduce as async calls (int handles, or a callable).

Reducescatter is built on allreduce: every rank reduces the whole tensor and keeps its block of the
first dimension (blocks as even as they can be, the first ones one row longer, as Horovod splits),
with Horovod's checks: no scalars, Sum or Average only. A grouped allgather is one allgather per
tensor under one handle. A sparse allreduce gathers every rank's indices and values (the values
divided by the size for Average) and returns, as Horovod's, a callable that gives the uncoalesced sum.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from sluice.errors import InvalidCallError
from sluice.worker.collective.blocks import block
from sluice.worker.torch.calls import AllOf, engine, op_name, refusing, register, rewrap, synchronize, unregister
from sluice.worker.torch.collectives import (
    Average,
    Sum,
    allgather_async,
    grouped_allreduce_async_,
    resolve_op,
)


def check_reducescatter(tensors: Sequence[Any], op: str | None) -> str:
    """Horovod's checks of a (grouped) reducescatter; the reduce op it runs."""
    if not isinstance(tensors, (list, tuple)) or not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise InvalidCallError("reducescatter takes torch tensors")
    if any(t.dim() == 0 for t in tensors):
        raise InvalidCallError("Reducescatter does not support scalar inputs")
    reduce_op = resolve_op(None, op)
    if reduce_op not in (Sum, Average):
        raise InvalidCallError("Reducescatter currently only supports AVERAGE and SUM.")
    return reduce_op


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None, op: str | None = Average,
                                process_set: Any = None, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    """Each tensor reduced over the ranks; this rank's block of each, from `synchronize`."""
    on = engine(process_set)
    call = op_name(name, "reducescatter", on)
    with refusing(call, on):
        reduce_op = check_reducescatter(tensors, op)
    number = grouped_allreduce_async_([t.detach().clone() for t in tensors], None, call, reduce_op, prescale_factor,
                                      postscale_factor, process_set)
    rewrap(number, lambda outs: [o[block(o.shape[0], on.rank, on.size)] for o in outs])
    return number


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: str | None = Average,
                        process_set: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> int:
    """The tensor reduced over the ranks; this rank's block of it, from `synchronize`."""
    number = grouped_reducescatter_async([tensor] if isinstance(tensor, torch.Tensor) else tensor, name, op,
                                         process_set, prescale_factor, postscale_factor)
    rewrap(number, lambda outs: outs[0])
    return number


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None, process_set: Any = None) -> int:
    """Every rank's tensors, each concatenated along its first dimension, from `synchronize`."""
    on = engine(process_set)
    call = op_name(name, "allgather", on)
    with refusing(call, on):
        if not isinstance(tensors, (list, tuple)) or not tensors:
            raise InvalidCallError("grouped_allgather needs a list of at least one tensor")
    numbers = [allgather_async(t, f"{call}.{i}", process_set) for i, t in enumerate(tensors)]
    with_handles = [unregister(n) for n in numbers]
    return register(AllOf([h for h, _ in with_handles]), lambda: [finish() for _, finish in with_handles])


def sparse_allreduce_async(tensor: torch.Tensor, name: str | None = None, op: str | None = Average,
                           process_set: Any = None) -> Callable[[], torch.Tensor]:
    """Horovod's sparse allreduce of a sparse COO tensor: every rank's indices and values gathered (the
    values divided by the size for Average); the callable waits and gives the uncoalesced sum."""
    on = engine(process_set)
    call = op_name(name, "sparse_allreduce", on)
    with refusing(call, on):
        if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
            raise InvalidCallError("sparse_allreduce_async takes a sparse COO torch tensor")
        reduce_op = resolve_op(None, op)
        if reduce_op not in (Sum, Average):
            raise InvalidCallError("sparse_allreduce_async reduces by Sum or Average")
    size = on.size
    indices = allgather_async(tensor._indices().t().contiguous(), f"{call}.indices", process_set)
    values = allgather_async(tensor._values().contiguous(), f"{call}.values", process_set)

    def result() -> torch.Tensor:
        gathered = synchronize(values)
        if reduce_op == Average:
            gathered = gathered / size
        return torch.sparse_coo_tensor(synchronize(indices).t(), gathered, tensor.shape, check_invariants=True)

    return result
