"""An aggregator's sums of rounds its children replay (ps.replicas), for a server that took over a lost shard (pure).

A server that takes over the shard of a lost host restores its mirror, which may be up to
ps.mirror_every rounds behind what was answered (ps/mirror.py), and redoes those rounds from the
pushes it first got. What went up an aggregation tree reached it inside its aggregator's sum: the
aggregator keeps copies of its sums (scheduler/resend.py `Answered`), but an aggregator lost with the
same host took them along. Its replacement, started on another host, gets its children's copies
instead (each worker keeps what it pushed up a tree too, and replays it when the aggregator came back
elsewhere: worker/replaced.py): it sums each replayed round of a chunk over the same subtree in the
same rank order, so the sum is bit for bit the first one, sends it up marked RESEND | REPLAY (the
server applies it if that round is its next, and drops it if it has it), and keeps it, should its
server be replaced only later. Several rounds of a chunk are summed at once (each child replays
oldest first, but no child waits for another); a round some child no longer holds never completes,
and is dropped once a live round of that chunk is answered (every replay came before it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sluice.ps.ranked_sum import RankedSum, SparePool, f32_to_bf16
from sluice.ps.relay_tables import Tables, TreeView
from sluice.ps.store import Reply
from sluice.scheduler.resend import Answered
from sluice.transport.dtypes import STORAGE
from sluice.transport.wire import Flag, Kind, Message, WireError

#: rounds of one chunk replayed at once at most (the workers keep ps.mirror_every of them, at most 16)
MAX_REPLAYED_ROUNDS = 64


@dataclass
class _Replay:
    view: TreeView
    route: tuple[int, int]
    #: each child's piece, copied: lowest rank -> (ranks, data)
    pieces: dict[int, tuple[tuple[int, ...], np.ndarray]] = field(default_factory=dict)
    opt: Any = None

    def covered(self) -> int:
        return sum(len(ranks) for ranks, _ in self.pieces.values())


class Replays:
    def __init__(self, tables: Tables, spare: SparePool) -> None:
        self.tables, self._spare = tables, spare
        #: (key, chunk, round) -> the pieces so far
        self._replaying: dict[tuple[int, int, int], _Replay] = {}
        #: (key, chunk) -> the channel its replays came on (what is kept goes again on it)
        self.channels: dict[tuple[int, int], int] = {}
        #: (key, chunk) -> its rounds being summed (bounded: a job of many chunks replays them all at once)
        self._rounds: dict[tuple[int, int], set[int]] = {}

    def take(self, node_id: int, channel: int, msg: Message, ranks: tuple[int, ...], view: TreeView,
             route: tuple[int, int], kept: Answered | None) -> list[Reply]:
        """A child's replay of an answered round (RESEND | REPLAY, no reply wanted; checked as any push by the
        caller, and not of the round in progress here, which takes it): kept until its siblings' of the same
        round are in, then summed in rank order and sent up as the sum first was."""
        at = (msg.key, msg.chunk, msg.round)
        entry = self._replaying.get(at)
        length, dtype, server = self.tables.chunk(msg.key, msg.chunk)
        if entry is None:
            if len(self._rounds.get(at[:2], ())) >= MAX_REPLAYED_ROUNDS:
                raise WireError(f"more than {MAX_REPLAYED_ROUNDS} rounds of key {msg.key} chunk {msg.chunk} replayed")
            entry = self._replaying[at] = _Replay(view, route)
            self._rounds.setdefault(at[:2], set()).add(at[2])
        if any(not set(ranks).isdisjoint(taken) for taken, _ in entry.pieces.values()):
            return []  # replayed twice: the first copy is in
        entry.pieces[ranks[0]] = (ranks, np.frombuffer(msg.payload or b"", STORAGE[dtype]).copy())
        if msg.meta and "opt" in msg.meta and entry.opt is None:
            entry.opt = msg.meta["opt"]
        if entry.covered() < len(view.ranks):
            return []
        self._forget(at)
        total = RankedSum(np.zeros(length, np.float32 if dtype == "bfloat16" else STORAGE[dtype]), dtype)
        total.expect(view.ranks)
        for lowest in sorted(entry.pieces):
            total.take(entry.pieces[lowest][0], entry.pieces[lowest][1], self._spare)
        out = total.accum
        if dtype == "bfloat16":
            out = np.empty(length, STORAGE[dtype])
            f32_to_bf16(total.accum, out)
        meta: dict[str, Any] = {"ranks": list(view.ranks)}
        if view.parent_is_aggregator:
            meta["route"] = list(route)
        if entry.opt is not None:
            meta["opt"] = entry.opt
        up = Message(Kind.PUSH, sender=node_id, key=msg.key, chunk=msg.chunk, round=msg.round, priority=msg.priority,
                     dtype=dtype, shape=out.shape, payload=out, flags=Flag.RESEND | Flag.REPLAY, meta=meta)
        if kept is not None and not view.parent_is_aggregator:
            kept.keep(server, up)
            self.channels[msg.key, msg.chunk] = channel
        return [(self.tables.parent_peer(view, msg.key, msg.chunk), channel, up)]

    def claim(self, key: int, chunk: int, round_: int) -> list[tuple[tuple[int, ...], np.ndarray, Any]]:
        """The replayed pieces of a round that begins here as a round in progress (a child that had not been
        answered sent it again), taken out: (ranks, data, optimizer settings), lowest ranks first. A child
        answered for it replays it; the others send it again: together they are the round."""
        entry = self._replaying.get((key, chunk, round_)) if self._replaying else None
        if entry is None:
            return []
        self._forget((key, chunk, round_))
        return [(ranks, data, entry.opt) for ranks, data in (entry.pieces[k] for k in sorted(entry.pieces))]

    def answered(self, at: tuple[int, int], round_: int) -> None:
        """A live round of chunk `at` was answered: its replays have all come; one not whole by now never will be."""
        for gone in [r for r in self._rounds.get(at, ()) if r <= round_]:
            self._forget((*at, gone))

    def _forget(self, at: tuple[int, int, int]) -> None:
        del self._replaying[at]
        rounds = self._rounds[at[:2]]
        rounds.discard(at[2])
        if not rounds:
            del self._rounds[at[:2]]
