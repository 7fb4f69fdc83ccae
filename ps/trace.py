"""A server's timeline: SUM, from the first push of a tensor's round arriving to the last of its chunks here summed."""

from __future__ import annotations

import os
from typing import Any

from sluice.transport.timeline import Timeline, now_us
from sluice.transport.wire import Message

#: rounds followed at once (a hostile or lost worker must not grow this without bound)
MAX_ROUNDS = 1 << 16


class ServerTrace:
    def __init__(self, path: str, role: str, rank: int, chunks: dict[tuple[int, int], Any]) -> None:
        self.timeline = Timeline(path, f"{role} {rank}", os.getpid())
        self._chunks = chunks  # the store's (key, chunk) -> Chunk: which chunks of a tensor live here
        self._owned: dict[int, int] = {}
        #: (key, chunk) -> the last round of it whose sum this trace saw complete
        self._summed: dict[tuple[int, int], int] = {}
        #: (key, round) -> [first push arrived (us), chunks summed, priority, channel]
        self._rounds: dict[tuple[int, int], list[Any]] = {}

    def pushed(self, msg: Message, channel: int) -> None:
        """The store took a push. Whether its chunk's round is complete is read from the store's chunk, not from
        the replies: a round of pushes without WANT_REPLY completes as one whose results a later pull takes."""
        where = (msg.key, msg.chunk)
        chunk = self._chunks.get(where)
        if chunk is None or self._summed.get(where, 0) >= msg.round:  # a round already traced (a push sent again)
            return
        key = (msg.key, msg.round)
        entry = self._rounds.get(key)
        if entry is None:
            if len(self._rounds) >= MAX_ROUNDS:
                return
            entry = self._rounds[key] = [now_us(), set(), msg.priority, channel]
        if chunk.round < msg.round:  # others of this round are still to come
            return
        self._summed[where] = msg.round
        entry[1].add(msg.chunk)
        owned = self._owned.get(msg.key)
        if owned is None:
            owned = self._owned[msg.key] = sum(1 for k, _ in self._chunks if k == msg.key)
        if len(entry[1]) >= owned:
            del self._rounds[key]
            self.timeline.span("SUM", chunk.name, entry[0], now_us(),
                               {"step": msg.round, "priority": entry[2], "channel": entry[3], "chunks": owned})

    def close(self) -> None:
        self.timeline.close()
