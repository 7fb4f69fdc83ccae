"""A tensor declaration's rules (pure): DECLARE's fields parsed, the workers' tables compared, the PLAN tables built.

The rendezvous (scheduler/rendezvous.py) collects one declaration from every worker; once all are in,
`declaration_problem` says why it must fail the job (or None), `settle_limits` fixes the job's chunk
size and in-flight bound at the first one, and `server_shard` / `worker_table` are what the PLAN
messages carry. Servers, aggregators and workers parse the PLAN's limits with `parse_limits` too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sluice.scheduler.calibration import Limits, agree
from sluice.scheduler.partition import TensorPlan, TensorSpec
from sluice.transport.config import DEFAULT_CHUNK_BYTES, DEFAULT_INFLIGHT_BYTES
from sluice.transport.wire import DTYPES, WireError, brief

#: dimensions of a declared tensor (the bound keeps error messages and size arithmetic small)
MAX_TENSOR_DIMS = 64
#: chunks one declaration may be cut into: its PLANs (about 17 bytes a chunk) must fit CONTROL_HEADER_BYTES
MAX_PLAN_CHUNKS = 1 << 17


@dataclass
class Declaration:
    by_rank: dict[int, list[Any]] = field(default_factory=dict)
    proposals: dict[int, Limits] = field(default_factory=dict)
    plans: list[TensorPlan] = field(default_factory=list)
    #: the plan as workers get it: [[key, name, shape, dtype, priority, [[chunk, offset, length, server]]]]
    table: list[Any] = field(default_factory=list)
    acks: set[str] = field(default_factory=set)
    #: the workers that declare it: every worker, or a process set's (its tensors' rounds count only them)
    members: list[int] = field(default_factory=list)
    #: the seq the declaring workers numbered it with (a process set's declarations are numbered apart)
    reply_seq: int = 0
    #: its place in the order the scheduler planned declarations (a standby replays them in it)
    order: int = -1


def parse_limits(raw: object) -> Limits:
    """[chunk_bytes, inflight_bytes] from a DECLARE or PLAN message, validated."""
    if (
        not isinstance(raw, list) or len(raw) != 2 or not all(type(v) is int for v in raw)
        or not 4096 <= raw[0] <= 1 << 30 or not 1 <= raw[1] <= 1 << 34
    ):
        raise WireError(f"limits must be [chunk bytes 4096..2**30, in-flight bytes 1..2**34], got {brief(raw)}")
    return Limits(raw[0], raw[1])


def parse_tensor_table(raw: object) -> list[tuple[TensorSpec, Any]]:
    """[[name, shape, dtype, optimizer-or-nil], ...] from a DECLARE message, validated."""
    if not isinstance(raw, list):
        raise WireError(f"tensors must be a list, got {brief(raw)}")
    table = []
    for entry in raw:
        if not (isinstance(entry, list) and len(entry) == 4 and isinstance(entry[0], str)):
            raise WireError(f"each tensor entry must be [name, shape, dtype, optimizer], got {brief(entry)}")
        name, shape, dtype, opt = entry
        if (not isinstance(shape, list) or len(shape) > MAX_TENSOR_DIMS
                or not all(type(d) is int and d >= 0 for d in shape)):
            raise WireError(f"tensor {brief(name)}: shape must be a list of at most {MAX_TENSOR_DIMS} "
                            f"non-negative ints, got {brief(shape)}")
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise WireError(f"tensor {brief(name)}: dtype {brief(dtype)} is not one of {sorted(DTYPES)}")
        if opt is not None and not isinstance(opt, dict):
            raise WireError(f"tensor {brief(name)}: optimizer settings must be a map or nil, got {brief(opt)}")
        table.append((TensorSpec(name, tuple(shape), dtype), opt))
    return table


def parse_members(raw: object, workers: int, rank: int) -> list[int]:
    """A process set's ranks from a DECLARE (sorted, distinct, in range, the sender's among them), validated."""
    if (not isinstance(raw, list) or not raw or not all(type(r) is int and 0 <= r < workers for r in raw)
            or raw != sorted(set(raw)) or rank not in raw):
        raise WireError(f"a declaration's ranks must be the sorted, distinct ranks of a set of workers with worker "
                        f"{rank} among them, got {brief(raw)}")
    return list(raw)


def table_mismatch(reference: Sequence[TensorSpec], other: Sequence[TensorSpec], rank: int,
                   first: int = 0) -> str | None:
    """The first difference between worker `first`'s table and worker `rank`'s, in words; None if equal."""
    mine = {s.name: s for s in reference}
    theirs = {s.name: s for s in other}
    if len(theirs) != len(other):
        return f"worker {rank} declares a tensor name twice"
    for spec in reference:
        got = theirs.get(spec.name)
        if got is None:
            return f"worker {rank} does not declare tensor {brief(spec.name)} that worker {first} declares"
        if (got.shape, got.dtype) != (spec.shape, spec.dtype):
            return (
                f"worker {rank} declares tensor {brief(spec.name)} as {got.dtype}{list(got.shape)} "
                f"but worker {first} as {spec.dtype}{list(spec.shape)}"
            )
    extra = [name for name in theirs if name not in mine]
    if extra:
        return f"worker {rank} declares tensor {brief(extra[0])} that worker {first} does not"
    return None


def declaration_problem(seq: int, decl: Declaration, planned: Mapping[str, TensorPlan],
                        chunk_bytes: int) -> str | None:
    """Why declaration `seq`, now in from every one of its members, fails the job (the first reason); None if
    it may be planned."""
    first = decl.members[0]
    reference = [spec for spec, _ in decl.by_rank[first]]
    if len({spec.name for spec in reference}) != len(reference):  # the others are compared with it
        return f"tensor declaration {seq} rejected: worker {first} declares a tensor name twice"
    for rank in decl.members[1:]:
        problem = table_mismatch(reference, [spec for spec, _ in decl.by_rank[rank]], rank, first)
        if problem:
            return f"tensor declaration {seq} rejected: {problem}"
    for spec in reference:
        old = planned.get(spec.name)
        if old is not None and old.spec != spec:
            return (
                f"tensor {brief(spec.name)} was declared before as {old.spec.dtype}{list(old.spec.shape)}, "
                f"now as {spec.dtype}{list(spec.shape)}"
            )
    new = [spec for spec in reference if spec.name not in planned]
    pieces = sum(max(1, -(-spec.nbytes // chunk_bytes)) for spec in new)
    if pieces > MAX_PLAN_CHUNKS:
        return (
            f"tensor declaration {seq} rejected: its tensors need {pieces} chunks of {chunk_bytes} bytes, "
            f"more than the {MAX_PLAN_CHUNKS} one declaration may have (declare them in several parts)"
        )
    return None


def settle_limits(chunk_bytes: int, inflight_bytes: int, proposals: Mapping[int, Limits]) -> tuple[Limits, str]:
    """The job's chunk size and in-flight bound (as configured, else from the workers' calibrations), and a
    line saying how they were chosen."""
    proposed = agree(list(proposals.values())) if proposals else None
    chunk = chunk_bytes or (proposed.chunk_bytes if proposed else DEFAULT_CHUNK_BYTES)
    inflight = inflight_bytes or (proposed.inflight_bytes if proposed else DEFAULT_INFLIGHT_BYTES)
    how = {True: "configured", False: "calibrated" if proposed else "default"}
    note = (
        f"chunk size {chunk >> 10} KiB ({how[bool(chunk_bytes)]}), in-flight bound {inflight >> 10} KiB "
        f"({how[bool(inflight_bytes)]})"
        + (f"; workers proposed {', '.join(f'{r}: {p.describe()}' for r, p in sorted(proposals.items()))}"
           if proposals else "")
    )
    return Limits(chunk, inflight), note


def server_shard(plans: Sequence[TensorPlan], server: int, options: Mapping[str, Any],
                 members: list[int] | None = None) -> list[Any]:
    """Server `server`'s part of new plans, as its PLAN carries it: [[key, name, dtype, opt, [[chunk, length]]]],
    each with the process set's `members` last where only they push it."""
    return [
        [p.key, p.spec.name, p.spec.dtype, options[p.spec.name],
         [[c.chunk, c.length] for c in p.chunks if c.server == server], *([members] if members else [])]
        for p in plans
    ]


def worker_table(plans: Sequence[TensorPlan]) -> list[Any]:
    """A declaration's plans as workers and aggregators get them (Declaration.table)."""
    return [
        [p.key, p.spec.name, list(p.spec.shape), p.spec.dtype, p.priority,
         [[c.chunk, c.offset, c.length, c.server] for c in p.chunks]]
        for p in plans
    ]
