"""Sealed messages: each frame encrypted and authenticated with AES-256-GCM, counters that refuse replays.

CURVE (XSalsa20-Poly1305 inside libzmq) costs about 2 CPU seconds a GB on this project's machines, each
byte encrypted and decrypted; AES-GCM through OpenSSL runs at about 3 GB/s a core each way where the CPU
has AES instructions (bench/curve_cost.py's zmq-pair cases measure both on the same sockets). This module
is the cipher of sealed connections (transport/zmq_seal.py: data connections between hosts, which do not
run CURVE themselves): one key per direction of one connection (`JobKeys.seal_key`: the job secret, both
members' names, the channel and the connection's session, so no two directions or connections share a
key), a 64-bit counter per key as the GCM nonce (never reused), and per message:

    frame 0:  counter (8 bytes, big-endian, in clear) | ciphertext of the first frame | tag (16 bytes)
    frame i:  ciphertext of frame i | tag

Frame i is sealed under counter + i with the associated data (counter, i, frame count), so frames cannot be
swapped, dropped or moved to another message. The opener takes a message only if its counter is above
every counter it has opened (a replay, or a message from before the last one, is refused), and moves
its mark only once every frame has been authenticated: garbage costs the receiver its decryption, never
its state.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from sluice.transport.wire import WireError, frame_view

KEY_BYTES = 32
TAG_BYTES = 16
_COUNTER = struct.Struct(">Q")
_NONCE = struct.Struct(">4xQ")  # 96 bits: 4 zero bytes, then the frame's counter
_BOUND = struct.Struct(">QBB")  # associated data: the message's counter, the frame's place, the frame count
MAX_FRAMES = 2  # a wire message has a header and at most one payload
LAST_COUNTER = (1 << 64) - 1 - MAX_FRAMES
#: bytes a sealed message carries beyond its frames'
OVERHEAD = _COUNTER.size + MAX_FRAMES * TAG_BYTES


class Sealer:
    """Seals the messages of one direction of one connection, in the order they are sent."""

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"a sealing key has {KEY_BYTES} bytes, got {len(key)}")
        self._aead = AESGCM(key)
        self._next = 1  # the opener's mark starts at 0: a first message of counter 0 could never be taken
        #: messages sealed
        self.sealed = 0

    def seal(self, frames: Sequence[Any]) -> list[memoryview]:
        """`frames` (1 or 2 buffers) encrypted into new buffers; the originals are not changed."""
        if not 1 <= len(frames) <= MAX_FRAMES:
            raise ValueError(f"a sealed message has 1 to {MAX_FRAMES} frames, got {len(frames)}")
        counter = self._next
        if counter > LAST_COUNTER:
            raise OverflowError("this key sealed 2^64 frames: the connection needs a new session")
        self._next += len(frames)
        sealed = []
        for place, frame in enumerate(frames):
            data = frame_view(frame).cast("B")
            skip = _COUNTER.size if place == 0 else 0
            out = np.empty(skip + data.nbytes + TAG_BYTES, np.uint8).data  # not zeroed: every byte is written
            if skip:
                _COUNTER.pack_into(out, 0, counter)
            self._aead.encrypt_into(_NONCE.pack(counter + place), data, _BOUND.pack(counter, place, len(frames)),
                                    out[skip:])
            sealed.append(out)
        self.sealed += 1
        return sealed


class Opener:
    """Opens the messages of one direction of one connection; refuses what is forged, altered or replayed."""

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"a sealing key has {KEY_BYTES} bytes, got {len(key)}")
        self._aead = AESGCM(key)
        self._mark = 0  # the highest counter opened so far
        #: messages opened
        self.opened = 0

    def open(self, frames: Sequence[Any]) -> list[memoryview]:
        """The plain frames of a sealed message, each in a new buffer; WireError for anything not sealed
        under this key, altered, out of format, or not newer than the last message opened."""
        if not 1 <= len(frames) <= MAX_FRAMES:
            raise WireError(f"a sealed message has 1 to {MAX_FRAMES} frames, got {len(frames)}")
        views = [frame_view(frame).cast("B") for frame in frames]
        if views[0].nbytes < _COUNTER.size + TAG_BYTES or any(v.nbytes < TAG_BYTES for v in views[1:]):
            raise WireError("a sealed frame is shorter than its counter and tag")
        counter = _COUNTER.unpack_from(views[0])[0]
        if counter <= self._mark or counter > LAST_COUNTER:
            raise WireError(f"a sealed message's counter {counter} is not above the last opened ({self._mark}): "
                            "a replay, or older than a message already taken")
        opened = []
        for place, view in enumerate(views):
            data = view[_COUNTER.size:] if place == 0 else view
            out = np.empty(data.nbytes - TAG_BYTES, np.uint8).data
            try:
                self._aead.decrypt_into(_NONCE.pack(counter + place), data, _BOUND.pack(counter, place, len(views)),
                                        out)
            except InvalidTag:
                raise WireError("a sealed frame failed authentication: not sealed under this connection's key, "
                                "or altered") from None
            opened.append(out)
        self._mark = counter + len(views) - 1
        self.opened += 1
        return opened
