"""A walk over msgpack bytes that checks nesting, item count and lengths without building any object.

`scan` reads only the type bytes and length fields of the format (https://github.com/msgpack/msgpack/
blob/master/spec.md): fixint, fixmap, fixarray, fixstr, nil, bool, bin 8/16/32, float 32/64, uint and
int 8-64, str 8/16/32, array 16/32 and map 16/32. Extension types (fixext, ext 8/16/32, timestamps)
and the reserved byte 0xc1 are refused: the wire format allows neither. Its memory is one list of
counters per open container, at most `max_depth` long, so a document that claims four billion items
or nests a hundred thousand deep is refused after reading a few bytes. A document that passes can be
handed to msgpack: it is one complete value, at most `max_depth` deep, of at most `max_items` values.
"""

from __future__ import annotations

from struct import unpack_from
from typing import Any


class ScanError(ValueError):
    """The bytes are not one msgpack document within the limits; the message says why, in words."""


def _leaf_sizes() -> list[int]:
    """Total encoded size of each value that is a single first byte plus a fixed-size body, else 0."""
    sizes = [0] * 256
    for byte in (*range(0x00, 0x80), *range(0xE0, 0x100), 0xC0, 0xC2, 0xC3):
        sizes[byte] = 1  # positive and negative fixint, nil, false, true
    for byte, size in {0xCA: 5, 0xCB: 9, 0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9, 0xD0: 2, 0xD1: 3, 0xD2: 5,
                       0xD3: 9}.items():
        sizes[byte] = size  # float 32/64, uint 8-64, int 8-64
    for byte in range(0xA0, 0xC0):
        sizes[byte] = 1 + (byte & 0x1F)  # fixstr
    return sizes


_LEAF = _leaf_sizes()
#: str/bin whose length follows the type byte: type byte -> (struct format, width of the length)
_SIZED = {0xC4: (">B", 1), 0xC5: (">H", 2), 0xC6: (">I", 4), 0xD9: (">B", 1), 0xDA: (">H", 2), 0xDB: (">I", 4)}
#: array/map 16/32: type byte -> (struct format, width of the count, values per entry)
_COUNTED = {0xDC: (">H", 2, 1), 0xDD: (">I", 4, 1), 0xDE: (">H", 2, 2), 0xDF: (">I", 4, 2)}
_EXT = frozenset((0xC7, 0xC8, 0xC9, 0xD4, 0xD5, 0xD6, 0xD7, 0xD8))


def scan(data: Any, max_depth: int, max_items: int) -> None:
    """Raise ScanError unless `data` (bytes-like) is exactly one msgpack value within the limits.

    Depth counts containers: a scalar alone is depth 0, `[1]` is depth 1, `[[1]]` depth 2. Items
    count every value, containers and map keys included."""
    view = data if isinstance(data, bytes) else memoryview(data).cast("B")
    end = len(view)
    pos = 0
    items = 1
    left = 1  # values still to read in the innermost open container; 1: the document itself
    enclosing: list[int] = []  # `left` of each container around it, outermost first
    while True:
        if not left:
            if not enclosing:
                break
            left = enclosing.pop()
            continue
        left -= 1
        if pos >= end:
            raise ScanError(f"truncated: the {end} bytes end before the values they declare")
        byte = view[pos]
        size = _LEAF[byte]
        if size:
            pos += size
            continue
        if 0x80 <= byte <= 0x9F:  # fixmap, fixarray
            count = (byte & 0x0F) * (2 if byte < 0x90 else 1)
            pos += 1
        elif byte in _COUNTED:
            fmt, width, per_entry = _COUNTED[byte]
            if pos + 1 + width > end:
                raise ScanError(f"truncated: a container's length is cut off at byte {pos} of {end}")
            count = unpack_from(fmt, view, pos + 1)[0] * per_entry
            pos += 1 + width
        elif byte in _SIZED:
            fmt, width = _SIZED[byte]
            if pos + 1 + width > end:
                raise ScanError(f"truncated: a string's length is cut off at byte {pos} of {end}")
            pos += 1 + width + unpack_from(fmt, view, pos + 1)[0]
            continue
        elif byte in _EXT:
            raise ScanError(f"an extension type (0x{byte:02x}) at byte {pos}, which the wire format does not allow")
        else:
            raise ScanError(f"the reserved type byte 0x{byte:02x} at byte {pos}")
        # a container of `count` values opens here, inside len(enclosing) others
        if len(enclosing) >= max_depth:
            raise ScanError(f"nested deeper than {max_depth} containers")
        items += count
        if items > max_items:
            raise ScanError(f"more than {max_items} values")
        if count > end - pos:
            raise ScanError(f"a container claims {count} values but only {end - pos} bytes follow")
        enclosing.append(left)
        left = count
    if pos > end:
        raise ScanError(f"truncated: the last value runs {pos - end} bytes past the end")
    if pos != end:
        raise ScanError(f"{end - pos} bytes follow the value")
