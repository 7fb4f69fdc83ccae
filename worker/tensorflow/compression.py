"""Horovod's gradient compression for TF tensors: floating-point tensors travel as 16 bits and are cast back."""

from __future__ import annotations

from typing import Any

import tensorflow as tf


class Compressor:
    """Horovod's interface: compress(tensor) -> (tensor for the wire, context); decompress(tensor, context)."""

    #: the dtype floating-point tensors travel in (None: their own)
    wire_dtype: Any = None

    @classmethod
    def compress(cls, tensor: Any) -> tuple[Any, Any]:
        if cls.wire_dtype is None or not tensor.dtype.is_floating or tensor.dtype == cls.wire_dtype:
            return tensor, None
        return tf.cast(tensor, cls.wire_dtype), tensor.dtype

    @staticmethod
    def decompress(tensor: Any, context: Any) -> Any:
        return tensor if context is None else tf.cast(tensor, context)


class NoneCompressor(Compressor):
    """Tensors travel as they are."""


class FP16Compressor(Compressor):
    """Floating-point tensors travel as float16 (half the bytes; values beyond 65504 become inf)."""

    wire_dtype = tf.float16


class BF16Compressor(Compressor):
    """Floating-point tensors travel as bfloat16 (half the bytes, float32's range, 8 bits of mantissa)."""

    wire_dtype = tf.bfloat16


class Compression:
    """The compressors, as `hvd.Compression.none`, `.fp16` and `.bf16`."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
