"""Zero-value compression (ZVC): a bitmask of non-zero elements plus the packed non-zero values.

Frame layout (one contiguous buffer, all integers little-endian):

    header  24 bytes: magic b"SZVC", version u8, dtype code u8, mode u8 (0 raw, 1 zvc), a zero byte,
            n u64 (elements), nnz u64 (elements whose bits are not all zero)
    zvc     ceil(n/8) mask bytes (bit i of byte j is element 8j + i; unused trailing bits zero), then
            itemsize x nnz bytes: the non-zero elements in order
    raw     itemsize x n bytes: the array itself

"Zero" means all bits zero, so -0.0 and NaN payloads are values and the round trip is bit-exact. An
encoder writes raw whenever zvc would not be smaller (density near 1, tiny arrays). A zvc frame of
float32 at density d is 1/8 + 4d bytes per element: 32/(1+32d) times smaller than raw, asymptotically.

`encode` returns one buffer because the wire carries one payload frame; the mask and the values are
written straight into it, and `decode` reads the values from the received frame without a copy.
bfloat16 and the float8 formats travel as their bit patterns (uint16, uint8): name them in `dtype=`.
Decoding checks everything (magic, version, codes, the caller's element bound, exact length, the
mask's popcount and trailing bits, non-zero packed values) before it allocates or writes anything big.
"""

from __future__ import annotations

import itertools
import os
import struct
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from sluice.transport.dtypes import STORAGE
from sluice.transport.wire import DTYPES, WireError

MAGIC = b"SZVC"
VERSION = 1
RAW, ZVC = 0, 1
_HEADER = struct.Struct("<4sBBBBQQ")
#: elements gathered or scattered per step: the positions array of a whole 16 MiB tensor (8 bytes per
#: non-zero) is mapped fresh, page by page, on every call; a chunk's stays in cache (16 MiB float32:
#: encode 3.3 instead of 2.9 GB/s at d 0.35, 2.4 instead of 0.7 at d 0.9)
CHUNK = 1 << 16
HEADER_BYTES = _HEADER.size
#: wire code of each dtype: fixed forever (a frame names its dtype by code); 0 is never valid. bool is
#: left out: its bytes would need a check that they are 0 or 1, and nothing sends bool activations
CODES: dict[str, int] = {name: code for code, name in enumerate(
    ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint64", "uint32",
     "uint16", "uint8", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
     "float8_e8m0fnu"), start=1)}
_NAMES = {code: name for name, code in CODES.items()}
#: the unsigned integer of each item size: elements are compared with zero and moved as these bits
_BITS: dict[int, np.dtype[Any]] = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32),
                                   8: np.dtype(np.uint64)}


@dataclass(frozen=True, slots=True)
class Header:
    """A frame's validated header: its dtype name (a wire name), raw or not, elements and non-zeros."""

    dtype: str
    raw: bool
    n: int
    nnz: int

    @property
    def storage(self) -> np.dtype[Any]:
        """The numpy dtype the decoded elements have (uint16 for bfloat16, uint8 for float8)."""
        return np.dtype(STORAGE[self.dtype])


def compressed_size(n: int, nnz: int, itemsize: int) -> int:
    """Bytes of a zvc frame of `n` elements of which `nnz` are non-zero: header + ceil(n/8) + itemsize*nnz."""
    return HEADER_BYTES + (n + 7) // 8 + itemsize * nnz


def encoded_size(n: int, nnz: int, itemsize: int) -> int:
    """Bytes `encode` produces: the zvc frame, or the raw one when zvc would not be smaller."""
    return min(compressed_size(n, nnz, itemsize), HEADER_BYTES + itemsize * n)


def theoretical_ratio(density: float, itemsize: int = 4) -> float:
    """Raw bytes over zvc bytes for large arrays at `density`: b / (1 + b d) with b bits per element."""
    bits = 8 * itemsize
    return bits / (1 + bits * density)


def _dtype_name(array: np.ndarray[Any, Any], dtype: str | None) -> str:
    if dtype is None:
        name = str(array.dtype.name)
        if name not in CODES:
            raise TypeError(f"zvc cannot encode {name} arrays; it takes {', '.join(CODES)} "
                            "(bfloat16 and float8 as their bits, with dtype= naming them)")
        return name
    if dtype not in CODES:
        raise TypeError(f"zvc has no dtype {dtype!r}; use one of {', '.join(CODES)}")
    if array.dtype != np.dtype(STORAGE[dtype]):
        raise TypeError(f"a {dtype} array must be stored as {np.dtype(STORAGE[dtype]).name}, "
                        f"got {array.dtype.name}: pass its bits with .view()")
    return dtype


