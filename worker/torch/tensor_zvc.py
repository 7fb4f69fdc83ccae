"""ZVC of torch tensors, bit-exact: the transport's frames for CPU tensors, a bitmask and values packed on a GPU."""

from __future__ import annotations

import numpy as np
import torch

from sluice.transport import zvc

#: ZVC's name for each dtype it takes, and the dtype whose bits numpy can hold (bfloat16 as int16)
CODECS: dict[torch.dtype, tuple[str, torch.dtype]] = {
    torch.float32: ("float32", torch.float32), torch.float16: ("float16", torch.float16),
    torch.float64: ("float64", torch.float64), torch.bfloat16: ("bfloat16", torch.int16),
    torch.int64: ("int64", torch.int64), torch.int32: ("int32", torch.int32),
    torch.int16: ("int16", torch.int16), torch.int8: ("int8", torch.int8), torch.uint8: ("uint8", torch.uint8),
}


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


def encode_tensor(host: torch.Tensor) -> tuple[bytearray, torch.dtype]:
    """`host` as a ZVC frame of its narrowest lossless dtype, and that dtype (the decode needs it)."""
    stored = _narrowest(host)
    name, view = CODECS[stored]
    array = host.detach().to(stored).view(view).numpy()
    return zvc.encode(array.view(np.uint16) if name == "bfloat16" else array, dtype=name), stored


def decode_tensor(frame: bytearray, shape: torch.Size, stored: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """The tensor of `shape` and `dtype` in `frame`, whose elements are `stored` (narrowed integers)."""
    flat = zvc.decode(frame, shape.numel())  # a fresh calloc'd array: no zero fill (a fifth of the decode time)
    out = torch.from_numpy(flat.view(np.int16) if stored == torch.bfloat16 else flat).view(stored).view(shape)
    return out if stored == dtype else out.to(dtype)  # widen narrowed integers


#: the integer dtype of each element size: ZVC compares bits, so -0.0 and NaNs come back as they were
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def pack_nonzeros(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ZVC on the tensor's own device (a GPU, before a copy to the host): a bitmask, bit i (of byte i // 8,
    least significant first) set where element i is not zero, and the non-zero elements in order, as
    integers of the element's size. The count of non-zeros syncs the host with the device."""
    flat = tensor.detach().reshape(-1).view(_BITS[tensor.element_size()])
    mask = flat != 0
    values = flat[mask]
    if flat.numel() % 8:
        mask = torch.cat([mask, mask.new_zeros(8 - flat.numel() % 8)])
    shifts = torch.arange(8, dtype=torch.uint8, device=flat.device)
    return (mask.view(-1, 8).to(torch.uint8) << shifts).sum(1, dtype=torch.uint8), values


def unpack_nonzeros(bits: torch.Tensor, values: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """The tensor `pack_nonzeros` packed, on the device of `bits` (no sync with the host)."""
    count = shape.numel()
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    mask = ((bits.unsqueeze(1) >> shifts) & 1).view(-1)[:count].bool()
    flat = torch.zeros(count, dtype=values.dtype, device=bits.device).masked_scatter_(mask, values)
    return flat.view(dtype).view(shape)
