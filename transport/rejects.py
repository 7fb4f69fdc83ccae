"""Refused messages: counted, logged at a bounded rate, and strangers that keep sending them cut off.

A flood of malformed messages must cost little: one warning line per message (thousands a second)
slowed training threefold in an outside test. Here each kind of reason is logged once per interval
(the first occurrence, in full), everything else is counted, and a summary line per interval says
how many were suppressed and from whom. A peer that is not a member of the job and sends nothing but
garbage is banned: its messages are then dropped after reading their first frame, and the transport
shuts its connection.
"""

from __future__ import annotations

import functools
import logging
import re
from collections import Counter
from dataclasses import dataclass, field

#: log at most this many distinct reasons per interval; the rest only counts. A server refuses about 40 kinds in
#: tests/integration/test_hostile.py alone: with a cap of 40, one of them went unlogged in some runs
MAX_KINDS_PER_INTERVAL = 100
#: peers tracked at once (a flood of fresh identities evicts the oldest, it cannot grow memory)
_MAX_PEERS = 1024
_VARYING = re.compile(r"'[^']*'|\b[0-9a-f]{8}\b|\d+")


@functools.lru_cache(maxsize=4096)  # a flood repeats its reasons word for word: 0.3 us instead of 2.8
def reason_kind(reason: str) -> str:
    """What makes two reasons 'the same kind': the text with quoted names, hex tags and numbers
    blanked (they differ from peer to peer and message to message), first 160 characters."""
    return _VARYING.sub("#", reason)[:160]


@dataclass
class _Peer:
    rejected: int = 0
    accepted: int = 0


@dataclass
class Rejections:
    """One process's (or transport's) count of refused messages, with rate-limited logging."""

    logger: logging.Logger
    interval: float = 10.0
    #: a stranger is banned after this many refused messages while having sent almost nothing valid
    ban_after: int = 100
    total: int = 0
    banned_drops: int = 0
    _peers: dict[str, _Peer] = field(default_factory=dict)
    _banned: dict[str, None] = field(default_factory=dict)  # ordered: the oldest ban is evicted first
    _logged: set[str] = field(default_factory=set)
    _suppressed: Counter[str] = field(default_factory=Counter)
    _window_start: float | None = None

    def refuse(self, peer: str, text: str, now: float, member: bool = True, exc_info: bool = False,
               delivered: bool = False) -> bool:
        """Count one refused message from `peer`; log it unless its kind was logged this interval.
        `delivered`: the handler refused a message the transport had passed (and counted as accepted).

        Returns True when this refusal gets `peer` banned (never a member of the job)."""
        self.total += 1
        self._roll(now)
        record = self._peer(peer)
        record.rejected += 1
        if delivered:
            record.accepted -= 1
        kind = reason_kind(text)
        if kind not in self._logged and len(self._logged) < MAX_KINDS_PER_INTERVAL:
            self._logged.add(kind)
            self.logger.warning("%s", text, exc_info=exc_info)
        else:
            self._suppressed[peer] += 1
        if member or peer in self._banned:
            return False
        if record.rejected >= self.ban_after and record.rejected > 10 * record.accepted:
            if len(self._banned) >= _MAX_PEERS:
                del self._banned[next(iter(self._banned))]
            self._banned[peer] = None
            self.logger.warning("%r sent %d malformed or forged messages and little else: its messages are "
                                "dropped from now on", peer, record.rejected)
            return True
        return False

    def accept(self, peer: str) -> None:
        """A message from `peer` that passed the transport's checks."""
        self._peer(peer).accepted += 1

    def banned(self, peer: str) -> bool:
        return peer in self._banned

    def drop_banned(self, now: float) -> None:
        self.banned_drops += 1
        self.total += 1
        self._roll(now)

    def tick(self, now: float) -> None:
        """Write the summary of an interval that is over (call it now and then)."""
        self._roll(now)

    def _peer(self, name: str) -> _Peer:
        record = self._peers.get(name)
        if record is None:
            if len(self._peers) >= _MAX_PEERS:
                del self._peers[next(iter(self._peers))]
            record = self._peers[name] = _Peer()
        return record

    def _roll(self, now: float) -> None:
        if self._window_start is None:
            self._window_start = now
            return
        if now - self._window_start < self.interval:
            return
        suppressed = sum(self._suppressed.values())
        if suppressed:
            top = ", ".join(f"{peer!r}: {n}" for peer, n in self._suppressed.most_common(3))
            self.logger.warning("%d more messages refused in the last %.0f s (most from %s; %d from banned peers "
                                "in all)", suppressed, now - self._window_start, top, self.banned_drops)
        self._suppressed.clear()
        self._logged.clear()
        self._window_start = now
