"""Host memory for torch tensors: the tensor itself on the CPU, else a pinned staging buffer."""

from __future__ import annotations

import numpy as np
import torch

from sluice.errors import SluiceError

DTYPES = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.int16: "int16",
    torch.int8: "int8",
    torch.uint64: "uint64",
    torch.uint32: "uint32",
    torch.uint16: "uint16",
    torch.uint8: "uint8",
    torch.bool: "bool",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e4m3fnuz: "float8_e4m3fnuz",
    torch.float8_e5m2: "float8_e5m2",
    torch.float8_e5m2fnuz: "float8_e5m2fnuz",
    torch.float8_e8m0fnu: "float8_e8m0fnu",
}
#: torch dtypes numpy has no twin for: their bits travel as this integer type of the same size
_BITS = {torch.bfloat16: (torch.int16, np.uint16), **{d: (torch.uint8, np.uint8) for d in DTYPES
                                                       if str(d).startswith("torch.float8")}}


def wire_dtype(tensor: torch.Tensor) -> str:
    if tensor.dtype not in DTYPES:
        raise SluiceError(f"dtype {tensor.dtype} is not supported; use one of {sorted(DTYPES.values())}")
    return DTYPES[tensor.dtype]


def wire_array(host: torch.Tensor) -> np.ndarray:
    """The wire storage of `host`, a contiguous CPU tensor, without a copy (bfloat16 and float8 as their bits)."""
    bits = _BITS.get(host.dtype)
    if bits is not None:
        return host.view(bits[0]).numpy().view(bits[1])
    return host.numpy()


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
        return wire_array(self.host)

    def load(self, tensor: torch.Tensor) -> np.ndarray:
        if not self.direct:
            self.host.copy_(tensor.detach())
        return self.array()

    def store(self, tensor: torch.Tensor) -> None:
        if not self.direct:
            with torch.no_grad():
                tensor.copy_(self.host, non_blocking=False)


def tensor_of(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of `dtype` over `array`, which holds that dtype's wire storage (no copy)."""
    out = torch.from_numpy(np.ascontiguousarray(array))
    bits = _BITS.get(dtype)
    return out.view(dtype) if bits is not None else out
