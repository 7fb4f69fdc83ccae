"""Direct lanes: a Unix SEQPACKET connection between two processes on one host, used by their own threads.

A message through the transport goes caller -> I/O thread -> ZeroMQ's thread -> socket -> ZeroMQ's thread
-> I/O thread -> caller: five thread wake-ups, each waiting for a core when processes outnumber cores (a
pipeline of 4 stages on 2 cores). A lane's sender writes the message into the socket itself, and its
receiver reads it in the thread that waits for it: one wake-up, no GIL hand-over, no credit messages (the
kernel's socket buffer is the credit). A full socket never blocks the sender: messages wait in a queue,
most urgent first, and go whenever its owner next sends or waits (`flush`), so two neighbours sending
to each other cannot deadlock.

Set-up: one side listens on a random abstract-namespace name and tells the other, through the
(authenticated) transport, the name and a random secret; the other connects and sends the secret
first. The listener takes only a connection whose peer runs as our user (SO_PEERCRED) and whose first
datagram is the secret. Every datagram after it is one wire message (4-byte header length, 1-byte
frame count, header, zero bytes up to a multiple of 16, payload) that `wire.decode` checks like any
other; anything else is refused. Each datagram is read into memory of its own, so a received payload
is the message's to keep: a stage's activation becomes its tensor without a copy (the padding keeps
it aligned for any dtype; after a header of more than KEPT_HEADER bytes the payload is copied out).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import os
import re
import secrets
import socket
import struct
import sys
from collections.abc import Iterator

import numpy as np

from sluice.transport.wire import DATA_HEADER_BYTES, Message, WireError, decode, encode

#: the largest payload of a lane message; `piece_bytes` says how much this host's socket buffers take
MAX_PIECE = 1 << 20
_WANTED_BUFFER = 4 << 20
_KERNEL_OVERHEAD = 32  # a datagram may be at most the socket's send buffer less this (af_unix.c)
_LENGTH = struct.Struct("<IB")  # header bytes, frames (1 or 2)
_ALIGN = 16  # the payload's offset in a datagram, and malloc's alignment: any dtype can view it in place
_PADDING = bytes(_ALIGN)
#: the largest datagram a lane takes; a larger one is refused
LARGEST = _LENGTH.size + DATA_HEADER_BYTES + _ALIGN + MAX_PIECE
#: a payload after a longer header is copied out, so that what a receiver keeps of a datagram is at most its
#: payload and this (a peer cannot make it hold 64 KiB headers behind one-byte payloads)
KEPT_HEADER = 1024
#: the flags of a peek at the next datagram's length, and the one that says it was cut, as plain ints (socket's
#: are enum flags, whose arithmetic costs more than the read on the per-message path)
_PEEK_LENGTH, _TRUNCATED = int(socket.MSG_PEEK | socket.MSG_TRUNC), int(socket.MSG_TRUNC)
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
NAME = re.compile(r"sluice-lane-[0-9a-f]{32}")
SECRET_HEX = 32
_CANDIDATES = 4  # connections held at once until they send the secret (the oldest goes first)
_ACCEPTS_PER_CALL = 16
AVAILABLE = sys.platform.startswith("linux")  # abstract Unix names and SO_PEERCRED


def _padding(header: int) -> int:
    """Zero bytes after a header of `header` bytes, so that the payload starts at a multiple of _ALIGN."""
    return -(_LENGTH.size + header) % _ALIGN


def _peer_uid(sock: socket.socket) -> int:
    uid: int = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))[1]
    return uid


@functools.cache
def piece_bytes() -> int:
    """The largest payload one lane message carries here: a datagram must fit in the sender's socket
    buffer, which an unprivileged process can raise only to net.core.wmem_max (208 KiB by default, so
    348 KiB of payload; up to MAX_PIECE where the limit is higher). Fewer, larger datagrams: one sendmsg
    and one wake-up of the receiver per piece (128 KiB activations in one piece rather than two of 64
    KiB: about 4% more samples/s, bench/pipeline.py at P=4, M=2)."""
    with _seqpacket() as probe:
        return _piece_of(probe)


def _piece_of(sock: socket.socket) -> int:
    room = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) - _KERNEL_OVERHEAD - _LENGTH.size - _ALIGN
    return max(4096, min(MAX_PIECE, (room - DATA_HEADER_BYTES) // 4096 * 4096))


def _seqpacket() -> socket.socket:
    return _buffered(socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC))


def _buffered(sock: socket.socket) -> socket.socket:
    """`sock` with buffers as large as the kernel allows (an accepted socket gets the defaults, not the
    listener's): fewer full-socket waits, and room for a whole piece in one datagram."""
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, _WANTED_BUFFER)
    return sock