def encode(array: np.ndarray[Any, Any], dtype: str | None = None, threads: int = 1) -> bytearray:
    """`array` (any shape; flattened in C order) as one zvc or raw frame. `dtype` names the wire dtype
    when the array's own does not (bfloat16 as uint16 bits, float8 as uint8); by default, its own.
    `threads` > 1 splits the work into that many ranges run at once (numpy releases the GIL): for a
    caller whose cores are idle meanwhile, such as a saved-tensor hook between torch's ops."""
    if array.dtype.byteorder == ">":  # frames are little-endian, like the rest of the wire
        array = array.astype(array.dtype.newbyteorder("<"))
    name = _dtype_name(array, dtype)
    flat = np.ascontiguousarray(array).reshape(-1)  # a view unless the array was not contiguous
    bits = flat.view(_BITS[flat.itemsize])
    n, itemsize = bits.size, bits.itemsize
    ranges = _ranges(n, threads)

    def survey(span: tuple[int, int]) -> tuple[np.ndarray[Any, np.dtype[np.bool_]], int]:
        mask = bits[span[0]:span[1]] != 0
        return mask, int(np.count_nonzero(mask))

    surveys = _each(survey, ranges)
    nnz = sum(count for _, count in surveys)
    raw = compressed_size(n, nnz, itemsize) >= HEADER_BYTES + itemsize * n
    out = bytearray(encoded_size(n, nnz, itemsize))
    _HEADER.pack_into(out, 0, MAGIC, VERSION, CODES[name], RAW if raw else ZVC, 0, n, nnz)
    body = np.frombuffer(out, np.uint8, offset=HEADER_BYTES)
    if raw:
        body[:] = bits.view(np.uint8)
        return out
    mask_bytes = (n + 7) // 8
    values = np.frombuffer(out, bits.dtype, count=nnz, offset=HEADER_BYTES + mask_bytes)
    offsets = list(itertools.accumulate((count for _, count in surveys), initial=0))

    def write(part: int) -> None:
        (start, stop), mask, done = ranges[part], surveys[part][0], offsets[part]
        body[start // 8:(stop + 7) // 8] = np.packbits(mask, bitorder="little")
        for first in range(start, stop, CHUNK):
            # positions then a gather: bits[mask] branches per element (4x slower at d 0.35), np.compress is
            # slower too; take's out= into the frame is slower than a small fresh array and one copy
            gathered = bits[first:min(first + CHUNK, stop)].take(
                np.flatnonzero(mask[first - start:first - start + CHUNK]), mode="clip")
            values[done:done + gathered.size] = gathered
            done += gathered.size

    _each(write, range(len(ranges)))
    return out


def _ranges(n: int, threads: int) -> list[tuple[int, int]]:
    """`n` elements cut into at most `threads` ranges of whole CHUNKs (so whole mask bytes); one for a small n."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    chunks = max(1, -(-n // CHUNK))
    per = -(-chunks // min(threads, chunks)) * CHUNK
    return [(start, min(start + per, n)) for start in range(0, n, per)] or [(0, 0)]


_T = TypeVar("_T")
_R = TypeVar("_R")
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _each(work: Callable[[_T], _R], items: Sequence[_T]) -> list[_R]:
    """`work` on every item, the first on this thread and the others at once on the shared pool."""
    global _POOL
    if len(items) == 1:
        return [work(items[0])]
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max(1, (os.cpu_count() or 2) - 1), thread_name_prefix="sluice-zvc")
        pool = _POOL
    futures = [pool.submit(work, item) for item in items[1:]]
    try:
        first = work(items[0])
    finally:
        rest = [future.result() for future in futures]  # every range done (or failed) before the caller goes on
    return [first, *rest]


def _bytes_of(data: Any) -> np.ndarray[Any, np.dtype[np.uint8]]:
    try:
        return np.frombuffer(data, np.uint8)
    except (TypeError, ValueError, BufferError) as exc:
        raise TypeError(f"zvc decodes a contiguous bytes-like frame, got {type(data).__name__}: {exc}") from None


def read_header(data: Any, limit_elements: int) -> Header:
    """The header of frame `data` after checking it and the frame's exact length; `limit_elements` bounds
    n (the caller's limit: a hostile frame must not make it allocate without bound)."""
    if limit_elements < 0:
        raise ValueError(f"limit_elements must be >= 0, got {limit_elements}")
    size = _bytes_of(data).size
    if size < HEADER_BYTES:
        raise WireError(f"zvc frame of {size} bytes is shorter than its {HEADER_BYTES}-byte header")
    magic, version, code, mode, pad, n, nnz = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise WireError(f"not a zvc frame: magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise WireError(f"zvc version {version} is not {VERSION}: sender and receiver run different Sluice versions")
    if code not in _NAMES:
        raise WireError(f"zvc frame has unknown dtype code {code}")
    if mode not in (RAW, ZVC) or pad != 0:
        raise WireError(f"zvc frame has mode {mode} and reserved byte {pad}; expected mode 0 or 1 and 0")
    if n > limit_elements:
        raise WireError(f"zvc frame declares {n} elements, over this receiver's limit of {limit_elements}")
    if nnz > n:
        raise WireError(f"zvc frame declares {nnz} non-zeros among only {n} elements")
    name = _NAMES[code]
    itemsize = DTYPES[name]
    expected = HEADER_BYTES + itemsize * n if mode == RAW else compressed_size(n, nnz, itemsize)
    if size != expected:
        raise WireError(f"zvc {'raw' if mode == RAW else 'zvc'} frame of {n} {name} ({nnz} non-zero) must be "
                        f"{expected} bytes, got {size}")
    return Header(name, mode == RAW, n, nnz)


def decode_into(data: Any, out: np.ndarray[Any, Any], threads: int = 1) -> Header:
    """Decode frame `data` into `out` (C-contiguous, writeable, of the frame's storage dtype, exactly n
    elements: e.g. a reused or pinned buffer); its header. Nothing is written unless the frame is valid.
    `threads` as for `encode`."""
    if not (out.flags.c_contiguous and out.flags.writeable):
        raise ValueError("decode_into needs a C-contiguous, writeable output array")
    header = read_header(data, out.size)
    if out.dtype != header.storage or out.size != header.n:
        raise WireError(f"zvc frame holds {header.n} {header.dtype}, the output is {out.size} {out.dtype.name}")
    _fill(_bytes_of(data), header, out.reshape(-1), zeroed=False, threads=threads)
    return header


def decode(data: Any, limit_elements: int, threads: int = 1) -> np.ndarray[Any, Any]:
    """The flat array in frame `data` (its storage dtype: uint16 bits for bfloat16; `read_header` names
    the wire dtype); raises WireError for any malformed frame or one of more than `limit_elements`.
    `threads` as for `encode`."""
    header = read_header(data, limit_elements)
    out = np.zeros(header.n, header.storage)  # calloc: fresh pages come zeroed, no fill pass
    _fill(_bytes_of(data), header, out, zeroed=True, threads=threads)
    return out


def _fill(frame: np.ndarray[Any, np.dtype[np.uint8]], header: Header, out: np.ndarray[Any, Any], zeroed: bool,
          threads: int) -> None:
    """Check the body of a frame whose header and length `read_header` checked, then write it to `out`."""
    bits = _BITS[out.itemsize]
    target = out.view(bits)
    if header.raw:
        values = frame[HEADER_BYTES:].view(bits)
        found = int(np.count_nonzero(values))
        if found != header.nnz:
            raise WireError(f"raw zvc frame declares {header.nnz} non-zeros, its values have {found}")
        target[:] = values
        return
    mask_bytes = (header.n + 7) // 8
    mask = frame[HEADER_BYTES:HEADER_BYTES + mask_bytes]
    if header.n % 8 and mask[-1] >> (header.n % 8):
        raise WireError(f"zvc mask has bits set past its {header.n} elements")
    packed = np.frombuffer(frame, bits, count=header.nnz, offset=HEADER_BYTES + mask_bytes)
    ranges = _ranges(header.n, threads)
    share = -(-header.nnz // len(ranges))

    def survey(part: int) -> tuple[np.ndarray[Any, np.dtype[np.bool_]], int, int]:
        start, stop = ranges[part]
        # positions then a scatter (below): faster than out[mask] = values or np.place, which branch on
        # every element; unpacked to bools first: flatnonzero of uint8 is 6x slower
        marks = np.unpackbits(mask[start // 8:(stop + 7) // 8], count=stop - start, bitorder="little").view(np.bool_)
        values = packed[part * share:(part + 1) * share]
        return marks, int(np.count_nonzero(marks)), values.size - int(np.count_nonzero(values))

    surveys = _each(survey, range(len(ranges)))
    if any(zeros for _, _, zeros in surveys):
        raise WireError("zvc frame packs a zero value, which its mask should have marked as zero")
    found = sum(count for _, count, _ in surveys)
    if found != header.nnz:
        raise WireError(f"zvc mask marks {found} non-zeros, the header declares {header.nnz}")
    offsets = list(itertools.accumulate((count for _, count, _ in surveys), initial=0))

    def scatter(part: int) -> None:
        (start, stop), marks, done = ranges[part], surveys[part][0], offsets[part]
        if not zeroed:
            target[start:stop].fill(0)
        for first in range(start, stop, CHUNK):
            where = np.flatnonzero(marks[first - start:first - start + CHUNK])
            target[first:first + CHUNK][where] = packed[done:done + where.size]
            done += where.size

    _each(scatter, range(len(ranges)))
