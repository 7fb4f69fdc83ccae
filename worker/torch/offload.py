"""Offload of autograd's saved activations: ZVC-compressed in host memory, fetched back ahead of backward.

    with offloaded() as stats:
        loss = model(x).sum()
    loss.backward()          # saved activations come back (decoded, copied to their GPU) ahead of use
    print(stats.ratio, stats.peak_bytes)

Every tensor autograd saves for backward passes through `pack`: parameters (leaves that require grad,
and views of them) stay where they are, as do tensors under `min_bytes`, non-contiguous ones and dtypes
ZVC has no code for. The rest are activations. By default ReLUs and 2-D max-pools save a bitmask and
window offsets instead (worker/torch/lean.py). On a CPU, the rest stay as they are unless `compress`, or
without lean saves: then they are ZVC-encoded (lossless, so gradients are bit-identical; integer tensors
narrowed first to the smallest dtype that holds their values) and the tensor is released. On a GPU they
are copied to pinned host buffers on a side stream, with `compress` ZVC-packed on the GPU first (a
bitmask and the non-zeros, as cDMA); an event marks the copy's end, and the host stays at most
`copies_ahead` copies ahead, or the GPU memory would not be reused. When backward unpacks a GPU tensor,
the copies back of the next `prefetch` ones it will need (those saved just before it) start on a second
side stream once the GPU has reached that point, so that backward finds them on the GPU. A tensor saved
twice (a ReLU's output is saved by the ReLU and by the convolution after it) is stored once and decoded
once.
Autograd's check that a saved tensor was not modified in place does not see through the hooks.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import torch

from sluice.worker.torch.lean import lean_saves
from sluice.worker.torch.offload_entries import OffloadStats, SavedEntry, is_parameter
from sluice.worker.torch.tensor_zvc import CODECS, decode_tensor, encode_tensor, pack_nonzeros, unpack_nonzeros

__all__ = ["COPIES_AHEAD", "CUDA_PREFETCH", "MIN_SAVING", "OffloadStats", "Offloader", "offloaded"]

#: one decoding thread for every offloader: prefetch is about overlapping with backward, not parallel decodes
_EXECUTOR: ThreadPoolExecutor | None = None
#: GPU tensors whose copy back starts ahead of their use by default: enough to hide one copy behind the
#: backward of the layer before, little GPU memory held ahead
CUDA_PREFETCH = 2
#: copies of GPU tensors to the host that forward may run ahead of (each holds its tensor's GPU memory)
COPIES_AHEAD = 2
#: a CPU tensor whose ZVC frame would save less than this fraction of its bytes is kept as it is: encoding
#: and decoding it would cost nearly as much as one that saves half (see `offloaded`)
MIN_SAVING = 0.2
#: how far back from the tensor unpacked the prefetch looks for offloaded ones (kept tensors are skipped)
_SCAN = 8
_EXECUTOR_LOCK = threading.Lock()


class Offloader:
    """The pack and unpack hooks of one `offloaded` block and their bookkeeping (see the module's doc)."""

    def __init__(self, compress: bool | None = None, min_bytes: int = 1 << 16, prefetch: int | None = None,
                 copies_ahead: int = COPIES_AHEAD, keep_last: int = 0, min_saving: float = MIN_SAVING) -> None:
        if min_bytes < 0 or (prefetch is not None and prefetch < 0) or copies_ahead < 1 or keep_last < 0:
            raise ValueError(f"min_bytes, prefetch and keep_last must be >= 0 and copies_ahead >= 1, got "
                             f"{min_bytes}, {prefetch}, {keep_last} and {copies_ahead}")
        if not 0 <= min_saving <= 1:
            raise ValueError(f"min_saving is a fraction of a tensor's bytes, from 0 to 1; got {min_saving}")
        self.compress, self.min_bytes, self.prefetch_depth = compress, min_bytes, prefetch
        self.copies_ahead, self.keep_last, self.min_saving = copies_ahead, keep_last, min_saving
        # the hooks run between torch's operations, while its intra-op threads are idle: ZVC may use them all
        self.threads = max(1, torch.get_num_threads())
        self._recent: deque[tuple[SavedEntry, torch.Tensor]] = deque()  # the last GPU tensors, while the block runs
        self.stats = OffloadStats()
        #: id of each tensor packed -> (the tensor, its entry), both weakly: a tensor saved twice is stored once
        self._seen: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[SavedEntry]]] = {}
        self._order: list[weakref.ref[SavedEntry]] = []
        self._futures: dict[int, Future[torch.Tensor]] = {}  # index -> its decode on the background thread
        self._fetched: dict[int, tuple[torch.Tensor, Any]] = {}  # index -> (on its GPU, event of the copy back)
        self._fetch_stream: Any = None
        self._stream: Any = None
        self._copies: deque[Any] = deque()  # events of the copies to the host not yet waited for

    def share(self, tensor: torch.Tensor) -> Any:
        """A handle that `unpack` turns into `tensor` if it was packed already, else None: its entry, or where
        it is kept as it is, the tensor without its graph (a lean ReLU's backward, holding its own output's
        entry, would hold the graph that holds it: a cycle only the garbage collector frees)."""
        earlier = self._earlier(tensor)
        return earlier.tensor.detach() if earlier is not None and earlier.tensor is not None else earlier

    def _earlier(self, tensor: torch.Tensor) -> SavedEntry | None:
        """The entry of `tensor` if it was packed already (now with one more user: `unpack` gives it back to
        each), else None."""
        seen = self._seen.get(id(tensor))
        if seen is not None and seen[0]() is tensor and (earlier := seen[1]()) is not None:
            earlier.users += 1
            return earlier
        return None

    def pack(self, tensor: torch.Tensor) -> Any:
        if is_parameter(tensor):
            return tensor
        earlier = self._earlier(tensor)
        if earlier is not None:
            return earlier
        saved = SavedEntry(tensor, len(self._order))
        nbytes = tensor.numel() * tensor.element_size()
        cpu = tensor.device.type == "cpu"
        keep = nbytes < self.min_bytes or tensor.dtype not in CODECS or not tensor.is_contiguous() \
            or not (cpu or tensor.device.type == "cuda")
        encoded = None
        if not keep and cpu and self.compress is not False:
            encoded = encode_tensor(tensor, self.threads, self.min_saving)
            keep = encoded is None  # ZVC would barely shrink it: a copy for nothing
        if keep:
            saved.tensor, saved.cell[0] = tensor, nbytes
            self.stats.kept += 1
        elif cpu:
            if encoded is None:  # compress=False: counted only
                saved.tensor, saved.cell[0] = tensor, nbytes
            else:
                (saved.frame, saved.stored), saved.cell[0] = encoded, len(encoded[0])
            self._count(nbytes, saved.cell[0])
        else:
            self._to_host(tensor, saved)
            self._count(nbytes, saved.cell[0])
            if self.keep_last:
                self._recent.append((saved, tensor))
                if len(self._recent) > self.keep_last:
                    self._recent.popleft()
        self.stats._hold(saved.cell[0])
        weakref.finalize(saved, self.stats._release, saved.cell)
        key = id(tensor)
        self._seen[key] = (weakref.ref(tensor, lambda ref: self._forget(key, ref)), weakref.ref(saved))
        self._order.append(weakref.ref(saved))
        return saved

    def _forget(self, key: int, ref: weakref.ref[torch.Tensor]) -> None:
        if key in self._seen and self._seen[key][0] is ref:
            del self._seen[key]

    def _count(self, raw: int, stored: int) -> None:
        self.stats.packed += 1
        self.stats.raw_bytes += raw
        self.stats.stored_bytes += stored

    def _to_host(self, tensor: torch.Tensor, saved: SavedEntry) -> None:
        """Start the copy of a CUDA tensor (ZVC-packed on the GPU first, with `compress`) to pinned host
        buffers on a side stream; an event marks its end."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(tensor.device)  # type: ignore[no-untyped-call]
        stream = self._stream
        # as cDMA does: fewer bytes over the link (integers, such as max-pool indices, are rarely zero)
        parts = pack_nonzeros(tensor) if self.compress is True and tensor.is_floating_point() else (tensor,)
        stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the parts' producers first
        with torch.cuda.stream(stream):
            saved.host = tuple(torch.empty(p.shape, dtype=p.dtype, pin_memory=True) for p in parts)
            for host, part in zip(saved.host, parts, strict=True):
                host.copy_(part, non_blocking=True)
            saved.event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            saved.event.record(stream)
        for part in parts:
            part.record_stream(stream)  # its memory may be reused only after the copy has read it
        saved.cell[0] = sum(p.numel() * p.element_size() for p in parts)
        # The allocator reuses a tensor's memory once its copy has ended as seen from the host; a host that
        # ran ahead of the copies would allocate anew for every layer and save no GPU memory at all. So the
        # host waits for the copy `copies_ahead` before this one: the forward stays that many copies ahead.
        self._copies.append(saved.event)
        while len(self._copies) > self.copies_ahead:
            self._copies.popleft().synchronize()

    def finish(self) -> None:
        """Keep the last `keep_last` GPU tensors where they are (called when the block ends)."""
        for saved, tensor in self._recent:  # backward, if it follows at once, needs them first
            saved.tensor, saved.host = tensor, None
        self._recent.clear()

    def unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, SavedEntry):
            return saved  # type: ignore[no-any-return]  # a parameter, returned as packed
        if saved.tensor is not None:
            return saved.tensor
        if saved.decoded is not None:  # a tensor saved twice comes back once, for both unpacks
            tensor, saved.left = saved.decoded, saved.left - 1
            if not saved.left:
                saved.decoded = None
            return tensor
        tensor = self._take(saved)
        self._prefetch_before(saved)
        if saved.users > 1:
            saved.decoded, saved.left = tensor, saved.users - 1
        return tensor

    def _take(self, saved: SavedEntry) -> torch.Tensor:
        """The tensor back where it was saved: fetched (or decoded) ahead, else now."""
        if saved.device.type != "cuda":
            future = self._futures.pop(saved.index, None)
            return future.result() if future is not None else self._host(saved)
        fetched = self._fetched.pop(saved.index, None)
        tensor, copied = fetched if fetched is not None else self._fetch(saved)
        stream = torch.cuda.current_stream(saved.device)
        stream.wait_event(copied)
        tensor.record_stream(stream)  # its memory may be reused only after this stream's use of it
        # A prefetched copy started once the GPU's backward had reached the unpack that asked for it (see
        # _prefetch_before): waiting for it here keeps the host, and the memory it allocates for copies
        # back, a few layers ahead of the GPU instead of the whole backward.
        copied.synchronize()
        return tensor

    def _fetch(self, saved: SavedEntry, after: Any = None) -> tuple[torch.Tensor, Any]:
        """Start the copy of an offloaded tensor back to its GPU (and its unpacking there) on the fetch stream,
        once the GPU has passed event `after` (if given); an event marks the end."""
        if self._fetch_stream is None:
            self._fetch_stream = torch.cuda.Stream(saved.device)  # type: ignore[no-untyped-call]
        stream = self._fetch_stream
        assert saved.host is not None, "an offloaded GPU tensor has no host copy"
        with torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)
            stream.wait_event(saved.event)  # the copy to the host has landed
            # the pinned allocator keeps each host buffer until its copy is done
            parts = [host.to(saved.device, non_blocking=True) for host in saved.host]
            tensor = unpack_nonzeros(parts[0], parts[1], saved.shape, saved.dtype) if len(parts) == 2 else parts[0]
            copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
            copied.record(stream)
        return tensor, copied

    def _host(self, saved: SavedEntry) -> torch.Tensor:
        """A CPU tensor decoded from its frame."""
        assert saved.frame is not None, "an offloaded CPU tensor has no frame"
        return decode_tensor(*self._decode_args(saved), self.threads)

    @staticmethod
    def _decode_args(saved: SavedEntry) -> tuple[bytearray, torch.Size, torch.dtype, torch.dtype]:
        assert saved.frame is not None, "only an encoded entry decodes"
        return saved.frame, saved.shape, saved.stored, saved.dtype

    def _prefetch_before(self, saved: SavedEntry) -> None:
        """Bring back ahead the `prefetch` offloaded tensors saved just before `saved`: backward needs them next.
        A GPU tensor's copy back starts on the fetch stream; a CPU tensor is decoded on a background thread."""
        depth = self.prefetch_depth if self.prefetch_depth is not None else (
            CUDA_PREFETCH if saved.device.type == "cuda" else 0)
        found, reached = 0, None
        for earlier in range(saved.index - 1, max(saved.index - 1 - _SCAN * depth, -1), -1):
            if found == depth:
                break
            entry = self._order[earlier]()
            if entry is None or entry.tensor is not None or entry.decoded is not None:
                continue  # used already, kept where it was, or back already
            found += 1
            if earlier in self._fetched or earlier in self._futures:
                continue
            if entry.device.type == "cuda":
                if reached is None:  # where the GPU's backward is now: copies back start no earlier
                    reached = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    reached.record(torch.cuda.current_stream(entry.device))
                self._fetched[earlier] = self._fetch(entry, reached)
            elif entry.frame is not None:
                self._futures[earlier] = _decoder().submit(decode_tensor, *self._decode_args(entry))
            else:
                continue
            self.stats.prefetched += 1


