"""Priority planner: derives the parameter -> priority map (0 = most urgent) from the compute graph.

Pure: plain data in, plain data out. After an optimizer step every parameter travels back to the
workers, and the next forward pass can start a layer as soon as that layer's parameters arrive; in
backward the last layers' gradients are ready first and must not block the first layers'. So the
order that matters is the order in which the forward pass first *needs* each parameter.

The derivation: the forward graph is a list of ops in a valid execution order, each consuming earlier
ops' outputs and some parameters, and taking `cost` time. Assuming every parameter is already there,
an as-soon-as-possible schedule gives start[i] = max(finish[j] for j in inputs, default 0) and
finish[i] = start[i] + cost[i]. A parameter's first-use time is the smallest start among the ops that
consume it: the latest moment it can arrive without stalling compute. An op fed only by graph inputs
and parameters starts at 0 wherever it sits in the list (a side branch waits only on communication),
so ranking by first-use time rather than by list position sends its parameters with the first layer's.
Ranks are first-use times in order, ties broken by declaration order; parameters the forward pass
never uses follow in declaration order; operator overrides (shell patterns) win over both.
"""

from __future__ import annotations

import fnmatch
import json
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

SOURCES = ("forward", "override", "unused", "declaration")


@dataclass(frozen=True)
class Op:
    name: str
    inputs: tuple[int, ...]  # indices of earlier ops whose outputs this op consumes
    params: tuple[str, ...]  # names of the parameters this op consumes
    cost: float = 1.0  # compute time, any unit


@dataclass(frozen=True)
class Assigned:
    name: str
    priority: int
    source: str  # one of SOURCES


def first_use_times(ops: Sequence[Op]) -> dict[str, float]:
    """ASAP start of the first op that consumes each parameter, with parameters assumed present."""
    finish: list[float] = []
    first: dict[str, float] = {}
    for index, op in enumerate(ops):
        if not (op.cost >= 0 and math.isfinite(op.cost)):
            raise ValueError(f"op {index} ({op.name!r}): cost must be a finite number >= 0, got {op.cost!r}")
        for j in op.inputs:
            if not 0 <= j < index:
                raise ValueError(
                    f"op {index} ({op.name!r}): input {j} is not an earlier op (inputs must be in 0..{index - 1})"
                )
        start = max((finish[j] for j in op.inputs), default=0.0)
        finish.append(start + op.cost)
        for param in op.params:
            # ops come in execution order but a later op can still start earlier (side branches)
            if start < first.get(param, math.inf):
                first[param] = start
    return first


def parse_overrides(entries: Sequence[str]) -> list[tuple[str, int]]:
    """Parse "PATTERN=PRIORITY" entries (split at the last '='): shell-style pattern, integer >= 0."""
    parsed: list[tuple[str, int]] = []
    for entry in entries:
        pattern, sep, value = entry.rpartition("=")
        # isdecimal on ASCII only: int() would also take "+3", " 3", "3_0" and non-ASCII digits
        if not sep or not pattern or not (value.isascii() and value.isdecimal()):
            raise ValueError(f"bad priority override {entry!r}: expected PATTERN=PRIORITY with an integer >= 0")
        parsed.append((pattern, int(value)))
    return parsed


def priority_map(
    names: Sequence[str],
    first_use: Mapping[str, float] | None,
    overrides: Sequence[tuple[str, int]] = (),
) -> list[Assigned]:
    """Priorities for `names` (declaration order), in that order: see the module docstring."""
    duplicates = sorted(name for name, count in Counter(names).items() if count > 1)
    if duplicates:
        raise ValueError(f"parameter names must be unique; repeated: {', '.join(duplicates)}")
    for pattern, value in overrides:
        if value < 0:
            raise ValueError(f"priority override {pattern!r}: priority must be >= 0, got {value}")

    ranks: dict[str, tuple[int, str]] = {}
    if first_use is None:
        ranks = {name: (index, "declaration") for index, name in enumerate(names)}
    else:
        used = sorted((i for i, name in enumerate(names) if name in first_use), key=lambda i: (first_use[names[i]], i))
        unused = [i for i, name in enumerate(names) if name not in first_use]
        ranks = {names[i]: (rank, "forward") for rank, i in enumerate(used)}
        ranks.update({names[i]: (len(used) + rank, "unused") for rank, i in enumerate(unused)})

    assigned: list[Assigned] = []
    for name in names:
        priority, source = ranks[name]
        override = override_for(name, overrides)
        if override is not None:
            priority, source = override, "override"
        assigned.append(Assigned(name, priority, source))
    return assigned


def override_for(name: str, overrides: Sequence[tuple[str, int]]) -> int | None:
    """The priority the first matching pattern gives `name`, or None when no pattern matches."""
    return next((value for pattern, value in overrides if fnmatch.fnmatchcase(name, pattern)), None)


def _ordered(assigned: Sequence[Assigned]) -> list[Assigned]:
    return sorted(assigned, key=lambda a: (a.priority, a.name))


def describe(assigned: Sequence[Assigned], sizes: Mapping[str, int] | None = None) -> list[str]:
    """Table lines (header first) sorted by (priority, name), for logging the map at start."""
    header = ["priority", "name", *(["bytes"] if sizes is not None else []), "source"]
    rows = [
        [str(a.priority), a.name, *([str(sizes.get(a.name, "?"))] if sizes is not None else []), a.source]
        for a in _ordered(assigned)
    ]
    widths = [max(len(row[col]) for row in [header, *rows]) for col in range(len(header))]
    numeric = {0, 2} if sizes is not None else {0}  # numbers right-aligned so digits line up
    return [
        "  ".join(
            cell.rjust(width) if col in numeric else cell.ljust(width)
            for col, (cell, width) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in [header, *rows]
    ]


def to_json(assigned: Sequence[Assigned]) -> str:
    """`{"priorities": [{"name", "priority", "source"}, ...]}` sorted by priority, then name."""
    entries = [{"name": a.name, "priority": a.priority, "source": a.source} for a in _ordered(assigned)]
    return json.dumps({"priorities": entries}, indent=1)
