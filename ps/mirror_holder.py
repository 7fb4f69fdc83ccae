"""The holder's side of ps.replicas: another server's committed chunks, checked and written to a mirror state file.

A server that mirrors server R (ps/mirror.py `holders`) gets R's part of every PLAN from the scheduler
(meta `mirrors` of its own PLAN), opens R's mirror file in its host's /dev/shm (the StateFile format,
named `sluice-state-<tag>-mirror-<R>`), and then, per MIRROR, checks everything before it writes: the
sender is R's primary on its own connection, the chunk is in R's plan, the round is the next one (or
this one again: after a restart either side may send what the other already has), and the payload is
exactly the size the chunk and the optimizer state it names make. Anything else is refused
(WireError: the transport counts and logs it) and the file keeps its last good round. What it took
is acknowledged with MIRROR_ACK.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sluice.ps import optim
from sluice.ps.mirror import MIRROR_CHANNEL, compute_dtype, payload_bytes
from sluice.ps.plan import parse_plan
from sluice.ps.ranked_sum import FLOAT_DTYPES, RankedSum
from sluice.ps.snapshot import STATE_DIR, StateFile
from sluice.ps.store import Chunk, Reply
from sluice.transport.dtypes import STORAGE
from sluice.transport.wire import Kind, Message, WireError, brief

_Fields = tuple[int, int, tuple[int, tuple[float, ...]], int, bool]  # bits, t, (code, settings), bv, bcast


@dataclass
class _Staged:
    """A commit's MIRROR pieces so far."""

    round: int
    fields: _Fields
    buffer: np.ndarray
    filled: int = 0


@dataclass
class Mirrored:
    """One primary's shard as this holder keeps it."""

    rank: int
    peer: str
    node_id: int
    state: StateFile
    chunks: dict[tuple[int, int], Chunk] = field(default_factory=dict)
    staging: dict[tuple[int, int], _Staged] = field(default_factory=dict)


class MirrorHolder:
    """The mirror files this server holds, by the transport name of the primary each belongs to."""

    def __init__(self, tag: str, node_id: int, workers: int, directory: str = STATE_DIR) -> None:
        self.tag, self.node_id, self.workers, self.directory = tag, node_id, workers, directory
        self.primaries: dict[str, Mirrored] = {}
        self.taken = 0  # MIRRORs written

    def hold(self, rank: int, peer: str, node_id: int) -> None:
        """Mirror server `rank` (transport name `peer`, node id `node_id`); SluiceError if its file is locked."""
        if peer not in self.primaries:
            self.primaries[peer] = Mirrored(rank, peer, node_id, StateFile.open(self.tag, rank, self.directory,
                                                                                holder="mirror"))

    def add_plan(self, rank: int, tensors: Any) -> int:
        """Server `rank`'s part of a PLAN (WireError if malformed or not mirrored here); how many chunks the file
        already held a committed round of (a restarted holder)."""
        mirrored = next((m for m in self.primaries.values() if m.rank == rank), None)
        if mirrored is None:
            raise WireError(f"a PLAN names server {brief(rank)}'s mirror, which this server does not hold")
        added = []
        for key, name, dtype, optimizer, chunks, _ in parse_plan(tensors, self.workers):
            for chunk, length in chunks:
                if (key, chunk) not in mirrored.chunks:
                    storage = np.dtype(STORAGE[dtype])
                    added.append(mirrored.chunks.setdefault((key, chunk), Chunk(
                        key, chunk, name, dtype, value=np.zeros(length, storage),
                        sum=RankedSum(np.zeros(0, compute_dtype(dtype)), dtype), optimizer=optimizer)))
        mirrored.state.add(added)
        held = sum(mirrored.state.restore(new) for new in added)
        for new in added:
            _drop_arrays(new)
        return held

    def take(self, peer: str, msg: Message) -> list[Reply]:
        """A MIRROR piece, checked; with the last piece of a commit, its state is written to the mirror file and
        the MIRROR_ACK returned (WireError: refused, nothing written)."""
        mirrored = self.primaries.get(peer)
        if mirrored is None or mirrored.node_id != msg.sender:
            raise WireError(f"a MIRROR from {peer!r:.60} (node {msg.sender}), which is no server this one mirrors")
        key = (msg.key, msg.chunk)
        chunk = mirrored.chunks.get(key)
        if chunk is None:
            raise WireError(f"a MIRROR of server {mirrored.rank}'s key {msg.key} chunk {msg.chunk}, which its plan "
                            "does not have")
        if msg.dtype != "uint8" or msg.payload is None or len(msg.shape) != 1:
            raise WireError(f"a MIRROR for {chunk.describe()} must carry bytes, got {msg.dtype or 'nothing'}")
        piece = np.frombuffer(msg.payload, np.uint8)
        at = (msg.meta or {}).get("at")
        staged = mirrored.staging.get(key)
        if at == 0:
            staged = mirrored.staging[key] = _Staged(msg.round, *self._first(mirrored, chunk, msg))
        elif staged is None or type(at) is not int or at != staged.filled or msg.round != staged.round:
            mirrored.staging.pop(key, None)
            raise WireError(f"a MIRROR piece at byte {brief(at)} of round {msg.round} for {chunk.describe()} does not "
                            f"follow the {'pieces' if staged else 'nothing'} before it")
        if staged.filled + piece.size > staged.buffer.size or (piece.size == 0) != (staged.buffer.size == 0):
            del mirrored.staging[key]
            raise WireError(f"a MIRROR for {chunk.describe()} carries more than the {staged.buffer.size} bytes its "
                            "state has")
        if staged.filled == 0 and piece.size == staged.buffer.size:
            staged.buffer = piece  # all in one piece: no staging copy
        else:
            staged.buffer[staged.filled:staged.filled + piece.size] = piece
        staged.filled += piece.size
        if staged.filled < staged.buffer.size:
            return []
        del mirrored.staging[key]
        bits, t, optimizer, version, with_bcast = staged.fields
        # views of the payload: read only by the commit just below (a shared-memory payload may be reused)
        _unpack(chunk, staged.buffer, bits, t, with_bcast)
        if (optim.optimizer_code(chunk.optimizer), optim.optimizer_settings(chunk.optimizer)) != optimizer:
            chunk.optimizer = optim.from_settings(*optimizer)
        chunk.round, chunk.bcast_version = msg.round, version
        mirrored.state.commit(chunk)
        _drop_arrays(chunk)
        self.taken += 1
        return [(peer, MIRROR_CHANNEL, Message(Kind.MIRROR_ACK, sender=self.node_id, key=msg.key, chunk=msg.chunk,
                                               round=msg.round))]

    def _first(self, mirrored: Mirrored, chunk: Chunk, msg: Message) -> tuple[_Fields, np.ndarray]:
        """The first piece's fields, checked against the chunk's round and size; a buffer for the whole state."""
        fields = _fields(msg, chunk)
        bits, _, _, version, with_bcast = fields
        # the next round, or this one again (a restarted primary mirrors what it restored; a restarted
        # holder gets again what it may have written but not acknowledged): the same state either way
        if msg.round not in (chunk.round, chunk.round + 1) or version < chunk.bcast_version:
            raise WireError(f"a MIRROR of round {msg.round} (broadcast {version}) for server {mirrored.rank}'s "
                            f"{chunk.describe()}, which is at round {chunk.round} (broadcast {chunk.bcast_version})")
        if version > chunk.bcast_version and not with_bcast:
            raise WireError(f"a MIRROR of broadcast {version} for {chunk.describe()} lacks its buffer (the holder "
                            f"has broadcast {chunk.bcast_version})")
        return fields, np.empty(payload_bytes(chunk.value.size, chunk.dtype, bits, with_bcast), np.uint8)

    def release(self, rank: int) -> str | None:
        """Server `rank` lost its host: its mirror file is unlocked and no longer written here, for the
        replacement started on this host to restore from it and keep as its own; the path (None: not held)."""
        peer = next((peer for peer, m in self.primaries.items() if m.rank == rank), None)
        if peer is None:
            return None
        mirrored = self.primaries.pop(peer)
        mirrored.state.close()
        return mirrored.state.path

    def close(self, remove: bool = False) -> None:
        for mirrored in self.primaries.values():
            mirrored.state.close(remove)


