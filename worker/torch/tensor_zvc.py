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


#: elements sampled to estimate what ZVC would save: the estimate's standard error is at most 0.8 points
SAMPLE = 4096


def estimated_saving(host: torch.Tensor, stored: torch.dtype) -> float:
    """The fraction of `host`'s bytes a ZVC frame of its elements as `stored` would save, from the density of
    evenly spaced samples (a pass over 1/SAMPLE of it, not over the whole as an encode's survey)."""
    flat = host.detach().reshape(-1)
    if not flat.numel():
        return 0.0
    sample = flat[::max(1, flat.numel() // SAMPLE)]
    density = int(torch.count_nonzero(sample.view(_BITS[sample.element_size()]))) / sample.numel()
    return 1 - min(stored.itemsize, 1 / 8 + stored.itemsize * density) / host.element_size()


def encode_tensor(host: torch.Tensor, threads: int = 1,
                  min_saving: float = 0.0) -> tuple[bytearray, torch.dtype] | None:
    """`host` as a ZVC frame of its narrowest lossless dtype, and that dtype (the decode needs it); None when
    the frame would save less than `min_saving` of the tensor's bytes (estimated from a sample, when > 0)."""
    stored = _narrowest(host)
    if min_saving > 0 and estimated_saving(host, stored) < min_saving:
        return None
    name, view = CODECS[stored]
    array = host.detach().to(stored).view(view).numpy()
    return zvc.encode(array.view(np.uint16) if name == "bfloat16" else array, dtype=name, threads=threads), stored


def decode_tensor(frame: bytearray, shape: torch.Size, stored: torch.dtype, dtype: torch.dtype,
                  threads: int = 1) -> torch.Tensor:
    """The tensor of `shape` and `dtype` in `frame`, whose elements are `stored` (narrowed integers)."""
    flat = zvc.decode(frame, shape.numel(), threads)  # a fresh calloc'd array: no zero fill (a fifth of the time)
    out = torch.from_numpy(flat.view(np.int16) if stored == torch.bfloat16 else flat).view(stored).view(shape)
    return out if stored == dtype else out.to(dtype)  # widen narrowed integers


#: the integer dtype of each element size: ZVC compares bits, so -0.0 and NaNs come back as they were
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool tensor as bits, in its logical order: bit i (of byte i // 8, least significant first) is
    element i; on the mask's device (numpy's packbits on a CPU: 6x faster than torch's shifts there)."""
    flat = mask.reshape(-1)
    if flat.device.type == "cpu":
        return torch.from_numpy(np.packbits(flat.numpy(), bitorder="little"))
    return shift_pack(flat)


def shift_pack(flat: torch.Tensor) -> torch.Tensor:
    """`pack_bits` of a flat bool tensor in torch's ops, which every device has (a GPU's path)."""
    if flat.numel() % 8:
        flat = torch.cat([flat, flat.new_zeros(8 - flat.numel() % 8)])
    shifts = torch.arange(8, dtype=torch.uint8, device=flat.device)
    return (flat.view(-1, 8).to(torch.uint8) << shifts).sum(1, dtype=torch.uint8)


def unpack_bits(bits: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The bool tensor of `shape` that `pack_bits` packed, as 0/1 bytes (uint8), on the device of `bits`."""
    count = shape.numel()
    if bits.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(bits.numpy(), count=count, bitorder="little")).view(shape)
    return shift_unpack(bits, shape)


def shift_unpack(bits: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """`unpack_bits` in torch's ops, which every device has (a GPU's path)."""
    count = shape.numel()
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    return ((bits.unsqueeze(1) >> shifts) & 1).view(-1)[:count].view(shape)


def pack_nonzeros(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ZVC on the tensor's own device (a GPU, before a copy to the host): a bitmask (`pack_bits`) of the
    elements that are not zero and those elements in order, as integers of the element's size. The count of
    non-zeros syncs the host with the device."""
    flat = tensor.detach().reshape(-1).view(_BITS[tensor.element_size()])
    mask = flat != 0
    return pack_bits(mask), flat[mask]


def unpack_nonzeros(bits: torch.Tensor, values: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """The tensor `pack_nonzeros` packed, on the device of `bits` (no sync with the host)."""
    mask = unpack_bits(bits, shape).view(-1).view(torch.bool)
    flat = torch.zeros(shape.numel(), dtype=values.dtype, device=bits.device).masked_scatter_(mask, values)
    return flat.view(dtype).view(shape)
