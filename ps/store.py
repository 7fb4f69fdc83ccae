"""A server's shard: per-chunk values, synchronous rounds, broadcasts and pending pulls; no sockets, no clocks.

`ShardStore.handle` takes one validated wire message and the caller's `now` (ps/role.py reads the
clock) and returns the replies to send, so the whole server protocol is testable with plain arrays.
Arithmetic is numpy, in place; bfloat16 is summed and updated in float32 and rounded back to
nearest-even.

A round's floating-point sum is taken in worker rank order, whatever order the pushes arrive in
(ps/ranked_sum.py). A push comes from a worker (its own rank) or from an aggregator (the sum of the
ranks in its subtree, listed in the push's meta `ranks`); the round completes when every worker's
rank is in.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sluice.ps.optim import Optimizer
from sluice.ps.plan import optimizer_of, parse_plan
from sluice.ps.ranked_sum import FLOAT_DTYPES, RankedSum, SparePool, bf16_to_f32, f32_to_bf16
from sluice.ps.recovered import APPLIED, EARLY, IGNORED, Recovery
from sluice.scheduler.leaving import left
from sluice.transport.dtypes import STORAGE
from sluice.transport.wire import Flag, Kind, Message, WireError, brief, meta_field

__all__ = ["FLOAT_DTYPES", "Reply", "ShardStore", "bf16_to_f32", "f32_to_bf16", "push_ranks", "step_chunk"]

Reply = tuple[str, int, Message]  # (peer, channel, message)


@dataclass
class Waiter:
    peer: str
    channel: int
    round: int
    priority: int


@dataclass
class Chunk:
    key: int
    chunk: int
    name: str
    dtype: str
    value: np.ndarray
    sum: RankedSum
    optimizer: Optimizer | None = None
    opt_state: dict[str, Any] = field(default_factory=dict)
    round: int = 0
    #: ranks of this round's pushes so far (summed, or stashed until their turn)
    pushed: set[int] = field(default_factory=set)
    #: the caller's clock at this round's first push (for `ShardStore.stalled`)
    round_started: float = 0.0
    waiting: list[Waiter] = field(default_factory=list)
    bcast: np.ndarray | None = None
    #: the ranks that push it: a process set's (None: every worker of the job)
    members: frozenset[int] | None = None
    bcast_version: int = 0
    bcast_waiting: list[Waiter] = field(default_factory=list)

    def describe(self) -> str:
        return f"{brief(self.name)} (key {self.key}) chunk {self.chunk}"


class ShardStore:
    def __init__(
        self, node_id: int, workers: int, sync: bool, alloc: Callable[[int, np.dtype], np.ndarray] | None = None
    ) -> None:
        self.node_id, self.workers, self.sync = node_id, workers, sync
        #: zeroed arrays; the server passes the transport's, so replies from them need no copy
        self._alloc = alloc or (lambda count, dtype: np.zeros(count, dtype))
        self.chunks: dict[tuple[int, int], Chunk] = {}
        #: worker node id -> (transport peer name, worker rank)
        self.worker_ids: dict[int, tuple[str, int]] = {}
        #: ranks of workers that have left the job (rounds that need them can never complete)
        self.departed: set[int] = set()
        self.departure_order: list[int] = []  # the first to leave is the likely cause; name it first
        self.left_errors: dict[int, str] = {}  # a departed worker's error, when its goodbye said one
        #: ranks of workers inside join(): every round counts them as pushing zeros until they are back
        self.joined: set[int] = set()
        #: called once, with the first worker to leave and the error, when a round is first found orphaned
        self.on_first_orphan: Callable[[int, str], None] | None = None
        #: aggregator node id -> its transport peer name: their pushes carry the ranks they sum
        self.aggregator_ids: dict[int, str] = {}
        self._spare = SparePool()
        #: ps.recover: the state file every round is committed to before its replies exist (ps/recovered.py)
        self.recovery: Recovery | None = None

    def add_plan(self, tensors: list[Any], recovering: bool = False) -> list[Chunk]:
        """Take the chunks of a PLAN: [[key, name, dtype, optimizer, [[chunk, length], ...]], ...]; a
        malformed plan raises WireError and changes nothing. With ps.recover, the new chunks restored from
        the state file (`recovering`: a PLAN sent again to a replacement server) are returned."""
        added = []
        for key, name, dtype, optimizer, chunks, members in parse_plan(tensors, self.workers):
            for chunk, length in chunks:
                if (key, chunk) in self.chunks:
                    continue
                storage = np.dtype(STORAGE[dtype])
                compute = np.dtype(np.float32) if dtype == "bfloat16" else storage
                added.append(self.chunks.setdefault((key, chunk), Chunk(
                    key, chunk, name, dtype,
                    value=self._alloc(length, storage),
                    sum=RankedSum(self._alloc(length, compute), dtype),
                    optimizer=optimizer,
                    members=members,
                )))
                if members is not None:  # the sum's rank order runs over the set's ranks only
                    added[-1].sum.expect(tuple(sorted(members)))
        return self.recovery.restore(added, recovering) if self.recovery is not None else []

    # ------------------------------------------------------------------ messages
    def handle(self, peer: str, channel: int, msg: Message, now: float = 0.0) -> list[Reply]:
        """One peer's message at `now` (the caller's clock, seconds; only `stalled` reads it): the replies."""
        if self.aggregator_ids.get(msg.sender) == peer and msg.kind == Kind.PUSH:
            ranks = push_ranks(msg, self.workers)
        else:
            ranks = (self._worker_rank(peer, msg.sender),)
        if msg.kind == Kind.JOIN and len(ranks) == 1:
            return self._join(ranks[0], meta_field(msg, "joined", bool), peer, channel, msg)
        chunk = self.chunks.get((msg.key, msg.chunk))
        if chunk is None:
            raise WireError(f"unknown key {msg.key} chunk {msg.chunk}")
        if msg.kind == Kind.PUSH:
            return self._push(chunk, ranks, peer, channel, msg, now)
        if msg.kind == Kind.PULL:
            return self._pull(chunk, Waiter(peer, channel, msg.round, msg.priority))
        if msg.kind == Kind.BCAST_PUSH:
            return self._bcast_push(chunk, peer, channel, msg)
        if msg.kind == Kind.BCAST_PULL:
            chunk.bcast_waiting.append(Waiter(peer, channel, msg.round, msg.priority))
            return self._serve_bcast(chunk)
        raise WireError(f"a server does not take {msg.kind.name} messages")

    def check_worker(self, peer: str, sender: int) -> None:
        """Raise WireError unless `sender` on connection `peer` is a worker of this job."""
        self._worker_rank(peer, sender)

    def _worker_rank(self, peer: str, sender: int) -> int:
        known = self.worker_ids.get(sender)
        if known is None or known[0] != peer:
            raise WireError(f"sender {sender} on connection {peer!r} is not a worker of this job")
        return known[1]

    def _payload(self, chunk: Chunk, msg: Message) -> np.ndarray:
        if msg.payload is None:  # e.g. a shared-memory descriptor the transport has not mapped
            raise WireError(f"a {msg.kind.name} for {chunk.describe()} carries no payload")
        if msg.dtype != chunk.dtype or msg.shape != chunk.value.shape:
            raise WireError(
                f"{chunk.describe()} holds {chunk.dtype}{list(chunk.value.shape)}, "
                f"message carries {msg.dtype or 'nothing'}{list(msg.shape)}"
            )
        return np.frombuffer(msg.payload, STORAGE[chunk.dtype])

    def _push(self, chunk: Chunk, ranks: tuple[int, ...], peer: str, channel: int, msg: Message,
              now: float) -> list[Reply]:
        data = self._payload(chunk, msg)
        optimizer = chunk.optimizer
        if msg.meta and "opt" in msg.meta:
            optimizer = optimizer_of(msg.meta["opt"], chunk.dtype, chunk.describe())
        if not self.sync and optimizer is not None:
            if len(ranks) > 1:
                raise WireError(f"{chunk.describe()} is updated asynchronously: it takes no aggregated pushes")
            chunk.optimizer = optimizer
            return self._apply_async(chunk, data, Waiter(peer, channel, msg.round, msg.priority), msg.flags)
        seen = self.recovery.duplicate(chunk, ranks, msg) if self.recovery is not None else 0
        if seen == APPLIED:  # sent again to a replacement: it is in the committed value already
            if msg.flags & Flag.REPLAY:
                return []
            if msg.flags & Flag.WANT_REPLY:
                return [(peer, channel, self._reply(Kind.REPLY, chunk, chunk.value,
                                                    Waiter(peer, channel, msg.round, msg.priority)))]
            return [(peer, channel, self._ack(Kind.REPLY, chunk, msg.round, msg.priority))]
        if seen == IGNORED:  # the first copy is in, and registered any reply
            return []
        if seen == EARLY and self.recovery is not None:
            self.recovery.keep_early(chunk, ranks, peer, channel, msg)
            return []
        if msg.round != chunk.round + 1:
            raise WireError(f"push for round {msg.round} of {chunk.describe()}, which is at round {chunk.round}")
        twice = chunk.pushed.intersection(ranks)
        if twice:
            raise WireError(f"worker {min(twice)} pushed {chunk.describe()} twice in round {msg.round}")
        if chunk.members is not None and not chunk.members.issuperset(ranks):
            raise WireError(f"worker {min(set(ranks) - chunk.members)} is not in the process set of {chunk.describe()}")
        if not self._departed(chunk) <= chunk.pushed:
            return [(peer, channel, self._orphaned(chunk, msg.round, msg.priority))]
        chunk.optimizer = optimizer  # only a push that is taken may change the settings
        if not chunk.pushed:
            chunk.round_started = now
        chunk.sum.take(ranks, data, self._spare)
        chunk.pushed.update(ranks)
        replies: list[Reply] = []
        if msg.flags & Flag.WANT_REPLY:
            chunk.waiting.append(Waiter(peer, channel, msg.round, msg.priority))
        elif not msg.flags & Flag.REPLAY:
            replies.append((peer, channel, self._ack(Kind.REPLY, chunk, msg.round, msg.priority)))
        if self._all_in(chunk):
            self._complete(chunk)
            replies += self._serve(chunk)
            if self.recovery is not None:  # pushes of the round after, sent early to a server that took over
                for early_ranks, early_peer, early_channel, early in self.recovery.due(chunk):
                    replies += self._push(chunk, early_ranks, early_peer, early_channel, early, now)
        return replies

    def _all_in(self, chunk: Chunk) -> bool:
        """Every worker that pushes the chunk has, this round (those inside join() count as zeros)."""
        members = chunk.members
        if members is None:
            return len(chunk.pushed) == self.workers or (
                bool(self.joined) and len(chunk.pushed | self.joined) == self.workers)
        return len(chunk.pushed) == len(members) or (
            bool(self.joined) and len(chunk.pushed | (self.joined & members)) == len(members))

    def _departed(self, chunk: Chunk) -> set[int]:
        """The workers that left the job of those that push the chunk."""
        return self.departed if chunk.members is None else self.departed & chunk.members

    def _join(self, rank: int, joined: bool, peer: str, channel: int, msg: Message) -> list[Reply]:
        """A worker called join() (it pushes zeros from now on: rounds the others have all pushed complete
        now), or is back from it (the echo tells it every round from now on waits for it again)."""
        if not joined:
            self.joined.discard(rank)
            return [(peer, channel, Message(Kind.JOIN, sender=self.node_id, round=msg.round, meta={"joined": False}))]
        self.joined.add(rank)
        replies: list[Reply] = []
        for chunk in self.chunks.values():
            if chunk.pushed and self._all_in(chunk):
                self._complete(chunk)
                replies += self._serve(chunk)
        return replies

    def _complete(self, chunk: Chunk) -> None:
        total = chunk.sum
        if chunk.optimizer is None:
            if chunk.dtype == "bfloat16":
                f32_to_bf16(total.accum, chunk.value)
            else:  # swap: the old value's replies have all been received by now (see docs/architecture.md)
                chunk.value, total.accum = total.accum, chunk.value
        else:
            pushers = self.workers if chunk.members is None else len(chunk.members)
            total.accum *= np.asarray(1.0 / pushers, total.accum.dtype)
            if self.recovery is not None:  # ps.replicas may mirror the round as this gradient (ps/mirror.py)
                self.recovery.stepping(chunk, total.accum)
            step_chunk(chunk, total.accum)
        chunk.round += 1
        chunk.pushed.clear()
        total.clear()
        if self.recovery is not None:  # before any reply of this round exists (see ps/recovered.py)
            self.recovery.commit(chunk)

    def _apply_async(self, chunk: Chunk, data: np.ndarray, waiter: Waiter, flags: int) -> list[Reply]:
        grad = bf16_to_f32(data) if chunk.dtype == "bfloat16" else data.copy()
        step_chunk(chunk, grad)
        chunk.round += 1
        if flags & Flag.WANT_REPLY:  # a snapshot: the next push changes `value` while this is in flight
            return [(waiter.peer, waiter.channel, self._reply(Kind.REPLY, chunk, chunk.value.copy(), waiter))]
        return [(waiter.peer, waiter.channel, self._ack(Kind.REPLY, chunk, waiter.round, waiter.priority))]

    def _pull(self, chunk: Chunk, waiter: Waiter) -> list[Reply]:
        if not self.sync and chunk.optimizer is not None:
            return [(waiter.peer, waiter.channel, self._reply(Kind.REPLY, chunk, chunk.value.copy(), waiter))]
        if self.departed and waiter.round > chunk.round and not (
            waiter.round == chunk.round + 1 and self.departed <= chunk.pushed
        ):  # the round this pull waits for needs a worker that has left
            return [(waiter.peer, waiter.channel, self._orphaned(chunk, waiter.round, waiter.priority))]
        chunk.waiting.append(waiter)
        return self._serve(chunk)

    def _serve(self, chunk: Chunk) -> list[Reply]:
        ready = [w for w in chunk.waiting if w.round <= chunk.round]
        if not ready:
            return []
        chunk.waiting = [w for w in chunk.waiting if w.round > chunk.round]
        return [(w.peer, w.channel, self._reply(Kind.REPLY, chunk, chunk.value, w)) for w in ready]

    def _bcast_push(self, chunk: Chunk, peer: str, channel: int, msg: Message) -> list[Reply]:
        data = self._payload(chunk, msg)
        if msg.round <= chunk.bcast_version:
            if self.recovery is not None and msg.flags & Flag.RESEND:  # taken before the restart
                ack = self._ack(Kind.BCAST_REPLY, chunk, msg.round, msg.priority)
                return [(peer, channel, ack)] if msg.flags & Flag.WANT_REPLY else []
            raise WireError(f"broadcast {msg.round} of {chunk.describe()} is older than {chunk.bcast_version}")
        chunk.bcast = data.copy()  # a fresh array: replies of the previous version may still be in flight
        chunk.bcast_version = msg.round
        if chunk.round == 0 or chunk.optimizer is not None:
            np.copyto(chunk.value, chunk.bcast)
        if self.recovery is not None:
            self.recovery.commit(chunk)
        replies = self._serve_bcast(chunk)
        if msg.flags & Flag.WANT_REPLY:
            replies.append((peer, channel, self._ack(Kind.BCAST_REPLY, chunk, msg.round, msg.priority)))
        return replies

    def _serve_bcast(self, chunk: Chunk) -> list[Reply]:
        ready = [w for w in chunk.bcast_waiting if w.round <= chunk.bcast_version]
        if not ready or chunk.bcast is None:
            return []
        chunk.bcast_waiting = [w for w in chunk.bcast_waiting if w.round > chunk.bcast_version]
        return [(w.peer, w.channel, self._reply(Kind.BCAST_REPLY, chunk, chunk.bcast, w)) for w in ready]

    def _reply(self, kind: Kind, chunk: Chunk, data: np.ndarray, waiter: Waiter) -> Message:
        return Message(
            kind, sender=self.node_id, key=chunk.key, chunk=chunk.chunk, round=waiter.round,
            priority=waiter.priority, dtype=chunk.dtype, shape=data.shape, payload=data,
        )

    def _ack(self, kind: Kind, chunk: Chunk, round_: int, priority: int) -> Message:
        return Message(kind, sender=self.node_id, key=chunk.key, chunk=chunk.chunk, round=round_, priority=priority)

    def worker_left(self, rank: int, error: str = "") -> list[Reply]:
        """Worker `rank` said goodbye (`error`: the exception that ended it, if it said one): every round still
        waiting for it fails now, naming it."""
        if type(rank) is not int or not 0 <= rank < self.workers:
            raise WireError(f"worker {brief(rank)} cannot leave: the job has workers 0..{self.workers - 1}")
        if rank not in self.departed:
            self.departed.add(rank)
            self.departure_order.append(rank)
            if error:
                self.left_errors[rank] = error
        replies = []
        for chunk in self.chunks.values():
            if not chunk.pushed or chunk.pushed >= self._departed(chunk):
                continue
            for waiter in chunk.waiting:
                replies.append((waiter.peer, waiter.channel, self._orphaned(chunk, waiter.round, waiter.priority)))
            chunk.waiting = []
        return replies

    def _orphaned(self, chunk: Chunk, round_: int, priority: int) -> Message:
        pushers = self._departed(chunk)
        gone = [r for r in self.departure_order if r not in chunk.pushed and r in pushers] or self.departure_order
        first_error = self.left_errors.get(gone[0], "")
        who = (left(f"worker {gone[0]}", first_error) if len(gone) == 1
               else f"workers {', '.join(map(str, gone))} have left the job (worker {gone[0]} first"
                    + (f", with an error ({first_error}))" if first_error else ")"))
        hint = "" if first_error else " (did the workers run different numbers of steps?)"
        error = f"round {round_} of {chunk.describe()} can never complete: {who}{hint}"
        if self.on_first_orphan is not None:
            report, self.on_first_orphan = self.on_first_orphan, None
            report(self.departure_order[0], error)
        return Message(Kind.ERROR, sender=self.node_id, key=chunk.key, chunk=chunk.chunk, round=round_,
                       priority=priority, meta={"error": error})

    # ------------------------------------------------------------------ diagnostics
    def stalled(self, now: float, limit: float) -> list[str]:
        """Rounds in progress for longer than `limit` seconds, naming the workers not yet heard from."""
        ranks = {rank for _, rank in self.worker_ids.values()}
        return [
            f"round {c.round + 1} of {c.describe()} has waited {now - c.round_started:.0f} s for workers "
            f"{sorted((ranks if c.members is None else set(c.members)) - c.pushed)}"
            for c in self.chunks.values()
            if c.pushed and now - c.round_started > limit
        ]


def step_chunk(chunk: Chunk, grad: np.ndarray) -> None:
    """`chunk`'s optimizer applied to its value and state with `grad` (compute dtype; may be overwritten)."""
    assert chunk.optimizer is not None
    if chunk.dtype == "bfloat16":
        param = bf16_to_f32(chunk.value)
        chunk.optimizer.step(param, grad, chunk.opt_state)
        f32_to_bf16(param, chunk.value)
    else:
        chunk.optimizer.step(chunk.value, grad, chunk.opt_state)


def push_ranks(msg: Message, workers: int) -> tuple[int, ...]:
    """The worker ranks an aggregator's push sums (its meta `ranks`: sorted, distinct, in range), or WireError."""
    ranks = msg.meta.get("ranks") if msg.meta else None
    if (type(ranks) is not list or not ranks or len(ranks) > workers
            or not all(type(r) is int and 0 <= r < workers for r in ranks)
            or any(a >= b for a, b in itertools.pairwise(ranks))):
        raise WireError(f"an aggregated push must list the sorted, distinct worker ranks it sums, got {brief(ranks)}")
    return tuple(ranks)
