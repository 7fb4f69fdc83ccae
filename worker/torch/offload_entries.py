"""What the offload hooks (worker/torch/offload.py) keep: their statistics, and an entry per saved tensor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class OffloadStats:
    """What the hooks did: tensors offloaded or kept, their bytes raw and stored, bytes held now and at peak;
    `lean`: ReLUs and max-pools that saved a bitmask, nothing or window offsets instead of a tensor
    (worker/torch/lean.py)."""

    packed: int = 0
    kept: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0
    held_bytes: int = 0
    peak_bytes: int = 0
    prefetched: int = 0
    lean: int = 0

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


class SavedEntry:
    """One saved tensor: kept as is, or a ZVC frame / pinned host copy with what rebuilds it."""

    __slots__ = ("__weakref__", "cell", "decoded", "device", "dtype", "event", "frame", "host", "index", "left",
                 "shape", "stored", "tensor", "users")

    def __init__(self, source: torch.Tensor, index: int) -> None:
        self.shape, self.dtype, self.device, self.index = source.shape, source.dtype, source.device, index
        self.stored = source.dtype  # the dtype of the frame's elements: integers may be narrowed
        self.tensor: torch.Tensor | None = None
        self.frame: bytearray | None = None
        self.host: tuple[torch.Tensor, ...] | None = None  # pinned: the tensor, or ZVC's (bitmask, values)
        self.event: Any = None  # a torch.cuda.Event that marks the end of the copy to the host
        self.cell = [0]  # bytes this entry holds, shared with its finalizer
        self.users = 1  # saves of the same tensor: the decoded tensor is kept until that many unpacks took it
        self.left = 0
        self.decoded: torch.Tensor | None = None


def is_parameter(tensor: torch.Tensor) -> bool:
    base = tensor._base if tensor._base is not None else tensor
    return bool(base.is_leaf and base.requires_grad)
