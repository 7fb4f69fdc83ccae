"""Differentiable collectives, as horovod.torch's: a gradient flows back through allreduce, allgather and broadcast.

The backward passes follow Horovod (>= 0.21): allreduce's gradient is the allreduce of the output's
gradient with the same op and scale factors (for Min and Max only the ranks that hold the extreme
receive it, and for Product each rank its share y / x, where Horovod gives neither); allgather's is
the average of the output's gradient over the ranks, narrowed to this rank's rows; broadcast's is that
average on the root rank and zero elsewhere. The forward passes are the in-place collectives of
collectives.py on a copy, so the input is never modified.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from sluice.errors import InvalidCallError
from sluice.worker.collective.blocks import block
from sluice.worker.torch.calls import engine, op_name, refusing
from sluice.worker.torch.collectives import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    allgather_async,
    alltoall_async,
    alltoall_splits,
    broadcast_async_,
    grouped_allreduce_async_,
    resolve_op,
    synchronize,
)
from sluice.worker.torch.compression import Compression, Compressor
from sluice.worker.torch.scatter import check_reducescatter
from sluice.worker.torch.state import require


def _reduced(tensors: Sequence[torch.Tensor], op: str, pre: float, post: float, name: str | None,
             process_set: Any = None) -> list[torch.Tensor]:
    outputs = [t.detach().clone() for t in tensors]
    return synchronize(grouped_allreduce_async_(outputs, None, name, op, pre, post,  # type: ignore[no-any-return]
                                                process_set))


def _reduced_grads(ctx: Any, grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients of the inputs of a (grouped) allreduce, from those of its outputs."""
    if ctx.op in (Average, Sum, Adasum):  # Horovod's: the same op and factors, the same process set
        return _reduced(grads, ctx.op, ctx.pre, ctx.post, None, ctx.process_set)
    inputs, outputs = ctx.saved_tensors[: len(grads)], ctx.saved_tensors[len(grads):]
    summed = _reduced(grads, Sum, 1.0, 1.0, None, ctx.process_set)
    if ctx.op in (Min, Max):
        return [g * (x == y) for g, x, y in zip(summed, inputs, outputs, strict=True)]
    return [g * y / x for g, x, y in zip(summed, inputs, outputs, strict=True)]  # Product: d(prod)/dx = prod / x


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, op: str, pre: float, post: float, process_set: Any,
                *tensors: torch.Tensor) -> Any:
        ctx.op, ctx.pre, ctx.post, ctx.process_set = op, pre, post, process_set
        outputs = _reduced(tensors, op, pre, post, name, process_set)
        if op in (Min, Max, Product):
            ctx.save_for_backward(*tensors, *outputs)
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        return (None, None, None, None, None, *_reduced_grads(ctx, grads))


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                      compression: type[Compressor] = Compression.none, op: str | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: Any = None) -> list[torch.Tensor]:
    """Reduce every tensor of the group over all ranks as one request; differentiable."""
    on = engine(process_set)
    call = op_name(name, "allreduce", on)
    with refusing(call, on):
        reduce_op = resolve_op(average, op)
        if not isinstance(tensors, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in tensors):
            raise InvalidCallError(f"allreduce takes torch tensors, got {type(tensors).__name__}")
        packed = [compression.compress(t) for t in tensors]
    outputs = _Allreduce.apply(call, reduce_op, prescale_factor, postscale_factor, process_set,  # type: ignore[no-untyped-call]
                               *(c for c, _ in packed))
    return [compression.decompress(out, context) for out, (_, context) in zip(outputs, packed, strict=True)]


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: type[Compressor] = Compression.none, op: str | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: Any = None) -> torch.Tensor:
    """The tensor reduced over all ranks by `op` (Average by default), as a new tensor; differentiable.
    `compression` casts it for the wire (Compression.fp16, bf16) and back."""
    group = [tensor] if isinstance(tensor, torch.Tensor) else tensor  # anything else: the group's checks refuse it
    return grouped_allreduce(group, average, name, compression, op, prescale_factor, postscale_factor,
                             process_set)[0]


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, process_set: Any) -> Any:
        ctx.rows, ctx.process_set = tensor.shape[0], process_set
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        reduced = _reduced([grad], Average, 1.0, 1.0, None, ctx.process_set)[0]
        rows = synchronize(allgather_async(torch.tensor([ctx.rows], dtype=torch.int64), None, ctx.process_set))
        offset = int(rows[: engine(ctx.process_set).rank].sum())
        return reduced.narrow(0, offset, ctx.rows), None, None


