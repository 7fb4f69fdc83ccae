"""Horovod's gradient compression: cast floating-point tensors to 16 bits for the wire, and back on arrival."""

from __future__ import annotations

from typing import Any

import torch


class Compressor:
    """Horovod's interface: compress(tensor) -> (tensor for the wire, context); decompress(tensor, context)."""

    #: the dtype gradients travel in (None: their own); read by DistributedOptimizer's fusion buffers
    wire_dtype: torch.dtype | None = None

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if cls.wire_dtype is None or not tensor.is_floating_point() or tensor.dtype == cls.wire_dtype:
            return tensor, None
        return tensor.to(cls.wire_dtype), tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, context: Any) -> torch.Tensor:
        return tensor if context is None else tensor.to(context)


class NoneCompressor(Compressor):
    """Tensors travel as they are."""


class FP16Compressor(Compressor):
    """Floating-point tensors travel as float16 (half the bytes; values beyond 65504 become inf)."""

    wire_dtype = torch.float16


class BF16Compressor(Compressor):
    """Floating-point tensors travel as bfloat16 (half the bytes, float32's range, 8 bits of mantissa)."""

    wire_dtype = torch.bfloat16


class Compression:
    """The compressors, as `hvd.Compression.none`, `.fp16` and `.bf16`."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
