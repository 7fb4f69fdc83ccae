"""The holder's side of ps.replicas: another server's committed chunks, checked and written to a mirror state file.

A server that mirrors server R (scheduler/recovery.py `Placement`) gets R's part of every PLAN from the
scheduler (meta `mirrors` of its own PLAN), opens R's mirror file in its host's /dev/shm (the
StateFile format, named `sluice-state-<tag>-mirror-<R>-by-<H>`, H this server's rank), and then, per
MIRROR, checks everything before it writes: the sender is R's primary on its own connection, the
chunk is in R's plan, the round is the next one (a state MIRROR: up to ps.mirror_every later, as it
skips rounds; or this one again: after a restart either side may send what the other already has;
any round for a restored primary's state, meta `again`), and the payload is exactly the size the
chunk and the optimizer state it names make. Anything else is refused (WireError: the transport
counts and logs it) and the file keeps its last good round. What it took is acknowledged with
MIRROR_ACK.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sluice.ps import optim
from sluice.ps.mirror import compute_dtype, payload_bytes
from sluice.ps.plan import parse_plan
from sluice.ps.ranked_sum import FLOAT_DTYPES, RankedSum
from sluice.ps.snapshot import STATE_DIR, StateFile
from sluice.ps.store import Chunk, Reply, step_chunk
from sluice.transport.dtypes import STORAGE
from sluice.transport.wire import Kind, Message, WireError, brief

#: bits, t, (code, settings) when they differ from the chunk's (None: the same), bv, bcast, grad
_Fields = tuple[int, int, tuple[int, tuple[float, ...]] | None, int, bool, bool]


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
    #: per chunk, a zero-byte stand-in for its arrays between commits (made once: the file has the state)
    empty: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    staging: dict[tuple[int, int], _Staged] = field(default_factory=dict)
    #: restored states taken of rounds behind this copy (the primary came back from another holder's)
    rewound: int = 0


class MirrorHolder:
    """The mirror files this server holds, by the transport name of the primary each belongs to."""

    def __init__(self, tag: str, rank: int, node_id: int, workers: int, directory: str = STATE_DIR, channel: int = 0,
                 every: int = 1) -> None:
        self.rank = rank  # this server's: it names the mirror files kept here
        self.channel = channel  # the mirror channel (ps/mirror.py mirror_channel): acks go where MIRRORs came
        self.every = every  # ps.mirror_every: how many rounds a state MIRROR may skip
        self.tag, self.node_id, self.workers, self.directory = tag, node_id, workers, directory
        self.primaries: dict[str, Mirrored] = {}
        self.taken = 0  # MIRRORs written

    def hold(self, rank: int, peer: str, node_id: int) -> None:
        """Mirror server `rank` (transport name `peer`, node id `node_id`); SluiceError if its file is locked."""
        if peer not in self.primaries:
            self.primaries[peer] = Mirrored(rank, peer, node_id, StateFile.open(self.tag, rank, self.directory,
                                                                                held_by=self.rank))

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
        held = 0
        for new in added:
            empty = mirrored.empty[(new.key, new.chunk)] = np.broadcast_to(np.zeros(1, new.value.dtype),
                                                                           new.value.shape)
            if mirrored.state.restore(new):  # a restarted holder: the arrays are copies of the file's
                held += 1
                if new.optimizer is not None and self.every == 1:  # gradient MIRRORs may follow: keep them
                    _keep(new, empty)
                    continue
            _drop_arrays(new, empty)
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
            fields, size = self._first(mirrored, chunk, msg)
            # all in one piece (the usual case): the payload itself, no staging copy
            staged = mirrored.staging[key] = _Staged(msg.round, fields, piece if piece.size == size else
                                                     np.empty(size, np.uint8))
        elif staged is None or type(at) is not int or at != staged.filled or msg.round != staged.round:
            mirrored.staging.pop(key, None)
            raise WireError(f"a MIRROR piece at byte {brief(at)} of round {msg.round} for {chunk.describe()} does not "
                            f"follow the {'pieces' if staged else 'nothing'} before it")
        if staged.filled + piece.size > staged.buffer.size or (piece.size == 0) != (staged.buffer.size == 0):
            del mirrored.staging[key]
            raise WireError(f"a MIRROR for {chunk.describe()} carries more than the {staged.buffer.size} bytes its "
                            "state has")
        if staged.buffer is not piece:
            staged.buffer[staged.filled:staged.filled + piece.size] = piece
        staged.filled += piece.size
        if staged.filled < staged.buffer.size:
            return []
        del mirrored.staging[key]
        bits, t, optimizer, version, with_bcast, grad = staged.fields
        empty = mirrored.empty[key]
        if not grad or msg.round > chunk.round:  # else a round it has, sent again after a restart: just the ack
            if optimizer is not None:  # new settings (checked by _fields), the ones the primary stepped with
                chunk.optimizer = optim.from_settings(*optimizer)
            if grad:
                _step(chunk, staged.buffer, bits, t, empty)
            else:  # views of the payload: copied by the commit and _keep below (a shared-memory payload is reused)
                _unpack(chunk, staged.buffer, bits, t, with_bcast)
            mirrored.rewound += msg.round < chunk.round
            chunk.round, chunk.bcast_version = msg.round, version
            mirrored.state.commit(chunk)
            if not grad and chunk.optimizer is not None and self.every == 1:
                _keep(chunk, empty)  # the next round may come as a gradient to step these with
            elif not grad:
                _drop_arrays(chunk, empty)
        self.taken += 1
        return [(peer, self.channel, Message(Kind.MIRROR_ACK, sender=self.node_id, key=msg.key, chunk=msg.chunk,
                                               round=msg.round))]

    def _first(self, mirrored: Mirrored, chunk: Chunk, msg: Message) -> tuple[_Fields, int]:
        """The first piece's fields, checked against the chunk's round and size; the whole state's size."""
        fields = _fields(msg, chunk)
        bits, _, optimizer, version, with_bcast, grad = fields
        # the next round (a state MIRROR: up to ps.mirror_every later), or this one again (a restarted primary
        # mirrors what it restored; a restarted holder gets again what it may have written but not acknowledged);
        # any round for a restored primary's state (meta `again`): one that took over from another holder's copy
        # may be behind this one, and redoes those rounds from the workers' replays
        again = (msg.meta or {}).get("again") is True and not grad
        if not again and (not chunk.round <= msg.round <= chunk.round + (1 if grad else self.every)
                          or version < chunk.bcast_version):
            raise WireError(f"a MIRROR of round {msg.round} (broadcast {version}) for server {mirrored.rank}'s "
                            f"{chunk.describe()}, which is at round {chunk.round} (broadcast {chunk.bcast_version})")
        if version != chunk.bcast_version and not with_bcast:
            raise WireError(f"a MIRROR of broadcast {version} for {chunk.describe()} lacks its buffer (the holder "
                            f"has broadcast {chunk.bcast_version})")
        if not grad:
            return fields, payload_bytes(chunk.value.size, chunk.dtype, bits, with_bcast)
        code = optimizer[0] if optimizer is not None else optim.optimizer_code(chunk.optimizer)
        if with_bcast or version != chunk.bcast_version or code == 0:
            raise WireError(f"a gradient MIRROR for {chunk.describe()} must name an optimizer and no new broadcast")
        if msg.round > chunk.round and chunk.value is mirrored.empty[(chunk.key, chunk.chunk)]:
            raise WireError(f"a gradient MIRROR of round {msg.round} for server {mirrored.rank}'s {chunk.describe()}, "
                            "of which this holder keeps no state to step (its state MIRROR did not come first)")
        return fields, chunk.value.size * compute_dtype(chunk.dtype).itemsize

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
    grad = meta.get("grad")
    if type(with_bcast) is not bool or type(grad) is not bool:
        raise WireError(f"a MIRROR's meta bcast and grad must be bools, got {brief(with_bcast)} and {brief(grad)}")
    if (type(opt) is not list or len(opt) != 1 + optim.SETTINGS_COUNT or type(opt[0]) is not int
            or not all(type(v) is float for v in opt[1:])):
        raise WireError(f"a MIRROR's meta opt must be [code, {optim.SETTINGS_COUNT} floats], got {brief(opt)}")
    settings = tuple(opt[1:])
    if opt[0] == optim.optimizer_code(chunk.optimizer) and settings == optim.optimizer_settings(chunk.optimizer):
        return bits, t, None, version, with_bcast, grad  # the settings it has: nothing to rebuild
    try:
        rebuilt = optim.from_settings(opt[0], settings)
    except (ValueError, TypeError, ArithmeticError) as exc:
        raise WireError(f"a MIRROR's optimizer settings are not valid: {exc}") from None
    if rebuilt is not None and chunk.dtype not in FLOAT_DTYPES:
        raise WireError(f"a MIRROR gives {chunk.describe()} ({chunk.dtype}) an optimizer")
    return bits, t, (opt[0], settings), version, with_bcast, grad