def _fields(msg: Message, chunk: Chunk) -> _Fields:
    """meta bits, t, opt, bv and bcast of a MIRROR, checked against `chunk` (WireError)."""
    meta = msg.meta or {}
    bits, t, opt, version, with_bcast = (meta.get(name) for name in ("bits", "t", "opt", "bv", "bcast"))
    arrays = len(optim.STATE_ARRAYS) if chunk.dtype in FLOAT_DTYPES else 0
    if type(bits) is not int or not 0 <= bits < 1 << arrays:
        raise WireError(f"a MIRROR's meta bits must name optimizer arrays of {chunk.describe()}, got {brief(bits)}")
    if type(t) is not int or not 0 <= t < 1 << 62 or type(version) is not int or not 0 <= version < 1 << 62:
        raise WireError(f"a MIRROR's meta t and bv must be ints >= 0, got {brief(t)} and {brief(version)}")
    if type(with_bcast) is not bool:
        raise WireError(f"a MIRROR's meta bcast must be a bool, got {brief(with_bcast)}")
    if (type(opt) is not list or len(opt) != 1 + optim.SETTINGS_COUNT or type(opt[0]) is not int
            or not all(type(v) is float for v in opt[1:])):
        raise WireError(f"a MIRROR's meta opt must be [code, {optim.SETTINGS_COUNT} floats], got {brief(opt)}")
    settings = tuple(opt[1:])
    try:
        rebuilt = optim.from_settings(opt[0], settings)
    except (ValueError, TypeError, ArithmeticError) as exc:
        raise WireError(f"a MIRROR's optimizer settings are not valid: {exc}") from None
    if rebuilt is not None and chunk.dtype not in FLOAT_DTYPES:
        raise WireError(f"a MIRROR gives {chunk.describe()} ({chunk.dtype}) an optimizer")
    return bits, t, (opt[0], settings), version, with_bcast


def _drop_arrays(chunk: Chunk) -> None:
    """The file has the state: keep only each array's length and dtype (no memory), not the message's buffer."""
    chunk.value = np.broadcast_to(np.zeros(1, chunk.value.dtype), chunk.value.shape)
    chunk.opt_state = {}
    if chunk.bcast is not None:  # only its presence counts until a newer broadcast brings its buffer
        chunk.bcast = chunk.value


def _unpack(chunk: Chunk, payload: np.ndarray, bits: int, t: int, with_bcast: bool) -> None:
    """Point `chunk`'s value, optimizer state and broadcast at their parts of a checked payload."""
    storage, compute = np.dtype(STORAGE[chunk.dtype]), compute_dtype(chunk.dtype)
    length, at = chunk.value.size, 0

    def part(dtype: np.dtype) -> np.ndarray:
        nonlocal at
        view = payload[at:at + length * dtype.itemsize].view(dtype)
        at += length * dtype.itemsize
        return view

    chunk.value = part(storage)
    state: dict[str, Any] = {name: part(compute) for i, name in enumerate(optim.STATE_ARRAYS) if bits >> i & 1}
    if "m" in state:
        state["t"] = t
    chunk.opt_state = state
    if with_bcast:
        chunk.bcast = part(storage)
