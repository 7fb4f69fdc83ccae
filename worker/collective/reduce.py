"""Dtype-aware, vectorised in-place reductions of collective chunks (sum, average, min, max, product)."""

from __future__ import annotations

from typing import Any

import numpy as np

from sluice.transport.dtypes import STORAGE, SUMMABLE

#: dtypes a collective may reduce; bool and float8 travel (allgather, broadcast) but are not reduced here
REDUCIBLE = tuple(sorted(SUMMABLE))
OPS = ("sum", "average", "min", "max", "product")
#: the elementwise combination each op applies as chunks meet (an average sums, and divides once at the end)
_UFUNC: dict[str, np.ufunc] = {"sum": np.add, "average": np.add, "min": np.minimum, "max": np.maximum,
                               "product": np.multiply}

#: the quiet NaN torch writes for any NaN it rounds to bfloat16
_BF16_NAN = 0x7FC0


def storage(dtype: str) -> np.dtype[Any]:
    """The numpy dtype a wire dtype is kept in (bfloat16: its raw 16-bit pattern as uint16)."""
    return np.dtype(STORAGE[dtype])


#: bfloat16 is combined in blocks of this many elements: the float32 scratch arrays (128 KiB each) stay
#: in L2 across the dozen passes the rounding takes (measured 2.4 -> 0.48 ms per MiB against whole chunks)
_BF16_BLOCK = 1 << 15


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 patterns (uint16) as float32 values: exact, a bfloat16 is a float32's upper half."""
    wide: np.ndarray = np.left_shift(bits, 16, dtype=np.uint32)
    return wide.view(np.float32)


def f32_to_bf16(values: np.ndarray, out: np.ndarray) -> None:
    """Round float32 `values` to bfloat16 patterns in `out` (uint16), nearest even, as torch does; NaN
    stays NaN (0x7FC0). `values` is clobbered: it is the scratch the rounding works in."""
    _round(values, out, np.empty(values.size, np.uint32), np.empty(values.size, bool))


def _round(values: np.ndarray, out: np.ndarray, lsb: np.ndarray, nan: np.ndarray) -> None:
    np.isnan(values, out=nan)
    bits = values.view(np.uint32)
    np.right_shift(bits, 16, out=lsb)
    lsb &= 1
    lsb += 0x7FFF
    bits += lsb  # a carry out of the mantissa rounds the exponent up, which is right (up to infinity)
    bits >>= 16
    np.copyto(out, bits, casting="unsafe")
    if nan.any():
        out[nan] = _BF16_NAN


def _bf16_combine(dst: np.ndarray, src: np.ndarray | None, divisor: int, ufunc: np.ufunc = np.add) -> None:
    """dst = ufunc(dst, src) (or dst /= divisor without src) on bfloat16 patterns, in float32, rounded once
    (min and max pick one of the values, which rounds to itself)."""
    size = min(dst.size, _BF16_BLOCK)
    acc, other, lsb = (np.empty(size, np.uint32) for _ in range(3))
    nan = np.empty(size, bool)
    for start in range(0, dst.size, _BF16_BLOCK):
        block = dst[start : start + _BF16_BLOCK]
        n = block.size
        values = np.left_shift(block, 16, out=acc[:n], dtype=np.uint32).view(np.float32)
        if src is not None:
            ufunc(values, np.left_shift(src[start : start + n], 16, out=other[:n], dtype=np.uint32).view(np.float32),
                  out=values)
        else:
            values /= np.float32(divisor)
        _round(values, block, lsb[:n], nan[:n])


def accumulate(dst: np.ndarray, src: np.ndarray, dtype: str, op: str = "sum") -> None:
    """dst = op(dst, src) in place, both of `dtype`'s storage type and the same length (src may be
    read-only shared memory); "average" sums (see divide). Integer sums and products wrap around as
    numpy's (and torch's) do; min and max propagate NaN, as torch's do."""
    ufunc = _UFUNC[op]
    with np.errstate(all="ignore"):  # overflow to inf is the sum's value, as in torch; no warning per chunk
        if dtype == "bfloat16":
            _bf16_combine(dst, src, 1, ufunc)
        else:  # float16 too: numpy combines halves in float32 and rounds once, the correctly rounded result
            ufunc(dst, src, out=dst)


def divide(dst: np.ndarray, count: int, dtype: str) -> None:
    """dst /= count in place (the average after a sum). Integers take the floor (dst //= count), as a
    sum of ints has no exact mean; floats divide in their own precision (bfloat16: in float32, rounded)."""
    if count == 1:
        return
    with np.errstate(all="ignore"):
        if dtype == "bfloat16":
            _bf16_combine(dst, None, count)
        elif dtype.startswith(("int", "uint")):
            np.floor_divide(dst, count, out=dst)
        else:
            np.divide(dst, np.array(count, dst.dtype), out=dst)


def scaled(array: np.ndarray, factor: float, dtype: str, out: np.ndarray | None = None) -> np.ndarray:
    """array * factor in the storage of `dtype` (bfloat16 and float16 through float32, rounded once; integers
    in float64, truncated toward zero, as Horovod scales them), written into `out` (may be `array`
    itself; a new array when None). Horovod's prescale_factor and postscale_factor."""
    target = np.empty(array.shape, array.dtype) if out is None else out
    with np.errstate(all="ignore"):
        if dtype == "bfloat16":
            f32_to_bf16(bf16_to_f32(array.reshape(-1)) * np.float32(factor), target.reshape(-1))
        elif np.issubdtype(array.dtype, np.integer):
            np.copyto(target, np.trunc(array * factor), casting="unsafe")
        elif array.dtype == np.float16:  # in float32, rounded once (as Horovod scales half floats on a CPU)
            np.copyto(target, array.astype(np.float32) * np.float32(factor), casting="unsafe")
        else:
            np.multiply(array, array.dtype.type(factor), out=target)
    return target


def identity(dtype: str, op: str) -> int | float:
    """The value that leaves any other unchanged under `op`, in `dtype`'s storage (a joined rank's part):
    0 for sum and average, 1 for product, the largest (smallest) value for min (max)."""
    if op == "product":
        return 0x3F80 if dtype == "bfloat16" else 1  # bfloat16 1.0 as its bit pattern
    if op not in ("min", "max"):
        return 0
    if dtype == "bfloat16":
        return 0x7F80 if op == "min" else 0xFF80  # +inf, -inf
    kind = storage(dtype)
    if kind.kind == "f":
        return float("inf") if op == "min" else float("-inf")
    limits = np.iinfo(kind)
    return int(limits.max if op == "min" else limits.min)


def check_reducible(dtype: str, op: str) -> None:
    """ValueError unless `dtype` can be reduced and `op` is a known reduction."""
    if dtype not in REDUCIBLE:
        raise ValueError(f"allreduce of {dtype!r} is not supported; dtypes: {', '.join(REDUCIBLE)}")
    if op not in OPS:
        raise ValueError(f"allreduce op must be one of {', '.join(OPS)}, got {op!r}")