def _step(chunk: Chunk, payload: np.ndarray, bits: int, t: int, empty: np.ndarray) -> None:
    """`chunk`'s optimizer stepped with the gradient `payload` holds, as the primary did; WireError (and its
    state dropped: no gradient can follow it) if the state does not come out as the primary's meta says."""
    step_chunk(chunk, payload.view(compute_dtype(chunk.dtype)).copy())  # a copy: the step may write into it
    got, step = optim.state_bits(chunk.opt_state), int(chunk.opt_state.get("t", 0))
    if (got, step) != (bits, t):
        _drop_arrays(chunk, empty)
        raise WireError(f"stepping {chunk.describe()} with its mirrored gradient gave optimizer state {got} (step "
                        f"{step}) where the primary has {bits} (step {t}): this holder's copy diverged and takes only "
                        "a state MIRROR now")


def _keep(chunk: Chunk, empty: np.ndarray) -> None:
    """Own copies of the arrays a state MIRROR pointed `chunk` at, to step with the gradients that follow."""
    chunk.value = np.array(chunk.value)
    chunk.opt_state = {name: np.array(v) if isinstance(v, np.ndarray) else v for name, v in chunk.opt_state.items()}
    if chunk.bcast is not None:  # only its presence counts until a newer broadcast brings its buffer
        chunk.bcast = empty


def _drop_arrays(chunk: Chunk, empty: np.ndarray) -> None:
    """The file has the state: keep only each array's length and dtype (`empty`, no memory), not the message's
    buffer."""
    chunk.value = empty
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