def _decoder() -> ThreadPoolExecutor:
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = ThreadPoolExecutor(1, thread_name_prefix="sluice-offload")
        return _EXECUTOR


@contextmanager
def offloaded(compress: bool | None = None, min_bytes: int = 1 << 16, prefetch: int | None = None,
              copies_ahead: int = COPIES_AHEAD, keep_last: int = 0, lean: bool = True,
              min_saving: float = MIN_SAVING) -> Iterator[OffloadStats]:
    """Offload the activations autograd saves inside the block (see the module's doc); yields live stats.

    `compress`: ZVC-encode them. By default (None) on a CPU only without lean saves, and never on a GPU.
    With lean saves, what a ReLU CNN leaves on a CPU is mostly its convolutions' inputs, half non-zero: ZVC
    saves more but costs more time than it saves memory (bench/offload.py, 2 cores: 51% of the activation
    memory saved at +8% step time with lean saves alone, 68% at +46% with ZVC too). On a GPU, packing
    before the copy measured slower than copying the zeros (an H200: its count of non-zeros syncs the host
    each time). Without it, CPU tensors stay as they are (only counted). `min_bytes`:
    smaller tensors stay where they are. `prefetch`: when backward unpacks one tensor, bring back this many
    offloaded ones saved before it, which backward needs next. By default `CUDA_PREFETCH` for GPU tensors
    (their copies back run on a side stream) and none for CPU tensors, whose prefetch is a decode on a
    background thread: on 2 CPU cores, where the model already uses both, that made a ReLU CNN's step
    slower (bench/offload.py: +114% over no offload instead of +63%). `copies_ahead`: GPU tensors whose
    copy to the host may still run while forward goes on (each holds its GPU memory until copied).
    `keep_last`: the last GPU tensors saved in the block also stay on the GPU, for a backward that follows
    at once and needs them first (off by default: a pipeline stage's backward comes much later).
    `lean`: ReLUs and 2-D max-pools in the block save a bitmask (or nothing) and window offsets instead of
    tensors (`lean_saves`).
    `min_saving`: a CPU tensor is ZVC-encoded only when that saves at least this fraction of its bytes,
    estimated from a sample (dense tensors, such as a max-pool's output, stay as they are).
    """
    offloader = Offloader(False if compress is None and lean else compress, min_bytes, prefetch, copies_ahead,
                          keep_last, min_saving)
    mode = lean_saves(offloader.pack, offloader.unpack, offloader.share) if lean else None
    with torch.autograd.graph.saved_tensors_hooks(offloader.pack, offloader.unpack), \
            mode if mode is not None else contextlib.nullcontext():
        try:
            yield offloader.stats
        finally:
            offloader.finish()
            offloader.stats.lean = mode.replaced if mode is not None else 0
