"""`brief`: a received value in a few words for an error message, whatever its size or depth."""

from __future__ import annotations


def brief(value: object, width: int = 40) -> str:
    """`value` in a few words for an error message, whatever its size or depth: the repr of a small
    scalar, the start of a long string, else the type and length ("a list of 3 items")."""
    if value is None or isinstance(value, float):
        return repr(value)
    if isinstance(value, int):  # bool included
        bits = value.bit_length()
        return repr(value) if bits <= 64 else f"an int of {bits} bits"
    if isinstance(value, str | bytes):
        if len(value) <= width:
            return repr(value)
        return f"{value[: width // 2]!r}... ({len(value)} {'characters' if isinstance(value, str) else 'bytes'})"
    if type(value) is list or type(value) is tuple:
        return f"a {type(value).__name__} of {len(value)} items"
    if type(value) is dict:
        return f"a map of {len(value)} entries"
    return f"a {type(value).__name__}"
