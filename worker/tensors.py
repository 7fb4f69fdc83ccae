"""The parameter-server client's tables: tensors declared by the scheduler's plan, operations awaiting replies.

No sockets and no threads: the client (worker/client.py) calls these under its own lock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from sluice.errors import SluiceError
from sluice.transport.config import TransportConfig
from sluice.transport.dtypes import STORAGE
from sluice.transport.wire import Kind, Message
from sluice.worker.handle import Handle

TensorDecl = tuple[str, tuple[int, ...], str, dict[str, Any] | None]


@dataclass
class Tensor:
    key: int
    name: str
    shape: tuple[int, ...]
    dtype: str
    priority: int
    channel: int
    chunks: list[tuple[int, int, int, int]]  # (chunk, offset, length, server rank)
    numel: int = 0
    round: int = 0
    bcast_version: int = 0
    opt_sent: dict[str, Any] | None = None

    def flat(self, array: np.ndarray, writable: bool) -> np.ndarray:
        """`array` as a flat view, checked against the declaration (a read-only input may be copied)."""
        if array.dtype != STORAGE[self.dtype] or array.size != self.numel:
            raise SluiceError(
                f"tensor {self.name!r} is {self.dtype}{list(self.shape)}; got {array.dtype}{list(array.shape)}"
            )
        if not array.flags.c_contiguous:
            if writable:
                raise SluiceError(f"output for {self.name!r} must be contiguous")
            array = np.ascontiguousarray(array)
        return array.reshape(-1)


def parse_plan(plan: list[Any], known: dict[str, Tensor], settings: TransportConfig) -> dict[str, Tensor]:
    """The tensors of a PLAN table [[key, name, shape, dtype, priority, chunks], ...] not in `known`; the
    scheduler is authenticated, but not trusted blindly: a malformed table raises SluiceError."""
    levels = max(len(plan), 1)
    try:
        new = {}
        for key, name, shape, dtype, priority, chunks in plan:
            if name not in known:
                numel = sum(n for _, _, n, _ in chunks)
                nbytes = numel * np.dtype(STORAGE[dtype]).itemsize
                new[name] = Tensor(
                    key, name, tuple(shape), dtype, priority, settings.channel_for(priority, levels, nbytes),
                    [(c, o, n, s) for c, o, n, s in chunks], numel=numel,
                )
    except (TypeError, ValueError, KeyError) as exc:
        raise SluiceError(f"malformed PLAN from the scheduler: {type(exc).__name__}") from None
    return new


def chunk_sizes(tensors: dict[str, Tensor]) -> list[tuple[int, int, int, int]]:
    """(key, chunk, bytes, server rank) of every chunk of `tensors`."""
    return [(t.key, c, n * np.dtype(STORAGE[t.dtype]).itemsize, server)
            for t in tensors.values() for c, _, n, server in t.chunks]


@dataclass
class Op:
    handle: Handle
    out: np.ndarray | None
    dtype: str
    #: what was sent for this chunk and to which server, kept to send again to a replacement (resend.py)
    server: int = -1
    request: Message | None = None


class Pending:
    """The operations awaiting replies, by (reply kind, key, chunk, round), oldest first."""

    def __init__(self) -> None:
        self._ops: dict[tuple[Kind, int, int, int], deque[Op]] = {}

    def add(self, tensor: Tensor, kind: Kind, round_: int, what: str, out: np.ndarray | None,
            requests: list[tuple[int, Message]], timeout: float) -> Handle:
        """A handle for one operation on every chunk; `requests`: (server, message) per chunk, in the
        tensor's chunk order."""
        owners = {c: f"server {s}" for c, _, _, s in tensor.chunks}
        handle = Handle(what, owners, timeout)
        for (chunk, offset, length, _), (server, request) in zip(tensor.chunks, requests, strict=True):
            view = out[offset : offset + length] if out is not None else None
            self._ops.setdefault((kind, tensor.key, chunk, round_), deque()).append(
                Op(handle, view, tensor.dtype, server, request))
        return handle

    def take(self, msg: Message) -> Op | None:
        """The oldest operation a reply answers (one with an output for a reply with a payload), removed."""
        where = (msg.kind, msg.key, msg.chunk, msg.round)
        ops = self._ops.get(where)
        op = next((o for o in ops if (o.out is None) == (msg.payload is None)), None) if ops else None
        if op is None or ops is None:
            return None
        ops.remove(op)
        if not ops:
            del self._ops[where]
        return op

    def handles(self, request: Message) -> list[Handle]:
        """The handles of the operations that sent `request` and await its reply."""
        return [op.handle for op in self._ops.get((Kind.REPLY, request.key, request.chunk, request.round), ())
                if op.request is request]

    def pop(self, kind: Kind, key: int, chunk: int, round_: int) -> deque[Op]:
        """Every operation awaiting this reply, removed."""
        return self._ops.pop((kind, key, chunk, round_), deque())

    def drain(self) -> list[Op]:
        """Every operation, removed."""
        ops, self._ops = self._ops, {}
        return [op for queue in ops.values() for op in queue]

    def rounds(self) -> set[tuple[int, int]]:
        """(key, round) of every operation still awaited."""
        return {(key, round_) for _, key, _, round_ in self._ops}

    def requests(self) -> Iterator[tuple[int, Message | None]]:
        """(server, request) of every operation still awaited."""
        return ((op.server, op.request) for ops in self._ops.values() for op in ops)
