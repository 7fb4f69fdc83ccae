"""Lean saves for backward, as Gist: a ReLU keeps one bit per element or nothing, a 2-D max-pool window offsets.

Autograd keeps a ReLU's output for its backward, which only asks which elements were not positive, and a
max-pool's input, whose backward only needs its shape (the gradient goes where the indices say). Inside
`lean_saves()` (which `offloaded` enters by default) `F.relu`, `torch.relu`, `Tensor.relu` and
`F.max_pool2d` on tensors that need gradients run as autograd Functions that save just that:
- a max-pool keeps where in its window each maximum was: one byte for windows of up to 256 elements' span
  in the plane (2x2 windows on rows up to 254 wide), else the smallest integer type that holds the offset
  or the index, from the shape alone (int16 indices up to 181x181 planes); torch keeps int64 indices;
- a ReLU's choice waits for the first call that takes its output. Where that call saved the output too (a
  convolution's input), the ReLU shares it (stored and decoded once) and makes nothing. Where it is a
  lean max-pool, the max-pool masks its gradient where its own output is not positive (the same elements
  the ReLU would mask: a maximum is positive exactly where the ReLU passed it), settled as a ReLU's output
  is, and the ReLU keeps nothing: a ReLU followed by a max-pool, the commonest pattern in CNNs, keeps one
  byte per pooled element. The mode watches that output while it lives: a later call that takes it too
  gives the ReLU back its own bitmask. Elsewhere the ReLU keeps a bitmask (1/32 of float32).
Gradients are bit-identical to torch's: the same masking as `threshold_backward` (NaN passes, as there)
and torch's own max-pool backward kernel. In-place ReLUs (`inplace=True`, `relu_`), other dimensions of
pooling, tensor subclasses and sparse tensors, and everything else run unchanged.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.modules.utils import _pair
from torch.overrides import TorchFunctionMode

from sluice.worker.torch.tensor_zvc import pack_bits, unpack_bits

_RELUS = (F.relu, torch.relu, torch.Tensor.relu)


def _identity(value: Any) -> Any:
    return value


class _ReluSaved:
    """What one lean ReLU keeps for its backward (or a lean max-pool after a ReLU, for its own output): the
    output until the mode settles it (at the first call that takes it), then a handle on the output that
    call saved as well, or on a bitmask."""

    __slots__ = ("bits", "fused", "handle", "modified", "output", "shape", "unpack", "version")

    def __init__(self, unpack: Callable[[Any], Any]) -> None:
        self.output: torch.Tensor | None = None
        #: a lean max-pool took the output first and masks its own gradient: while no other call takes it
        #: (the mode watches it, weakly), the ReLU's backward passes the gradient through and keeps nothing
        self.fused: weakref.ref[torch.Tensor] | None = None
        self.version = 0  # the output's version counter when the ReLU made it
        self.modified = False
        self.handle: Any = None
        self.bits = False
        self.shape = torch.Size()
        self.unpack = unpack

    def settle(self, pack: Callable[[torch.Tensor], Any], share: Callable[[torch.Tensor], Any]) -> None:
        """Keep the output where another operation saved it too (stored once), else only the bitmask."""
        output, self.output = self.output, None
        assert output is not None, "a lean ReLU is settled once"
        if output._version != self.version:  # changed in place: torch's backward would refuse it, so does ours
            self.modified = True
            return
        self.handle = share(output)
        if self.handle is None:
            # torch's backward passes the gradient where not (output <= 0): NaN passes too. Inverting the
            # packed bytes is 8x less work than inverting the elements (bits past the end are never unpacked)
            self.handle, self.bits = pack(torch.bitwise_not(pack_bits(output <= 0))), True

    def unfuse(self, output: torch.Tensor, pack: Callable[[torch.Tensor], Any],
               share: Callable[[torch.Tensor], Any]) -> None:
        """A fused output that a call other than a lean max-pool takes too (or that outlives the block): the
        gradient from there is not masked, so the ReLU keeps what it would have kept."""
        self.output, self.fused = output, None
        self.settle(pack, share)

    def mask(self, grad: torch.Tensor) -> torch.Tensor:
        """`grad` where the output passed it, 0 elsewhere; `grad` itself where the max-pools that alone took the
        output masked it already."""
        passing = self.passing()
        if passing is None:
            return grad
        # torch's own kernel, with 0/1 bytes for the output: exact, and 6x faster than masked_fill or where
        passed: torch.Tensor = torch.ops.aten.threshold_backward(grad, passing, 0)
        return passed

    def passing(self) -> torch.Tensor | None:
        """What threshold_backward compares with 0: the output, or 0/1 bytes where it passes the gradient;
        None where a max-pool after it has masked the gradient already."""
        if self.modified or (self.output is not None and self.output._version != self.version):
            raise RuntimeError("one of the variables needed for gradient computation has been modified by an "
                               "inplace operation: the output of a ReLU or max-pool (lean saves, "
                               "sluice.worker.torch.lean), changed after it was made; make that operation "
                               "out of place")
        if self.output is not None:  # backward before the mode settled it: torch's own choice
            return self.output
        if self.fused is not None:
            return None
        kept: torch.Tensor = self.unpack(self.handle)
        return unpack_bits(kept, self.shape) if self.bits else kept


class _MaskedRelu(torch.autograd.Function):
    """ReLU whose backward reads what its `_ReluSaved` kept: the output, or a bitmask instead of it."""

    @staticmethod
    def forward(ctx: Any, source: torch.Tensor, saved: _ReluSaved) -> torch.Tensor:
        out = torch.relu(source)
        saved.shape, ctx.saved = out.shape, saved
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.saved.mask(grad), None


class _IndexedMaxPool2d(torch.autograd.Function):
    """2-D max-pool that saves where in its window each maximum was and its input's shape, not the input.
    With `mask` (a ReLU's output is its input), its backward first masks the gradient where its output is not
    positive, as that ReLU's backward would have at the same elements: the ReLU then keeps nothing, and the
    mask is on the pooled tensor (4x smaller with 2x2 windows, and often saved by the next layer anyway)."""

    @staticmethod
    def forward(ctx: Any, source: torch.Tensor, mask: _ReluSaved | None, kernel: tuple[int, int],
                stride: tuple[int, int], padding: tuple[int, int], dilation: tuple[int, int],
                ceil_mode: bool) -> torch.Tensor:
        out, indices = F.max_pool2d(source, kernel, stride, padding, dilation, ceil_mode, return_indices=True)
        channels_last = source.dim() == 4 and source.is_contiguous(memory_format=torch.channels_last) \
            and not source.is_contiguous()
        ctx.like = (source.shape, source.dtype, source.device,
                    torch.channels_last if channels_last else torch.contiguous_format)
        ctx.options = (kernel, stride, padding, dilation, ceil_mode)
        ctx.mask = mask
        if mask is not None:
            mask.shape = out.shape
        starts = _window_starts(tuple(out.shape[-2:]), source.shape[-1], stride, padding, source.device)
        span = (kernel[0] - 1) * dilation[0] * source.shape[-1] + (kernel[1] - 1) * dilation[1]
        narrow = _index_dtype(source.shape[-2] * source.shape[-1])
        offset = torch.uint8 if span <= torch.iinfo(torch.uint8).max else _index_dtype(span + 1)
        ctx.starts = starts if offset.itemsize < narrow.itemsize else None
        if ctx.starts is not None:  # where in its window: 0-3 for 2x2 windows, one byte whatever the plane
            ctx.save_for_backward(torch.sub(indices, starts, out=torch.empty_like(indices, dtype=offset)))
        else:
            ctx.save_for_backward(indices.to(narrow))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (kept,) = ctx.saved_tensors
        indices = kept.to(torch.int64) if ctx.starts is None else torch.add(ctx.starts, kept)
        if ctx.mask is not None:
            grad = ctx.mask.mask(grad)
        shape, dtype, device, memory_format = ctx.like
        # the kernel reads only the input's shape and layout: an empty tensor of both, never filled
        like = torch.empty(shape, dtype=dtype, device=device, memory_format=memory_format)
        kernel, stride, padding, dilation, ceil_mode = ctx.options
        grad_input = torch.ops.aten.max_pool2d_with_indices_backward(
            grad, like, kernel, stride, padding, dilation, ceil_mode, indices)
        return grad_input, None, None, None, None, None, None


@functools.lru_cache(maxsize=64)
def _window_starts(out: tuple[int, int], width: int, stride: tuple[int, int], padding: tuple[int, int],
                   device: torch.device) -> torch.Tensor:
    """Each window's first element as an index into its plane (a row `width` long): an index less that is
    where in its window the maximum was, a small number."""
    rows = torch.arange(out[0], device=device) * stride[0] - padding[0]
    columns = torch.arange(out[1], device=device) * stride[1] - padding[1]
    return rows[:, None] * width + columns[None, :]


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


def _takes(tensor: torch.Tensor, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether a call's arguments hold `tensor` (directly or in a list, as torch.cat's)."""
    for arg in (*args, *kwargs.values()):
        if arg is tensor or (isinstance(arg, list | tuple) and any(item is tensor for item in arg)):
            return True
    return False


def _made_tensors(result: Any) -> bool:
    """Whether a call's result is a tensor or holds some (a torch.Size, a tuple too, is no operation's output)."""
    return isinstance(result, torch.Tensor) or (
        isinstance(result, list | tuple) and any(isinstance(item, torch.Tensor) for item in result))


class LeanSaves(TorchFunctionMode):
    """The mode `lean_saves` enters; `replaced` counts the calls it ran as lean Functions."""

    def __init__(self, pack: Callable[[torch.Tensor], Any] = _identity, unpack: Callable[[Any], Any] = _identity,
                 share: Callable[[torch.Tensor], Any] = lambda tensor: None) -> None:
        super().__init__()
        self.replaced = 0
        self.pack, self.unpack, self.share = pack, unpack, share
        self._pending: list[_ReluSaved] = []  # ReLUs whose output no call has taken yet
        self._fused: list[_ReluSaved] = []  # ReLUs whose output only lean max-pools took, while it lives
        self._pooled: _ReluSaved | None = None  # the ReLU the current call, a lean max-pool, masks for

    def __torch_function__(self, func: Callable[..., Any], types: Sequence[type], args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        takers = [saved for saved in self._pending if saved.output is not None
                  and _takes(saved.output, args, kwargs)] if self._pending else []
        watched = self._watched_in(args, kwargs) if self._fused else []
        self._pooled = None
        result = self._call(func, args, kwargs, takers, watched)
        # a call that made tensors of a ReLU's output has saved it for its backward by now, or never will
        # (.dim() or .shape make none: they settle nothing)
        if (takers or watched) and _made_tensors(result):
            for saved in takers:
                self._pending.remove(saved)
                if saved.fused is not None:  # the max-pool masks for it: watch the output, do not hold it
                    saved.output = None
                    self._fused.append(saved)
                else:
                    saved.settle(self.pack, self.share)
            for saved, output in watched:
                if saved is not self._pooled:  # its gradient from this call is not masked: the ReLU masks it
                    self._fused.remove(saved)
                    saved.unfuse(output, self.pack, self.share)
        return result

    def _watched_in(self, args: Sequence[Any], kwargs: dict[str, Any]) -> list[tuple[_ReluSaved, torch.Tensor]]:
        """The fused ReLUs whose output this call takes, with it; those whose output died are forgotten (fused
        for good: nothing else can take it now)."""
        alive, taken = [], []
        for saved in self._fused:
            output = saved.fused() if saved.fused is not None else None
            if output is not None:
                alive.append(saved)
                if _takes(output, args, kwargs):
                    taken.append((saved, output))
        self._fused = alive
        return taken

    def _call(self, func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any],
              takers: list[_ReluSaved], watched: list[tuple[_ReluSaved, torch.Tensor]]) -> Any:
        source = args[0] if args else None
        # plain dense tensors only: subclasses (DTensor, fakes) and sparse layouts keep torch's own ops
        if isinstance(source, torch.Tensor) and type(source) in (torch.Tensor, torch.nn.Parameter) \
                and source.layout == torch.strided \
                and source.requires_grad and torch.is_grad_enabled():
            if func in _RELUS and len(args) <= 2 and not (args[1] if len(args) == 2 else kwargs.get("inplace")):
                self.replaced += 1
                saved = _ReluSaved(self.unpack)
                return self._watch(saved, _MaskedRelu.apply(source, saved))  # type: ignore[no-untyped-call]
            if func is F.max_pool2d and source.dim() in (3, 4):
                options = _pool_options(*args[1:], **kwargs)
                if options is not None:
                    self.replaced += 1
                    # a ReLU's output that no other call took first (another max-pool may have: both mask)
                    relu = next((saved for saved in takers if saved.output is source), None) or next(
                        (saved for saved, output in watched if output is source), None)
                    if relu is None:
                        return _IndexedMaxPool2d.apply(source, None, *options)  # type: ignore[no-untyped-call]
                    relu.fused, self._pooled = weakref.ref(source), relu
                    mask = _ReluSaved(self.unpack)  # settled as a ReLU's output is: shared, or a bitmask
                    return self._watch(mask, _IndexedMaxPool2d.apply(source, mask, *options))  # type: ignore[no-untyped-call]
        return func(*args, **kwargs)

    def _watch(self, saved: _ReluSaved, output: torch.Tensor) -> torch.Tensor:
        """Settle `saved` at the first call that takes `output` (see `_ReluSaved`)."""
        saved.output, saved.version = output, output._version
        self._pending.append(saved)
        return output

    def __exit__(self, *exc: object) -> None:
        for saved in self._fused:
            output = saved.fused() if saved.fused is not None else None
            if output is not None:  # alive after the block: what takes it next is not watched
                saved.unfuse(output, self.pack, self.share)
        for saved in self._pending:  # outputs no call took inside the block (a stage's last ReLU)
            saved.settle(self.pack, self.share)
        self._pending.clear()
        self._fused.clear()
        super().__exit__(*exc)  # type: ignore[no-untyped-call]


def lean_saves(pack: Callable[[torch.Tensor], Any] = _identity, unpack: Callable[[Any], Any] = _identity,
               share: Callable[[torch.Tensor], Any] = lambda tensor: None) -> LeanSaves:
    """A context manager in which ReLUs and 2-D max-pools save only what their backward reads (see above).
    `pack` and `unpack` store and return a ReLU's bitmask (by default it is kept as it is); `share(t)` gives
    a handle that `unpack` turns into `t` where `t` has been saved already (an offloader's entry), else None."""
    return LeanSaves(pack, unpack, share)
