"""A server's committed chunks in a file in /dev/shm (ps.recover), so a replacement starts where it died.

One file per server, `sluice-state-<tag>-server-<R>`, holds every declaration's chunks: one name to
lock and to clean up, and no declaration number needed to find a chunk. It grows by one extent per
PLAN (ftruncate, then a mapping of just the new extent, since mmap.resize refuses while numpy views
of the old mapping exist); each extent lists its chunks and is linked into the file last, so a server
killed while adding one leaves it unreachable. Per chunk: an 8-byte stamp `round << 1 | slot`, two
slots (metadata, value and optimizer state arrays) and two broadcast buffers. A commit copies into
the slot the stamp does not name, then stores the stamp with one aligned 8-byte store: a server
killed mid-commit leaves the previous round. Parts are reserved with posix_fallocate before use, so a
full /dev/shm is an error that says so instead of a SIGBUS.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import re
import stat
import struct
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from sluice.errors import SluiceError
from sluice.ps import optim
from sluice.ps.ranked_sum import FLOAT_DTYPES
from sluice.scheduler.bootstrap import state_tag as state_tag  # where the ps layer has always found it
from sluice.transport.dtypes import STORAGE
from sluice.transport.shm_space import reserve

if TYPE_CHECKING:
    from sluice.ps.store import Chunk

STATE_DIR = "/dev/shm"
_MAGIC, _VERSION, _EXTENT_MAGIC = b"SLUICEST", 1, b"SLUICEXT"
_HEADER = struct.Struct("<8sII16sQ")  # magic, version, rank, tag, first extent (at byte 32)
_EXTENT = struct.Struct("<8sIIQQ")  # magic, chunks, 0, next extent (at byte 16), size
_ENTRY = struct.Struct("<IIQ16sB7xQQ")  # key, chunk, length, dtype, declared optimizer, record at, record size
_META = struct.Struct("<BBBBBxxxqq5d")  # valid, state bits, optimizer, has bcast, bcast buffer, version, t, settings
_LINE, _PAGE = 64, mmap.ALLOCATIONGRANULARITY
_TAG = re.compile(r"[0-9a-f]{16}")
_OPEN_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
_OPTIMIZERS = ("no optimizer", "sgd", "adam")


def state_path(tag: str, server_rank: int, directory: str = STATE_DIR, held_by: int = -1) -> str:
    """The server's own file; with `held_by` >= 0 its copy kept by that server on another host (ps.replicas,
    ps/mirror.py: named by both ranks, as two holders of one server on hosts sharing a /dev/shm must not meet)."""
    if not _TAG.fullmatch(tag):
        raise ValueError(f"a state tag is 16 hex digits, got {tag[:40]!r}")
    name = f"server-{server_rank}" if held_by < 0 else f"mirror-{server_rank}-by-{held_by}"
    return os.path.join(directory, f"sluice-state-{tag}-{name}")


def remove_state_files(tag: str, directory: str = STATE_DIR) -> int:
    """Remove the job's state files (its end, or the janitor's clean-up), a local group's store left by a killed
    worker among them (worker/local_group.py); how many were removed."""
    state_path(tag, 0, directory)  # checks the tag
    pattern = re.compile(rf"sluice-state-{tag}-(server-\d+|mirror-\d+-by-\d+|local-\d+-\d+)")
    removed = 0
    for name in os.listdir(directory):
        if pattern.fullmatch(name):
            try:
                os.unlink(os.path.join(directory, name))
                removed += 1
            except FileNotFoundError:  # another clean-up got there first
                pass
    return removed


def _up(n: int, to: int) -> int:
    return -(-n // to) * to


class _Record:
    """One chunk's place in an extent: views of its stamp, slots and broadcast buffers (nothing is touched)."""

    def __init__(self, area: mmap.mmap, at: int, extent: int, length: int, dtype: str, declared: int) -> None:
        self.area, self.length, self.dtype, self.declared = area, length, dtype, declared
        storage = np.dtype(STORAGE[dtype])
        compute = np.dtype(np.float32) if dtype == "bfloat16" else storage
        self.stamp = np.frombuffer(area, np.uint64, 1, at)
        self.meta_at = (at + _LINE, at + 2 * _LINE)
        #: part -> (file offset, bytes), for posix_fallocate
        self.places: dict[tuple[str, int, int], tuple[int, int]] = {("head", 0, 0): (extent + at, 3 * _LINE)}
        self.ready: set[tuple[str, int, int]] = set()
        end = at + 3 * _LINE

        def place(part: tuple[str, int, int], dt: np.dtype) -> np.ndarray:
            nonlocal end
            self.places[part] = (extent + end, length * dt.itemsize)
            view = np.frombuffer(area, dt, length, end)
            end += _up(length * dt.itemsize, _LINE)
            return view

        self.values = [place(("value", slot, 0), storage) for slot in (0, 1)]
        arrays = range(len(optim.STATE_ARRAYS)) if dtype in FLOAT_DTYPES else range(0)
        self.states = [[place(("state", slot, i), compute) for i in arrays] for slot in (0, 1)]
        self.bcasts = [place(("bcast", buf, 0), storage) for buf in (0, 1)]
        self.size = end - at
        #: (version, buffer) of the broadcast the stamped slot holds
        self.bcast: tuple[int, int] | None = None
        self.settings: tuple[optim.Optimizer | None, tuple[float, ...]] = (None, optim.optimizer_settings(None))

    def base_parts(self, optimizer: optim.Optimizer | None) -> list[tuple[str, int, int]]:
        """What every commit writes: the head, both values, and the state arrays `optimizer` (declared) makes."""
        bits = optim.declared_state_bits(optimizer) if self.states[0] else 0
        states = [("state", slot, i) for slot in (0, 1) for i in range(len(optim.STATE_ARRAYS)) if bits >> i & 1]
        return [("head", 0, 0), ("value", 0, 0), ("value", 1, 0), *states]


