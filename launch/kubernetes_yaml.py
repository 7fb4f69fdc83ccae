"""Block-style YAML for the Kubernetes manifests, written without a YAML library (readable, and no dependency)."""

from __future__ import annotations

import json
import re
from typing import Any

# strings written without quotes: nothing YAML could read as a number, boolean, null, date or syntax
_PLAIN = re.compile(r"(?:[A-Za-z_/]|--?[A-Za-z])[A-Za-z0-9_./:=@+-]*(?<!:)")
_RESERVED = frozenset({"y", "n", "yes", "no", "true", "false", "on", "off", "null"})


def _scalar(value: Any) -> str:
    if isinstance(value, dict | list):  # only empty ones are written inline
        return "{}" if isinstance(value, dict) else "[]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    text = str(value)
    if _PLAIN.fullmatch(text) and text.lower() not in _RESERVED:
        return text
    return json.dumps(text)  # a JSON string is a YAML double-quoted scalar


def to_yaml(value: Any, indent: int = 0) -> list[str]:
    """Block-style YAML lines for nested dicts, lists and scalars (enough for a manifest)."""
    pad = "  " * indent
    lines: list[str] = []
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(item, dict | list) and item:
                lines.append(f"{pad}{_scalar(key)}:")
                lines += to_yaml(item, indent + 1 if isinstance(item, dict) else indent)
            else:
                lines.append(f"{pad}{_scalar(key)}: {_scalar(item)}")
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, dict) and item:
                inner = to_yaml(item, indent + 1)
                lines += [f"{pad}- {inner[0].lstrip()}", *inner[1:]]
            else:
                lines.append(f"{pad}- {_scalar(item)}")
    else:
        lines.append(pad + _scalar(value))
    return lines


def printable(text: str) -> str:
    """`text` on one comment line: control characters escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def documents(header: list[str], objects: list[dict[str, Any]]) -> str:
    """A manifest: comment lines, then the objects as YAML documents."""
    body: list[str] = []
    for index, item in enumerate(objects):
        body += (["---"] if index else []) + to_yaml(item)
    return "\n".join([*(f"# {printable(line)}" for line in header), *body]) + "\n"
