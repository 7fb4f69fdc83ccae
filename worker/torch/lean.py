"""Lean saves for backward, as Gist: a ReLU keeps one bit per element, a 2-D max-pool only its narrowed indices.

Autograd keeps a ReLU's output for its backward, which only asks which elements were not positive, and a
max-pool's input, whose backward only needs its shape (the gradient goes where the indices say). Inside
`lean_saves()` (which `offloaded` enters by default) `F.relu`, `torch.relu`, `Tensor.relu` and
`F.max_pool2d` on tensors that need gradients run as autograd Functions that save just that: a bitmask
(1/32 of float32) and the indices, in the smallest integer type the input's plane allows (int16 up to
181x181: a quarter of torch's int64). A ReLU followed by a max-pool, the commonest pattern in CNNs, then keeps
no float activation at all; a ReLU before a convolution still has its output kept (and ZVC-coded), by
the convolution. Gradients are bit-identical to torch's: the same masking as `threshold_backward` (NaN
passes, as there) and torch's own max-pool backward kernel.
In-place ReLUs (`inplace=True`, `relu_`), other dimensions of pooling and everything else run unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.modules.utils import _pair
from torch.overrides import TorchFunctionMode

from sluice.worker.torch.tensor_zvc import pack_bits, unpack_bits

_RELUS = (F.relu, torch.relu, torch.Tensor.relu)


class _MaskedRelu(torch.autograd.Function):
    """ReLU that saves which outputs pass the gradient, one bit each, instead of the output."""

    @staticmethod
    def forward(ctx: Any, source: torch.Tensor) -> torch.Tensor:
        out = torch.relu(source)
        ctx.shape = out.shape
        # torch's backward passes the gradient where not (output <= 0): NaN passes too. Inverting the packed
        # bytes is 8x less work than inverting the elements (the bits past the end are never unpacked)
        ctx.save_for_backward(torch.bitwise_not(pack_bits(out <= 0)))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (bits,) = ctx.saved_tensors
        # torch's own kernel, with 0/1 bytes for the output: exact, and 6x faster than masked_fill or where
        passed: torch.Tensor = torch.ops.aten.threshold_backward(grad, unpack_bits(bits, ctx.shape), 0)
        return passed


class _IndexedMaxPool2d(torch.autograd.Function):
    """2-D max-pool that saves its indices and its input's shape, not the input."""

    @staticmethod
    def forward(ctx: Any, source: torch.Tensor, kernel: tuple[int, int], stride: tuple[int, int],
                padding: tuple[int, int], dilation: tuple[int, int], ceil_mode: bool) -> torch.Tensor:
        out, indices = F.max_pool2d(source, kernel, stride, padding, dilation, ceil_mode, return_indices=True)
        channels_last = source.dim() == 4 and source.is_contiguous(memory_format=torch.channels_last) \
            and not source.is_contiguous()
        ctx.like = (source.shape, source.dtype, source.device,
                    torch.channels_last if channels_last else torch.contiguous_format)
        ctx.options = (kernel, stride, padding, dilation, ceil_mode)
        ctx.save_for_backward(indices.to(_index_dtype(source.shape[-2] * source.shape[-1])))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (indices,) = ctx.saved_tensors
        shape, dtype, device, memory_format = ctx.like
        # the kernel reads only the input's shape and layout: an empty tensor of both, never filled
        like = torch.empty(shape, dtype=dtype, device=device, memory_format=memory_format)
        kernel, stride, padding, dilation, ceil_mode = ctx.options
        grad_input = torch.ops.aten.max_pool2d_with_indices_backward(
            grad, like, kernel, stride, padding, dilation, ceil_mode, indices.to(torch.int64))
        return grad_input, None, None, None, None, None


def _index_dtype(plane: int) -> torch.dtype:
    """The smallest integer dtype for indices into a plane of `plane` elements (what a max-pool's are): known
    from the shape, so no pass over the values and, on a GPU, no wait for them; 4x fewer bytes as int16."""
    for dtype in (torch.int16, torch.int32):
        if plane - 1 <= torch.iinfo(dtype).max:
            return dtype
    return torch.int64


def _pool_options(kernel_size: Any, stride: Any = None, padding: Any = 0, dilation: Any = 1,
                  ceil_mode: bool = False, return_indices: bool = False) -> tuple[Any, ...] | None:
    """F.max_pool2d's arguments as pairs, or None where the lean path does not apply (indices returned)."""
    if return_indices:
        return None
    kernel = _pair(kernel_size)
    return kernel, _pair(stride) if stride not in (None, [], ()) else kernel, _pair(padding), _pair(dilation), \
        bool(ceil_mode)


class LeanSaves(TorchFunctionMode):
    """The mode `lean_saves` enters; `replaced` counts the calls it ran as lean Functions."""

    def __init__(self) -> None:
        super().__init__()
        self.replaced = 0

    def __torch_function__(self, func: Callable[..., Any], types: Sequence[type], args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        source = args[0] if args else None
        if isinstance(source, torch.Tensor) and source.requires_grad and torch.is_grad_enabled():
            inplace = args[1] if len(args) > 1 else kwargs.get("inplace", False)
            if func in _RELUS and len(args) <= 2 and not inplace:
                self.replaced += 1
                return _MaskedRelu.apply(source)  # type: ignore[no-untyped-call]
            if func is F.max_pool2d and source.dim() in (3, 4):
                options = _pool_options(*args[1:], **kwargs)
                if options is not None:
                    self.replaced += 1
                    return _IndexedMaxPool2d.apply(source, *options)  # type: ignore[no-untyped-call]
        return func(*args, **kwargs)


def lean_saves() -> LeanSaves:
    """A context manager in which ReLUs and 2-D max-pools save only what their backward reads (see above)."""
    return LeanSaves()