def allgather(tensor: torch.Tensor, name: str | None = None, process_set: Any = None) -> torch.Tensor:
    """Every rank's tensor concatenated along the first dimension (which may differ per rank); differentiable."""
    on = engine(process_set)
    call = op_name(name, "allgather", on)
    with refusing(call, on):
        if not isinstance(tensor, torch.Tensor):
            raise InvalidCallError(f"allgather takes a torch tensor, got {type(tensor).__name__}")
    return _Allgather.apply(tensor, call, process_set)  # type: ignore[no-untyped-call, no-any-return]


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None, process_set: Any) -> Any:
        ctx.root, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async_(tensor.detach().clone(), root_rank, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        reduced = _reduced([grad], Average, 1.0, 1.0, None, ctx.process_set)[0]
        return (reduced if require().rank == ctx.root else torch.zeros_like(reduced)), None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None) -> torch.Tensor:
    """`root_rank`'s tensor on every rank, as a new tensor; differentiable."""
    on = engine(process_set)
    call = op_name(name, "broadcast", on)
    with refusing(call, on):
        if not isinstance(tensor, torch.Tensor):
            raise InvalidCallError(f"broadcast takes a torch tensor, got {type(tensor).__name__}")
    return _Broadcast.apply(tensor, root_rank, call, process_set)  # type: ignore[no-untyped-call, no-any-return]


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: list[int] | None, name: str | None, process_set: Any) -> Any:
        output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received, ctx.process_set = received.tolist(), process_set
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _received: Any) -> Any:
        # the rows this rank received from rank i go back to rank i: an alltoall with the received splits
        back, _ = synchronize(alltoall_async(grad.contiguous(), ctx.received, None, ctx.process_set))
        return back, None, None, None


def alltoall(tensor: torch.Tensor, splits: Sequence[int] | torch.Tensor | None = None, name: str | None = None,
             process_set: Any = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Row block i of `tensor` (sizes `splits`; None: equal blocks) goes to rank i; differentiable. With
    `splits` given, also the rows received from each rank (as Horovod)."""
    on = engine(process_set)
    call = op_name(name, "alltoall", on)
    with refusing(call, on):
        if not isinstance(tensor, torch.Tensor):
            raise InvalidCallError(f"alltoall takes a torch tensor, got {type(tensor).__name__}")
        split_list = alltoall_splits(splits, tensor.shape[0] if tensor.dim() else 0, on.size)
    output, received = _Alltoall.apply(tensor, split_list, call, process_set)  # type: ignore[no-untyped-call]
    return (output, received) if splits is not None else output


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str, op: str, pre: float, post: float, process_set: Any) -> Any:
        ctx.op, ctx.scale, ctx.process_set = op, pre * post, process_set
        on = engine(process_set)
        reduced = _reduced([tensor], op, pre, post, name, process_set)[0]
        return reduced[block(tensor.shape[0], on.rank, on.size)]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        # Horovod's: the allgather of the blocks' gradients, times the size for a sum, times both factors
        scale = ctx.scale * (engine(ctx.process_set).size if ctx.op == Sum else 1)
        scaled = grad.contiguous() * scale if scale != 1 else grad.contiguous()
        return synchronize(allgather_async(scaled, None, ctx.process_set)), None, None, None, None, None


def reducescatter(tensor: torch.Tensor, name: str | None = None, compression: type[Compressor] = Compression.none,
                  op: str | None = Average, process_set: Any = None, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """This rank's block of the first dimension of the reduced tensor (blocks as even as they can be, the
    first ones one row longer, as Horovod splits); Sum or Average only, as Horovod. Built on allreduce:
    it moves the whole tensor, not a 1/size share of it; differentiable (Horovod's gradient: the
    allgather of the blocks' gradients)."""
    on = engine(process_set)
    call = op_name(name, "reducescatter", on)
    with refusing(call, on):
        reduce_op = check_reducescatter([tensor], op)
        compressed, context = compression.compress(tensor)
    out = _Reducescatter.apply(compressed, call, reduce_op, prescale_factor, postscale_factor, process_set)  # type: ignore[no-untyped-call]
    return compression.decompress(out, context)