class LaneListener:
    """Waits for the one connection that proves it knows `secret`; `name` and `secret` go to the peer."""

    def __init__(self) -> None:
        self.name = f"sluice-lane-{secrets.token_hex(16)}"
        self.secret = secrets.token_hex(SECRET_HEX // 2)
        self._sock = _seqpacket()
        self._sock.bind("\0" + self.name)
        self._sock.listen(4)
        self._candidates: list[socket.socket] = []
        #: connections refused (another user's, or a wrong secret)
        self.refused = 0

    def fileno(self) -> int:
        return self._sock.fileno()

    def candidates(self) -> list[socket.socket]:
        """Connections accepted that have not yet sent their secret (poll them for input)."""
        return self._candidates

    def accept(self) -> Lane | None:
        """The proven lane, once a connection sent the secret; never blocks."""
        for _ in range(_ACCEPTS_PER_CALL):
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                break
            if _peer_uid(conn) != os.getuid():
                self.refused += 1
                conn.close()
                continue
            if len(self._candidates) >= _CANDIDATES:  # connections that never say anything cannot crowd it out
                self.refused += 1
                self._candidates.pop(0).close()
            conn.setblocking(False)
            self._candidates.append(_buffered(conn))
        for conn in list(self._candidates):
            try:
                first = conn.recv(SECRET_HEX + 1)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                first = b""
            self._candidates.remove(conn)
            if first == self.secret.encode():
                self.close()
                return Lane(conn)
            self.refused += 1
            conn.close()
        return None

    def close(self) -> None:
        self._sock.close()
        for conn in self._candidates:
            conn.close()
        self._candidates.clear()


def offer_of(meta: object) -> tuple[str, str]:
    """The (name, secret) a lane offer's meta carries; ValueError saying why it is not one."""
    if type(meta) is not dict or set(meta) != {"lane", "secret"} or not all(type(v) is str for v in meta.values()):
        raise ValueError("a lane offer's meta must be {lane, secret} strings")
    if not NAME.fullmatch(meta["lane"]) or len(meta["secret"]) != SECRET_HEX:
        raise ValueError("a lane offer must name a sluice lane and a secret of 32 hex digits")
    return meta["lane"], meta["secret"]


def connect(name: str, secret: str) -> Lane | None:
    """A lane to the listener `name`, or None while its backlog is full; ConnectionRefusedError when
    nothing listens there (another network namespace's name), ValueError for a name or secret out of
    format, or a listener that runs as another user."""
    if not NAME.fullmatch(name) or len(secret) != SECRET_HEX or not all(c in "0123456789abcdef" for c in secret):
        raise ValueError(f"a lane offer names {name!r:.60} with a secret of {len(secret)} characters")
    sock = _seqpacket()
    try:
        sock.connect("\0" + name)
    except BlockingIOError:
        sock.close()
        return None
    except OSError:
        sock.close()
        raise
    if _peer_uid(sock) != os.getuid():
        sock.close()
        raise ValueError(f"lane {name} is held by another user's process")
    sock.send(secret.encode())
    return Lane(sock)


class Lane:
    """One connected lane: messages out (queued while the socket is full, most urgent first) and in."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._pending: list[tuple[int, int, list[bytes | memoryview]]] = []
        self._order = itertools.count()
        self._overflow = bytearray(LARGEST)  # a datagram larger than LARGEST is read into it: truncated, refused
        self._peek = bytearray(1)  # what a peek at the next datagram's length reads into
        #: the largest payload this lane's messages carry (its socket buffer's room)
        self.piece = _piece_of(sock)
        #: the peer closed its end (it exited): nothing more will come
        self.closed = False
        #: datagrams and their bytes sent and received (for the stage's log at the end)
        self.sent = [0, 0]
        self.received = [0, 0]

    def fileno(self) -> int:
        return self._sock.fileno()

    @property
    def pending(self) -> int:
        return len(self._pending)

    def send(self, msg: Message) -> None:
        """Queue `msg` (a payload of at most `piece_bytes()`, not in shared memory) and send what the
        socket takes now. The payload must not change until it has left (`pending` is 0)."""
        frames = encode(msg)
        if len(frames) > 1 and (size := memoryview(frames[1]).nbytes) > self.piece:
            raise ValueError(f"a lane message here carries at most {self.piece} bytes, got {size}")
        header = len(frames[0])
        datagram = [_LENGTH.pack(header, len(frames)), frames[0], _PADDING[:_padding(header)], *frames[1:]]
        heapq.heappush(self._pending, (msg.priority, next(self._order), datagram))
        self.flush()

    def flush(self) -> bool:
        """Send queued messages while the socket takes them; True when none is left."""
        while self._pending and not self.closed:
            try:
                self.sent[1] += self._sock.sendmsg(self._pending[0][2])
                self.sent[0] += 1
            except (BlockingIOError, InterruptedError):
                return False
            except (BrokenPipeError, ConnectionResetError):
                self.closed = True
                break
            heapq.heappop(self._pending)
        return not self._pending

    def receive(self, limit: int = 256) -> Iterator[Message | WireError]:
        """What arrived, without waiting, at most `limit` datagrams (a peer that keeps sending cannot hold
        the reader here): each decoded (a Message whose payload is its own, in memory read for it alone) or
        the WireError that refuses it."""
        for _ in range(limit):
            if self.closed:
                return
            try:  # the next datagram's length (MSG_TRUNC: its whole length, on Linux since 3.4), then all of it
                size = self._sock.recv_into(self._peek, 1, _PEEK_LENGTH)
                datagram = np.empty(size, np.uint8).data if size <= LARGEST else memoryview(self._overflow)
                size, _, flags, _ = self._sock.recvmsg_into([datagram])
            except (BlockingIOError, InterruptedError):
                return
            except (ConnectionResetError, OSError):
                size, flags = 0, 0
            if size == 0:
                self.closed = True
                return
            self.received[0] += 1
            self.received[1] += size
            yield self._parse(datagram, size, flags)

    def _parse(self, datagram: memoryview, size: int, flags: int) -> Message | WireError:
        if flags & _TRUNCATED:
            return WireError(f"a lane datagram is larger than {LARGEST} bytes")
        if size < _LENGTH.size:
            return WireError(f"a lane datagram of {size} bytes has no header length")
        header, count = _LENGTH.unpack_from(datagram)
        end = _LENGTH.size + header
        start = end + _padding(header)
        if not 0 < header <= DATA_HEADER_BYTES or start > size or count not in (1, 2) or (
                count == 1 and start < size):
            return WireError(f"a lane datagram of {size} bytes declares a {header}-byte header and {count} frames")
        payload = datagram[start:size] if start <= KEPT_HEADER else memoryview(bytes(datagram[start:size]))
        frames = [datagram[_LENGTH.size:end]] + ([payload] if count == 2 else [])
        try:
            msg = decode(frames)
        except WireError as exc:
            return exc
        if msg.shm is not None:
            return WireError("a lane message points into shared memory, which lanes do not use")
        return msg

    def close(self) -> None:
        self.closed = True
        self._sock.close()
