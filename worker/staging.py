"""Host memory for torch tensors: the tensor itself on the CPU, else a pinned staging buffer."""

from __future__ import annotations

import numpy as np
import torch

from scheduler.errors import SluiceError

DTYPES = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.int8: "int8",
    torch.uint8: "uint8",
}


def wire_dtype(tensor: torch.Tensor) -> str:
    if tensor.dtype not in DTYPES:
        raise SluiceError(f"dtype {tensor.dtype} is not supported; use one of {sorted(DTYPES.values())}")
    return DTYPES[tensor.dtype]


class Staging:
    """Host memory that Sluice reads and writes for `tensor`: the tensor itself on the CPU, else pinned."""

    __slots__ = ("direct", "host")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.direct = tensor.device.type == "cpu" and tensor.is_contiguous()
        if self.direct:
            self.host = tensor.detach()
        else:
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=torch.cuda.is_available())

    def array(self) -> np.ndarray:
        host = self.host
        if host.dtype == torch.bfloat16:
            return host.view(torch.int16).numpy().view(np.uint16)
        return host.numpy()

    def load(self, tensor: torch.Tensor) -> np.ndarray:
        if not self.direct:
            self.host.copy_(tensor.detach())
        return self.array()

    def store(self, tensor: torch.Tensor) -> None:
        if not self.direct:
            with torch.no_grad():
                tensor.copy_(self.host, non_blocking=False)
