"""ZVC frames of CPU torch tensors: every dtype the codec takes, integers narrowed first, bit-exact."""

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


def decode_tensor(frame: bytearray, shape: torch.Size, stored: torch.dtype, dtype: torch.dtype,
                  pin: bool) -> torch.Tensor:
    """The tensor of `shape` and `dtype` in `frame`, whose elements are `stored` (narrowed integers)."""
    if pin:  # into pinned memory, so the copy back to the GPU can be asynchronous
        out = torch.empty(shape, dtype=stored, pin_memory=True)
        array = out.view(CODECS[stored][1]).numpy().reshape(-1)
        zvc.decode_into(frame, array.view(np.uint16) if stored == torch.bfloat16 else array)
    else:  # decode's fresh calloc'd array skips the zero fill decode_into needs (a fifth of the decode time)
        flat = zvc.decode(frame, shape.numel())
        out = torch.from_numpy(flat.view(np.int16) if stored == torch.bfloat16 else flat)
        out = out.view(stored).view(shape)
    if stored == dtype:
        return out
    return torch.empty(shape, dtype=dtype, pin_memory=pin).copy_(out)  # widen narrowed integers
