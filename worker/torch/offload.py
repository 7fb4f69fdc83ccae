"""Offload of autograd's saved activations: ZVC-compressed in host memory until backward unpacks them.

    with offloaded(compress=True) as stats:
        loss = model(x).sum()
    loss.backward()          # each saved activation is decoded (and copied back to its GPU) on use
    print(stats.ratio, stats.peak_bytes)

Every tensor autograd saves for backward passes through `pack`: parameters (leaves that require grad,
and views of them) stay where they are, as do tensors under `min_bytes`, non-contiguous ones and dtypes
ZVC has no code for. The rest are activations: on a CPU they are ZVC-encoded (lossless, so gradients are
bit-identical) and the tensor is released; on a GPU they are copied to a pinned host buffer on a side
stream (an event marks the copy's end) and, with `compress`, encoded once the copy has landed. A tensor
saved twice (a ReLU's output is saved by the ReLU and by the pooling after it) is stored once and decoded
once. Integer tensors are narrowed to the smallest dtype that holds their values first (max-pool indices).
Autograd's check that a saved tensor was not modified in place does not see through the hooks.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from sluice.transport import zvc

#: ZVC's name for each dtype it takes, and the dtype whose bits numpy can hold (bfloat16 as int16)
_CODECS: dict[torch.dtype, tuple[str, torch.dtype]] = {
    torch.float32: ("float32", torch.float32), torch.float16: ("float16", torch.float16),
    torch.float64: ("float64", torch.float64), torch.bfloat16: ("bfloat16", torch.int16),
    torch.int64: ("int64", torch.int64), torch.int32: ("int32", torch.int32),
    torch.int16: ("int16", torch.int16), torch.int8: ("int8", torch.int8), torch.uint8: ("uint8", torch.uint8),
}
#: one decoding thread for every offloader: prefetch is about overlapping with backward, not parallel decodes
_EXECUTOR: ThreadPoolExecutor | None = None
_EXECUTOR_LOCK = threading.Lock()


@dataclass
class OffloadStats:
    """What the hooks did: tensors offloaded or kept, their bytes raw and stored, bytes held now and at peak."""

    packed: int = 0
    kept: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0
    held_bytes: int = 0
    peak_bytes: int = 0
    prefetched: int = 0

    @property
    def ratio(self) -> float:
        """Raw bytes of the offloaded tensors over the bytes stored for them (1.0 when none were)."""
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0

    @property
    def memory_saved(self) -> float:
        """1 - stored / raw for the offloaded tensors."""
        return 1 - self.stored_bytes / self.raw_bytes if self.raw_bytes else 0.0

    def _hold(self, nbytes: int) -> None:
        self.held_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def _release(self, cell: list[int]) -> None:
        self.held_bytes -= cell[0]


class _Saved:
    """One saved tensor: kept as is, or a ZVC frame / pinned host copy with what rebuilds it."""

    __slots__ = ("__weakref__", "cell", "decoded", "device", "dtype", "event", "frame", "host", "index", "left",
                 "shape", "stored", "tensor", "users")

    def __init__(self, source: torch.Tensor, index: int) -> None:
        self.shape, self.dtype, self.device, self.index = source.shape, source.dtype, source.device, index
        self.stored = source.dtype  # the dtype of the frame's elements: integers may be narrowed
        self.tensor: torch.Tensor | None = None
        self.frame: bytearray | None = None
        self.host: torch.Tensor | None = None
        self.event: Any = None  # a torch.cuda.Event while the copy to the host may still be running
        self.cell = [0]  # bytes this entry holds, shared with its finalizer
        self.users = 1  # saves of the same tensor: the decoded tensor is kept until that many unpacks took it
        self.left = 0
        self.decoded: torch.Tensor | None = None


def _is_parameter(tensor: torch.Tensor) -> bool:
    base = tensor._base if tensor._base is not None else tensor
    return bool(base.is_leaf and base.requires_grad)


def _narrowest(host: torch.Tensor) -> torch.dtype:
    """The smallest integer dtype that holds every value of an int64/int32 tensor (max-pool indices fit int16:
    4x smaller before ZVC, and ZVC cannot shrink them itself: they are rarely zero); others keep theirs."""
    if host.dtype not in (torch.int64, torch.int32) or not host.numel():
        return host.dtype
    low, high = (int(v) for v in torch.aminmax(host))
    for narrow in (torch.int8, torch.int16):
        info = torch.iinfo(narrow)
        if info.min <= low and high <= info.max:
            return narrow
    return torch.int32


def _encode(host: torch.Tensor, saved: _Saved) -> bytearray:
    """`host` as a ZVC frame of its narrowest lossless dtype, which `saved` records for the decode."""
    saved.stored = _narrowest(host)
    name, view = _CODECS[saved.stored]
    array = host.detach().to(saved.stored).view(view).numpy()
    return zvc.encode(array.view(np.uint16) if name == "bfloat16" else array, dtype=name)


def _decode(frame: bytearray, shape: torch.Size, stored: torch.dtype, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """The tensor of `shape` and `dtype` in `frame`, whose elements are `stored` (narrowed integers)."""
    if pin:  # into pinned memory, so the copy back to the GPU can be asynchronous
        out = torch.empty(shape, dtype=stored, pin_memory=True)
        array = out.view(_CODECS[stored][1]).numpy().reshape(-1)
        zvc.decode_into(frame, array.view(np.uint16) if stored == torch.bfloat16 else array)
    else:  # decode's fresh calloc'd array skips the zero fill decode_into needs (a fifth of the decode time)
        flat = zvc.decode(frame, shape.numel())
        out = torch.from_numpy(flat.view(np.int16) if stored == torch.bfloat16 else flat)
        out = out.view(stored).view(shape)
    if stored == dtype:
        return out
    return torch.empty(shape, dtype=dtype, pin_memory=pin).copy_(out)  # widen narrowed integers


class Offloader:
    """The pack and unpack hooks of one `offloaded` block and their bookkeeping (see the module's doc)."""

    def __init__(self, compress: bool = True, min_bytes: int = 1 << 16, prefetch: int = 0) -> None:
        if min_bytes < 0 or prefetch < 0:
            raise ValueError(f"min_bytes and prefetch must be >= 0, got {min_bytes} and {prefetch}")
        self.compress, self.min_bytes, self.prefetch_depth = compress, min_bytes, prefetch
        self.stats = OffloadStats()
        #: id of each tensor packed -> (the tensor, its entry), both weakly: a tensor saved twice is stored once
        self._seen: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[_Saved]]] = {}
        self._order: list[weakref.ref[_Saved]] = []
        self._futures: dict[int, Future[torch.Tensor]] = {}
        self._pending: list[_Saved] = []  # host copies still to compress (CUDA)
        self._stream: Any = None

    def pack(self, tensor: torch.Tensor) -> Any:
        if _is_parameter(tensor):
            return tensor
        seen = self._seen.get(id(tensor))
        if seen is not None and seen[0]() is tensor and (earlier := seen[1]()) is not None:
            earlier.users += 1
            return earlier
        saved = _Saved(tensor, len(self._order))
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes < self.min_bytes or tensor.dtype not in _CODECS or not tensor.is_contiguous() \
                or tensor.device.type not in ("cpu", "cuda"):
            saved.tensor, saved.cell[0] = tensor, nbytes
            self.stats.kept += 1
        elif tensor.device.type == "cpu":
            saved.frame = _encode(tensor, saved) if self.compress else None
            saved.tensor = None if self.compress else tensor
            saved.cell[0] = len(saved.frame) if saved.frame is not None else nbytes
            self._count(nbytes, saved.cell[0])
        else:
            self._to_host(tensor, saved)
            self._count(nbytes, nbytes)
        self.stats._hold(saved.cell[0])
        weakref.finalize(saved, self.stats._release, saved.cell)
        key = id(tensor)
        self._seen[key] = (weakref.ref(tensor, lambda ref: self._forget(key, ref)), weakref.ref(saved))
        self._order.append(weakref.ref(saved))
        self._compress_landed(wait=False)
        return saved

    def _forget(self, key: int, ref: weakref.ref[torch.Tensor]) -> None:
        if key in self._seen and self._seen[key][0] is ref:
            del self._seen[key]

    def _count(self, raw: int, stored: int) -> None:
        self.stats.packed += 1
        self.stats.raw_bytes += raw
        self.stats.stored_bytes += stored

    def _to_host(self, tensor: torch.Tensor, saved: _Saved) -> None:
        """Start the copy of a CUDA tensor to a pinned host buffer on a side stream; an event marks its end."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(tensor.device)  # type: ignore[no-untyped-call]
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the tensor's producer first
        with torch.cuda.stream(stream):
            saved.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            saved.host.copy_(tensor, non_blocking=True)
            saved.event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            saved.event.record(stream)
        tensor.record_stream(stream)  # its memory may be reused only after the copy has read it
        saved.cell[0] = tensor.numel() * tensor.element_size()
        if self.compress:
            self._pending.append(saved)

    def _compress_landed(self, wait: bool) -> None:
        """Encode the host copies whose transfer has finished (all of them, waiting, when `wait`)."""
        still: list[_Saved] = []
        for saved in self._pending:
            if saved.host is None or not (wait or saved.event.query()):
                if saved.host is not None:
                    still.append(saved)
                continue
            saved.event.synchronize()
            saved.frame, saved.host = _encode(saved.host, saved), None
            stored = len(saved.frame)
            self.stats.stored_bytes += stored - saved.cell[0]
            self.stats.held_bytes += stored - saved.cell[0]
            saved.cell[0] = stored
        self._pending = still

    def finish(self) -> None:
        """Compress every host copy still pending (called when the block ends)."""
        self._compress_landed(wait=True)

    def unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Saved):
            return saved  # type: ignore[no-any-return]  # a parameter, returned as packed
        if saved.tensor is not None:
            return saved.tensor
        if saved.decoded is not None:  # a tensor saved twice is decoded once, for both unpacks
            host, saved.left = saved.decoded, saved.left - 1
            if not saved.left:
                saved.decoded = None
        else:
            future = self._futures.pop(saved.index, None)
            host = future.result() if future is not None else self._host(saved)
            self._prefetch_before(saved.index)
            if saved.users > 1 and saved.frame is not None:
                saved.decoded, saved.left = host, saved.users - 1
        if saved.device.type == "cuda":
            return host.to(saved.device, non_blocking=True)
        return host

    def _host(self, saved: _Saved) -> torch.Tensor:
        """The tensor on the host, decoded from its frame (into pinned memory when it goes back to a GPU)."""
        if saved.frame is not None:
            return _decode(*self._decode_args(saved))
        if saved.event is not None:
            saved.event.synchronize()
        assert saved.host is not None, "an offloaded tensor has neither a frame nor a host copy"
        return saved.host

    @staticmethod
    def _decode_args(saved: _Saved) -> tuple[bytearray, torch.Size, torch.dtype, torch.dtype, bool]:
        assert saved.frame is not None, "only an encoded entry decodes"
        return saved.frame, saved.shape, saved.stored, saved.dtype, saved.device.type == "cuda"

    def _prefetch_before(self, index: int) -> None:
        """Decode, in the background, the `prefetch` tensors saved just before `index`: backward needs them next."""
        if not self.prefetch_depth:
            return
        global _EXECUTOR
        with _EXECUTOR_LOCK:
            if _EXECUTOR is None:
                _EXECUTOR = ThreadPoolExecutor(1, thread_name_prefix="sluice-offload")
        for earlier in range(index - 1, max(index - 1 - self.prefetch_depth, -1), -1):
            saved = self._order[earlier]()
            if saved is None or saved.frame is None or earlier in self._futures:
                continue
            # the thread gets the frame, not the entry: it may hold its arguments a moment after it is done
            self._futures[earlier] = _EXECUTOR.submit(_decode, *self._decode_args(saved))
            self.stats.prefetched += 1


@contextmanager
def offloaded(compress: bool = True, min_bytes: int = 1 << 16, prefetch: int = 0) -> Iterator[OffloadStats]:
    """Offload the activations autograd saves inside the block (see the module's doc); yields live stats.

    `compress`: ZVC-encode them (on a CPU, without it they stay as they are: only counted). `min_bytes`:
    smaller tensors stay where they are. `prefetch`: when backward unpacks one tensor, decode this many
    saved before it on a background thread (off by default: on 2 CPU cores, where the model already uses
    both, it made a ReLU CNN's step slower, bench/offload.py: +114% over no offload instead of +63%).
    """
    offloader = Offloader(compress, min_bytes, prefetch)
    with torch.autograd.graph.saved_tensors_hooks(offloader.pack, offloader.unpack):
        try:
            yield offloader.stats
        finally:
            offloader.finish()