def _record_size(length: int, dtype: str) -> int:
    storage = np.dtype(STORAGE[dtype]).itemsize
    compute = 4 if dtype == "bfloat16" else storage
    states = len(optim.STATE_ARRAYS) if dtype in FLOAT_DTYPES else 0
    return 3 * _LINE + 4 * _up(length * storage, _LINE) + 2 * states * _up(length * compute, _LINE)


class StateFile:
    """A server's state file, locked for its whole life (the kernel drops the lock when it dies)."""

    def __init__(self, fd: int, path: str, tag: str, rank: int) -> None:
        self._fd, self.path, self.tag, self.rank = fd, path, tag, rank
        self._maps: list[mmap.mmap] = []
        self._records: dict[tuple[int, int], _Record] = {}
        size = os.fstat(fd).st_size
        self._reserve_range(0, _PAGE)
        self._head = mmap.mmap(fd, _PAGE)
        self._tail = np.frombuffer(self._head, np.uint64, 1, 32)
        #: why the file holds no earlier state, in words (None: it does)
        self.problem: str | None = "it did not exist" if size == 0 else None
        if size:
            magic, version, rank_, tag_, _ = _HEADER.unpack_from(self._head)
            if (magic, version, rank_, tag_) != (_MAGIC, _VERSION, rank, tag.encode()):
                self.problem = "held no state of this format"
            else:
                try:
                    self._load(size)
                except ValueError as exc:
                    self.problem = f"is damaged ({exc})"
        if self.problem is not None:
            self.reset()

    @classmethod
    def open(cls, tag: str, server_rank: int, directory: str = STATE_DIR, lock_timeout: float = 5.0,
             held_by: int = -1) -> StateFile:
        """Create or open server `server_rank`'s file (or mirror), safely, and lock it; SluiceError if a live
        process holds it."""
        path = state_path(tag, server_rank, directory, held_by)
        try:
            fd = os.open(path, _OPEN_FLAGS, 0o600)
        except OSError as exc:
            raise SluiceError(f"cannot open server {server_rank}'s state file {path}: {exc.strerror} "
                              "(a link or another user's file there is refused: remove it)") from None
        try:
            found = os.fstat(fd)
            if not stat.S_ISREG(found.st_mode) or found.st_uid != os.geteuid() or found.st_nlink != 1:
                raise SluiceError(f"server {server_rank}'s state file {path} is not a regular file of this user with "
                                  "one link: remove it and start again")
            if stat.S_IMODE(found.st_mode) != 0o600:
                os.fchmod(fd, 0o600)
            _lock(fd, path, server_rank, time.monotonic() + lock_timeout)
            if not _names(path, found):
                raise SluiceError(f"server {server_rank}'s state file {path} was removed or replaced while it was "
                                  "being opened (did the job end?)")
            return cls(fd, path, tag, server_rank)
        except BaseException:
            os.close(fd)
            raise

    @property
    def holds_state(self) -> bool:
        return bool(self._records)

    def reset(self) -> None:
        """Forget everything (a fresh job): just the header, no chunks."""
        self._drop_maps()
        os.ftruncate(self._fd, _PAGE)
        _HEADER.pack_into(self._head, 0, _MAGIC, _VERSION, self.rank, self.tag.encode(), 0)
        self._tail = np.frombuffer(self._head, np.uint64, 1, 32)

    def add(self, chunks: Iterable[Chunk]) -> None:
        """Make room for the chunks the file does not hold yet, in one new extent linked in last."""
        new = [c for c in chunks if (c.key, c.chunk) not in self._records]
        if not new:
            return
        first = _LINE * (1 + len(new))
        sizes = [_record_size(c.value.size, c.dtype) for c in new]
        size = _up(first + sum(sizes), _PAGE)
        offset = _up(os.fstat(self._fd).st_size, _PAGE)
        os.ftruncate(self._fd, offset + size)  # a hole: tmpfs allocates nothing until reserved
        self._reserve_range(offset, first)
        area = mmap.mmap(self._fd, size, offset=offset)
        self._maps.append(area)
        _EXTENT.pack_into(area, 0, _EXTENT_MAGIC, len(new), 0, 0, size)
        records, at = [], first
        for i, (chunk, record_size) in enumerate(zip(new, sizes, strict=True)):
            declared = optim.optimizer_code(chunk.optimizer)
            record = _Record(area, at, offset, chunk.value.size, chunk.dtype, declared)
            self._reserve(record, record.base_parts(chunk.optimizer))
            _ENTRY.pack_into(area, _LINE * (1 + i), chunk.key, chunk.chunk, chunk.value.size, chunk.dtype.encode(),
                             declared, at, record_size)
            records.append(((chunk.key, chunk.chunk), record))
            at += record_size
        self._tail[0] = offset  # the link, last: an extent is reachable only once it is complete
        self._tail = np.frombuffer(area, np.uint64, 1, 16)
        self._records.update(records)

    def restore(self, chunk: Chunk) -> bool:
        """Set `chunk` to its last committed round (round, value, optimizer and its state, broadcast); False
        when the file holds nothing for it (a fresh job, or a chunk never committed)."""
        record = self._records.get((chunk.key, chunk.chunk))
        if record is None:
            return False
        declared = optim.optimizer_code(chunk.optimizer)
        if (record.length, record.dtype, record.declared) != (chunk.value.size, chunk.dtype, declared):
            raise SluiceError(
                f"server {self.rank}'s state file {self.path} holds key {chunk.key} chunk {chunk.chunk} as "
                f"{record.dtype}[{record.length}] with {_OPTIMIZERS[record.declared]}, but the plan declares "
                f"{chunk.dtype}[{chunk.value.size}] with {_OPTIMIZERS[declared]}: it is another job's (one with the "
                f"same secret); remove {self.path} and start the job again"
            )
        self._reserve(record, record.base_parts(chunk.optimizer))  # a replacement commits into the same parts
        stamp = int(record.stamp[0])
        slot = stamp & 1
        valid, bits, code, has_bcast, buf, version, t, *settings = _META.unpack_from(record.area, record.meta_at[slot])
        if not valid:
            return False
        chunk.round = stamp >> 1
        np.copyto(chunk.value, record.values[slot])
        chunk.opt_state = optim.load_state(bits, record.states[slot], t)
        chunk.optimizer = optim.from_settings(code, settings)
        chunk.bcast = record.bcasts[buf].copy() if has_bcast else None
        chunk.bcast_version = version
        record.bcast = (version, buf) if has_bcast else None
        return True

    def commit(self, chunk: Chunk) -> None:
        """Copy `chunk`'s round into the slot the stamp does not name, then stamp it: the commit point."""
        record = self._records[(chunk.key, chunk.chunk)]
        slot = 1 - (int(record.stamp[0]) & 1)
        np.copyto(record.values[slot], chunk.value, casting="no")
        state, bits = chunk.opt_state, 0
        if state:
            bits = optim.state_bits(state)
            for i, name in enumerate(optim.STATE_ARRAYS):
                if bits >> i & 1:
                    if ("state", slot, i) not in record.ready:  # an optimizer the plan did not declare
                        self._reserve(record, [("state", slot, i)])
                    np.copyto(record.states[slot][i], state[name], casting="no")
        has_bcast = buf = 0
        if chunk.bcast is not None:
            has_bcast = 1
            if record.bcast is not None and record.bcast[0] == chunk.bcast_version:
                buf = record.bcast[1]
            else:  # a new broadcast: into the buffer the stamped slot does not use
                buf = 0 if record.bcast is None else 1 - record.bcast[1]
                self._reserve(record, [("bcast", buf, 0)])
                np.copyto(record.bcasts[buf], chunk.bcast, casting="no")
        if record.settings[0] is not chunk.optimizer:
            record.settings = (chunk.optimizer, optim.optimizer_settings(chunk.optimizer))
        _META.pack_into(record.area, record.meta_at[slot], 1, bits, optim.optimizer_code(chunk.optimizer), has_bcast,
                        buf, chunk.bcast_version, state.get("t", 0), *record.settings[1])
        record.stamp[0] = chunk.round << 1 | slot  # one aligned 8-byte store: the commit point
        record.bcast = (chunk.bcast_version, buf) if has_bcast else None

    def close(self, remove: bool = False) -> None:
        """Unlock (and with `remove`, delete: the job ended cleanly, nothing is left to recover)."""
        if self._fd < 0:
            return
        if remove:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        self._drop_maps()
        del self._tail
        _close_map(self._head)
        fcntl.flock(self._fd, fcntl.LOCK_UN)  # the mappings hold duplicates of the descriptor: unlock explicitly
        os.close(self._fd)
        self._fd = -1

    # ------------------------------------------------------------------ internals
    def _load(self, size: int) -> None:
        offset, low, tail = int(self._tail[0]), _PAGE, self._tail
        while offset:
            if offset % _PAGE or offset < low or offset + _PAGE > size:
                raise ValueError(f"an extent at byte {offset} is out of place")
            magic, count, _, after, extent = _EXTENT.unpack(os.pread(self._fd, _EXTENT.size, offset))
            if magic != _EXTENT_MAGIC or extent % _PAGE or offset + extent > size or _LINE * (1 + count) > extent:
                raise ValueError(f"the extent at byte {offset} is malformed")
            area = mmap.mmap(self._fd, extent, offset=offset)
            self._maps.append(area)
            for i in range(count):
                key, chunk, length, name, declared, at, record_size = _ENTRY.unpack_from(area, _LINE * (1 + i))
                dtype = name.rstrip(b"\0").decode("ascii", "replace")
                if (dtype not in STORAGE or declared >= len(_OPTIMIZERS) or at % _LINE or at < _LINE * (1 + count)
                        or at + record_size > extent or record_size != _record_size(length, dtype)):
                    raise ValueError(f"entry {i} of the extent at byte {offset} is malformed")
                self._records.setdefault((key, chunk), _Record(area, at, offset, length, dtype, declared))
            tail = np.frombuffer(area, np.uint64, 1, 16)
            low, offset = offset + extent, after
        self._tail = tail

    def _reserve(self, record: _Record, parts: Iterable[tuple[str, int, int]]) -> None:
        for part in parts:
            if part not in record.ready:
                self._reserve_range(*record.places[part])
                record.ready.add(part)

    def _reserve_range(self, offset: int, nbytes: int) -> None:
        reserve(self._fd, offset, nbytes, f"server {self.rank}'s state for ps.recover ({self.path})",
                os.path.dirname(self.path), alternative=", or turn ps.recover off")

    def _drop_maps(self) -> None:
        self._records.clear()
        self._tail = np.frombuffer(self._head, np.uint64, 1, 32)
        for area in self._maps:
            _close_map(area)
        self._maps.clear()


def _close_map(area: mmap.mmap) -> None:
    with contextlib.suppress(BufferError):  # a view still exists somewhere: the mapping goes when it does
        area.close()


def _names(path: str, found: os.stat_result) -> bool:
    """Whether `path` still names the file `found` describes (a clean-up may remove it while we wait)."""
    try:
        now = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (found.st_dev, found.st_ino)


def _lock(fd: int, path: str, rank: int, deadline: float) -> None:
    """flock the file, retrying until `deadline`: a server that just died may not have been reaped yet."""
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise SluiceError(
                    f"server {rank} is still running (its state file {path} is locked): not replacing a live server"
                ) from None
            time.sleep(0.05)
