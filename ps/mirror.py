"""A server's committed chunks mirrored on other hosts (ps.replicas): the MIRROR message, held replies.

With ps.recover each round is committed to the server's state file (ps/snapshot.py) before any reply
of it exists. With ps.replicas = N the same committed state also goes, as a MIRROR per chunk and
commit, to each server that holds this one's state (primary-backup: all at once; placed by the
scheduler, scheduler/recovery.py `Placement`: the next N servers in rank order on other hosts), which
writes it into a state file of the same format in its host's /dev/shm (ps/mirror_holder.py) and
answers MIRROR_ACK. A chunk is mirrored every ps.mirror_every (`every`) rounds, each chunk at its own
phase, and a reply of round R is held here until every holder acknowledged round R - every: no reply
waits for its own round's MIRROR, what a worker has seen is at most `every` rounds ahead of any
holder's copy, and every worker keeps its pushes of that many answered rounds (scheduler/resend.py)
to replay to a holder that takes over, which redoes those rounds from the same pushes,
bit-identically. Why not a chain (primary -> holder 1 -> holder 2): every server of a sharded job is
a primary and a holder, so each host's link carries N copies either way, and a chain takes N hops.

A MIRROR carries one of two things (meta `grad`). With `every` = 1 and an optimizer on the servers, a
round whose previous round went to the holder in this connection's order carries the round's
averaged gradient (1x the chunk, in the optimizer's compute dtype), and the holder steps the same deterministic
optimizer (ps/store.py `step_chunk`, the settings in meta `opt`) on its own copy: bit-identical, and
1x on the wire where the state is 2x with momentum and 3x with Adam, which on a 1 Gbit/s link is
what a step pays for (docs/cluster.md gives the measurement). Otherwise (no optimizer: the sum is
the value; a changed broadcast; the chunk's first mirror, or the first after a restart) it carries
the committed state: the value, then the optimizer's arrays that meta `bits` names (in
optim.STATE_ARRAYS order), then the broadcast buffer when meta `bcast` is true (it changed). Meta
`bits` and `t` always describe the state after the round, so the holder checks its step against them.
The payload is cut into pieces the size of the largest chunk; the holder acknowledges the last.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from sluice.ps import optim
from sluice.ps.store import Chunk, Reply
from sluice.scheduler.recovery import holders as holders  # the placement the scheduler uses too
from sluice.transport.config import MAX_CHUNK_BYTES
from sluice.transport.dtypes import STORAGE
from sluice.transport.wire import Kind, Message, WireError


def mirror_channel(channels: int) -> int:
    """The transport channel all mirror messages between two servers take: the least urgent, as a MIRROR has a
    step to arrive (only the next round's replies wait for it) and should not delay a round's replies on a
    link that honours the channels' ToS marks; one channel keeps them in commit order, and a listening side
    can only answer on a channel it heard the dialler on."""
    return channels - 1


#: a MIRROR's state (up to 3x a chunk for Adam, more for bfloat16) goes in pieces no larger than the
#: largest payload every transport takes
PIECE_BYTES = MAX_CHUNK_BYTES


def dials(rank: int, other: int) -> bool:
    """Whether server `rank` connects to server `other` for mirroring (one connection a pair, as a transport
    drops what arrives on its listening side from a peer it dialled): the higher rank dials, then says
    hello, and the lower one can send to it once it heard that."""
    return rank > other


def hello_message(node_id: int, endpoints: Sequence[str]) -> Message:
    """The dialler's hello, naming its process by the endpoints it listens on (as the scheduler's SERVER_BACK
    names a restarted one's)."""
    return Message(Kind.MIRROR_ACK, sender=node_id, meta={"hello": True, "endpoints": list(endpoints)})


def compute_dtype(dtype: str) -> np.dtype:
    """The dtype of a chunk's optimizer arrays (bfloat16 is updated in float32)."""
    return np.dtype(np.float32) if dtype == "bfloat16" else np.dtype(STORAGE[dtype])


def payload_bytes(length: int, dtype: str, bits: int, with_bcast: bool) -> int:
    """The size of a MIRROR's payload for a chunk of `length` elements."""
    storage = np.dtype(STORAGE[dtype]).itemsize
    return length * (storage * (1 + with_bcast) + compute_dtype(dtype).itemsize * bin(bits).count("1"))


def mirror_messages(chunk: Chunk, sender: int, with_bcast: bool, grad: np.ndarray | None = None,
                    again: bool = False) -> list[Message]:
    """The MIRROR of `chunk`'s committed state (its round, value, optimizer and state, and broadcast), or with
    `grad` of the gradient its round was stepped with (a private copy: it becomes the payload), in pieces of
    at most PIECE_BYTES (meta `at`: where each starts; the first one's meta has the rest). `again` (meta
    `again`): a restored primary's state, which a holder takes at any round."""
    state = chunk.opt_state
    bits = optim.state_bits(state) if state else 0
    if grad is not None:
        payload = grad.view(np.uint8)
    else:
        parts = [chunk.value, *(state[name] for i, name in enumerate(optim.STATE_ARRAYS) if bits >> i & 1)]
        if with_bcast and chunk.bcast is not None:
            parts.append(chunk.bcast)
        payload = np.concatenate([np.ascontiguousarray(part).view(np.uint8) for part in parts])
    first = {"at": 0, "bits": bits, "t": int(state.get("t", 0)), "opt": [optim.optimizer_code(chunk.optimizer),
             *optim.optimizer_settings(chunk.optimizer)], "bv": chunk.bcast_version,
             "bcast": grad is None and with_bcast and chunk.bcast is not None, "grad": grad is not None,
             **({"again": True} if again and grad is None else {})}
    return [Message(Kind.MIRROR, sender=sender, key=chunk.key, chunk=chunk.chunk, round=chunk.round, dtype="uint8",
                    shape=piece.shape, payload=piece, meta=first if at == 0 else {"at": at})
            for at in range(0, max(payload.size, 1), PIECE_BYTES) for piece in (payload[at:at + PIECE_BYTES],)]


@dataclass
class _Sent:
    round: int
    at: float
    pieces: list[Message]


@dataclass
class Holder:
    """One server that holds this one's state, as the primary tracks it."""

    rank: int
    peer: str
    host: str
    #: whether it can be sent to: it dials this server, and said hello (`dials`)
    ready: bool = True
    #: the endpoints of the process whose hello came last: a holder restarted on its host dials at once, and its
    #: hello may come before the scheduler's SERVER_BACK tells of the restart
    hello_from: tuple[str, ...] = ()
    #: (key, chunk) -> the newest round it acknowledged
    acked: dict[tuple[int, int], int] = field(default_factory=dict)
    #: (key, chunk) -> its MIRRORs not yet acknowledged, oldest first
    sent: dict[tuple[int, int], deque[_Sent]] = field(default_factory=dict)

    def describe(self) -> str:
        return f"server {self.rank} on {self.host}"


class MirrorSender:
    """The primary's side: a MIRROR every `every` commits of a chunk to each of its holders (primary-backup: all
    at once), and replies held until every holder has the round `every` before theirs."""

    def __init__(self, rank: int, holders: Sequence[Holder], node_id: int, timeout: float,
                 clock: Callable[[], float] = time.monotonic, channel: int = 0, every: int = 1) -> None:
        self.rank, self.node_id, self.timeout, self._clock, self.channel = rank, node_id, timeout, clock, channel
        #: the servers holding this one's state, by transport name, first the one that takes over
        self.holders = {holder.peer: holder for holder in holders}
        #: ps.mirror_every: a chunk's state is mirrored every this many rounds (1: each round, as its gradient
        #: with an optimizer on the servers); a reply of round R waits until the holders have round R - every
        self.every = every
        #: MIRRORs made by commits, to send before any reply of the same handling
        self.outbox: list[Reply] = []
        self._held: dict[tuple[int, int], list[Reply]] = {}
        #: (key, chunk) -> the broadcast version the holders have
        self._bcast_sent: dict[tuple[int, int], int] = {}
        #: (key, chunk) -> the round of the last MIRROR made for it: the holders have that round before the next
        self._made: dict[tuple[int, int], int] = {}
        #: (key, chunk) -> (the round it makes, a copy of the gradient the optimizer is stepping with)
        self._grads: dict[tuple[int, int], tuple[int, np.ndarray]] = {}
        self.mirrored = 0  # MIRRORs acknowledged, by all holders together
        self.bytes = 0  # payload bytes of the MIRRORs made, once per holder

    def describe(self) -> str:
        return " and ".join(holder.describe() for holder in self.holders.values())

    def stepping(self, chunk: Chunk, grad: np.ndarray) -> None:
        """Recovery's before_step: the gradient `chunk`'s next round is about to be stepped with (copied: the
        step may overwrite it), mirrored instead of the state if the holders have the round before."""
        if self.every == 1:
            self._grads[(chunk.key, chunk.chunk)] = (chunk.round + 1, grad.copy())

    def committed(self, chunk: Chunk, force: bool = False) -> None:
        """Recovery's after_commit: `chunk`'s round is in the local file; mirror it if its turn came (`every`
        rounds since the last, a changed broadcast, its first round, or `force`: a state the holders take
        whatever round they have, as a primary restored from one holder's copy may be behind another's)."""
        key = (chunk.key, chunk.chunk)
        new_bcast = chunk.bcast is not None and self._bcast_sent.get(key) != chunk.bcast_version
        made = self._made.get(key)
        if not (force or new_bcast or made is None or self._due(key, chunk.round, made)):
            return  # the workers keep their pushes since the last (scheduler/resend.py), to redo them from it
        if new_bcast:
            self._bcast_sent[key] = chunk.bcast_version
        stepped = self._grads.pop(key, None)
        # the gradient only onto the round before it, in this MIRROR stream's order (a holder takes a stream's
        # MIRRORs in order, as one channel keeps them): else the state, which needs nothing before it
        follows = stepped is not None and stepped[0] == chunk.round and made == chunk.round - 1 and not force
        grad = stepped[1] if follows and not new_bcast and stepped is not None else None
        self._made[key] = chunk.round
        pieces = mirror_messages(chunk, self.node_id, new_bcast, grad, again=force)
        for holder in self.holders.values():
            if holder.ready:
                self.outbox += [(holder.peer, self.channel, piece) for piece in pieces]
            self.bytes += sum(piece.nbytes for piece in pieces)
            holder.sent.setdefault(key, deque()).append(_Sent(chunk.round, self._clock(), pieces))

    def _due(self, key: tuple[int, int], round_: int, made: int) -> bool:
        """Whether a chunk last mirrored at round `made` is mirrored at `round_`: at its own phase among the rounds
        (each chunk at a different one, so a round's commits spread their MIRRORs evenly instead of all chunks'
        state going in the same round, which on a busy link would stall the next round), and at the latest
        `every` rounds after the last."""
        return round_ - made >= self.every or (round_ + key[0] * 7 + key[1]) % self.every == 0

    def restored(self, chunks: Sequence[Chunk]) -> None:
        """Chunks a replacement restored from its file: mirrored again, broadcast included, as the holders may
        have missed the last commit, or (this server took over from one holder's copy) be ahead of it."""
        for chunk in chunks:
            self._bcast_sent.pop((chunk.key, chunk.chunk), None)
            self.committed(chunk, force=True)

    def hello(self, peer: str, endpoints: tuple[str, ...] = ()) -> list[Reply]:
        """Holder `peer` dialled this server (again: it was replaced; `endpoints`: its process's), or this server
        dialled it: every MIRROR it has not acknowledged."""
        holder = self.holders[peer]
        holder.ready, holder.hello_from = True, endpoints or holder.hello_from
        self.outbox = [out for out in self.outbox if out[0] != peer]
        return [(peer, self.channel, piece) for sent in holder.sent.values() for one in sent for piece in one.pieces]

    def holder_replaced(self, peer: str, dialled: bool, endpoints: tuple[str, ...]) -> list[Reply]:
        """Holder `peer` was restarted on its host (its file kept what it acknowledged) and listens on `endpoints`:
        what to send it again now (`dialled`: this server connected to them), or at its hello: none if that came
        already (it was sent everything unacknowledged then)."""
        holder = self.holders[peer]
        if dialled:
            return self.hello(peer)
        if holder.hello_from != endpoints:
            holder.ready = False
        return []

    def take(self, replies: list[Reply]) -> list[Reply]:
        """What to send now: the pending MIRRORs first, then the replies that `held` does not keep back."""
        out, self.outbox = self.outbox, []
        for reply in replies:
            key = (reply[2].key, reply[2].chunk)
            if self._held.get(key) or self._holds(key, reply[2]):
                self._held.setdefault(key, []).append(reply)
            else:
                out.append(reply)
        return out

    def _holds(self, key: tuple[int, int], msg: Message) -> bool:
        """Whether a reply waits: one of round R until every holder acknowledged round R - every (so what a
        worker has seen is at most `every` rounds ahead of each holder, and the workers keep that many pushes to
        send again); a broadcast's until every MIRROR of the chunk is acknowledged (its round is a version)."""
        if msg.kind == Kind.BCAST_REPLY:
            return any(holder.sent.get(key) for holder in self.holders.values())
        return any(holder.acked.get(key, 0) < msg.round - self.every for holder in self.holders.values())

    def stop(self, peer: str) -> list[Reply]:
        """Holder `peer` holds this server's state no more (its host was lost): the replies that waited for it
        alone go now."""
        self.holders.pop(peer, None)
        self.outbox = [out for out in self.outbox if out[0] != peer]
        return [reply for key in list(self._held) for reply in self._release(key)]

    def acked(self, peer: str, msg: Message) -> list[Reply]:
        """A MIRROR_ACK (WireError unless it is a holder's, for its oldest MIRROR of that chunk): the replies it
        releases."""
        key = (msg.key, msg.chunk)
        holder = self.holders.get(peer)
        waiting = holder.sent.get(key) if holder is not None else None
        if holder is None or not waiting:
            raise WireError(f"a MIRROR_ACK for key {msg.key} chunk {msg.chunk} that nobody awaits (from {peer!r:.60})")
        if waiting[0].round != msg.round or (msg.meta or {}).get("hello"):
            raise WireError(f"a MIRROR_ACK of round {msg.round} for key {msg.key} chunk {msg.chunk}, whose oldest "
                            f"mirror in flight to {holder.describe()} is of round {waiting[0].round}")
        waiting.popleft()
        self.mirrored += 1
        holder.acked[key] = max(holder.acked.get(key, 0), msg.round)
        if not waiting:
            del holder.sent[key]
        return self._release(key)

    def _release(self, key: tuple[int, int]) -> list[Reply]:
        """The held replies of `key` that wait no more, in the order they were made: a later one never
        overtakes."""
        held = self._held.pop(key, [])
        for at, reply in enumerate(held):
            if self._holds(key, reply[2]):
                self._held[key] = held[at:]
                return held[:at]
        return held

    def overdue(self, now: float) -> str | None:
        """Why this server cannot go on (a mirror unacknowledged past the timeout), or None."""
        late = [(min(sent[0].at for sent in holder.sent.values() if sent), holder)
                for holder in self.holders.values() if any(holder.sent.values())]
        if not late:
            return None
        oldest, holder = min(late, key=lambda one: one[0])
        if now - oldest <= self.timeout:
            return None
        return (f"server {self.rank}: its replica holder {holder.describe()} has not acknowledged a mirrored commit "
                f"for {now - oldest:.0f} s (ps.mirror_timeout = {self.timeout:g} s): is that host or server down? "
                "The rounds it holds cannot be answered without their copy")
