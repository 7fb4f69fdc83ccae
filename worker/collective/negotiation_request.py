"""What a rank asks the coordinator tree for: a Request, its checks, and how requests are compared and named."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from sluice.transport.wire import DTYPES, MAX_DIMS, brief

KINDS = ("allreduce", "allgather", "broadcast", "alltoall", "barrier", "join", "refused")
OPS = ("sum", "average", "min", "max", "product")
#: kinds that move no data: no dtype, no shapes. A "refused" request stands for a call this rank could not
#: run (its arguments were invalid here): the same call fails on every rank, and the ranks stay in step
EMPTY_KINDS = ("barrier", "join", "refused")
#: the longest reason a refused request carries (in its `op`)
MAX_REASON = 400
#: kinds whose first dimension may differ per rank (and is left out of the mismatch check)
RAGGED_KINDS = ("allgather", "alltoall")
MAX_NAME = 1024
MAX_TENSORS = 4096


@dataclass(frozen=True)
class Request:
    name: str
    kind: str  # "allreduce" | "allgather" | "broadcast" | "alltoall" | "barrier" | "join" | "refused"
    dtype: str = ""  # "" for barrier, join and refused
    shapes: tuple[tuple[int, ...], ...] = ()  # one per tensor; a grouped allreduce has several
    op: str = "sum"  # one of OPS (allreduce); for a refused call, why this rank refused it
    root: int = -1  # broadcast's root rank; the last rank to join, in a join's decision
    priority: int = 0  # 0 most urgent; not part of the mismatch check


def check_request(request: Request, size: int) -> None:
    """Raise ValueError, saying what is wrong, for a request no rank of a `size`-rank job could run."""
    found = problem(request, size)
    if found:
        raise ValueError(f"collective {request.name!r:.80}: {found}")


def problem(r: Request, size: int) -> str:
    """What is wrong with `r` in a `size`-rank job, or ''."""
    if not isinstance(r.name, str) or not 0 < len(r.name) <= MAX_NAME:
        return f"a name is a string of 1 to {MAX_NAME} characters"
    if type(r.kind) is not str or type(r.dtype) is not str or type(r.op) is not str:
        return "kind, dtype and op are strings"
    if r.kind not in KINDS:
        return f"kind {r.kind!r:.40} is not one of {', '.join(KINDS)}"
    if r.kind == "join" and r.name != "join":
        return "a join request is named 'join'"
    if (r.dtype == "") != (r.kind in EMPTY_KINDS) or (r.dtype and r.dtype not in DTYPES):
        return f"dtype {r.dtype!r:.40} does not fit a {r.kind} (one of {sorted(DTYPES)}, or '' for barrier and join)"
    if not isinstance(r.shapes, tuple) or len(r.shapes) > MAX_TENSORS or (r.kind in EMPTY_KINDS) != (not r.shapes):
        return f"a {r.kind} has {'no shapes' if r.kind in EMPTY_KINDS else f'1 to {MAX_TENSORS} shapes'}"
    for shape in r.shapes:
        if not isinstance(shape, tuple) or len(shape) > MAX_DIMS or any(
                type(d) is not int or not 0 <= d < 1 << 31 for d in shape):
            return f"shape {brief(shape)} is not a tuple of at most {MAX_DIMS} dimensions"
    if r.kind in RAGGED_KINDS and (len(r.shapes) != 1 or not r.shapes[0]):
        return f"a {r.kind} has one shape of at least one dimension"
    if r.kind == "refused":
        if not 0 < len(r.op) <= MAX_REASON:
            return f"a refused call carries a reason of 1 to {MAX_REASON} characters"
    elif not _valid_op(r.op):
        return f"op {r.op!r:.40} is not one of {', '.join(OPS)}"
    if type(r.root) is not int or not -1 <= r.root < size or (r.kind == "broadcast" and r.root < 0) or (
            r.kind not in ("broadcast", "join") and r.root != -1):
        return f"root {brief(r.root)} does not fit a {r.kind} of {size} ranks"
    if type(r.priority) is not int or not 0 <= r.priority < 1 << 31:
        return f"priority {brief(r.priority)} is not an int in [0, 2**31)"
    return ""


def scaled_op(op: str, prescale: float, postscale: float) -> str:
    """An allreduce op as Horovod's API gives it: the caller multiplies by `prescale` before and by
    `postscale` after (an average's division too: the data plane sums), and the ranks must agree on
    both factors (`average@1.0,0.5`)."""
    return f"{op}@{float(prescale)!r},{float(postscale)!r}"


def data_op(op: str) -> str:
    """The reduction the data plane runs for a request's op: a scaled average is a sum (the caller divides)."""
    base, scaled, _ = op.partition("@")
    return "sum" if scaled and base == "average" else base


def _valid_op(op: str) -> bool:
    base, scaled, factors = op.partition("@")
    if base not in OPS:
        return False
    if not scaled:
        return True
    parts = factors.split(",")
    try:
        return len(factors) <= 64 and len(parts) == 2 and all(math.isfinite(float(p)) for p in parts)
    except ValueError:
        return False


def signature(r: Request) -> tuple[Any, ...]:
    """What must match on every rank: no priority, no first dimension of ragged kinds, op and root only
    where they mean something."""
    shapes = tuple((len(s), *s[1:]) for s in r.shapes) if r.kind in RAGGED_KINDS else r.shapes
    return (r.kind, r.dtype, shapes, r.op if r.kind in ("allreduce", "refused") else "",
            r.root if r.kind == "broadcast" else -1)


def describe(r: Request) -> str:
    """`allreduce float32 [[4, 3]] sum`, `broadcast int64 [[10]] root 2`, `barrier`."""
    if r.kind == "refused":
        return f"nothing: it refused the call ({r.op})"
    words = [r.kind]
    if r.dtype:
        words.append(r.dtype)
    if r.shapes:
        words.append(str([list(s) for s in r.shapes]))
    if r.kind == "allreduce":
        base, _, factors = r.op.partition("@")
        words.append(base)
        pre, post = (float(f) for f in factors.split(",")) if factors else (1.0, 1.0)
        words.extend(f"{what} {value:g}" for what, value in (("prescale", pre), ("postscale", post)) if value != 1.0)
    if r.kind == "broadcast":
        words.append(f"root {r.root}")
    return " ".join(words)


def ranks_text(ranks: list[int]) -> str:
    """`rank 3`, `ranks 2, 3`, `ranks 0-5, 9`: runs of three or more written as ranges."""
    runs: list[list[int]] = []
    for rank in sorted(ranks):
        if runs and runs[-1][-1] == rank - 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    words = [f"{run[0]}-{run[-1]}" if len(run) >= 3 else ", ".join(map(str, run)) for run in runs]
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(words)}"
