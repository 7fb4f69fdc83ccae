"""A server's timeline: SUM, from the first push of a tensor's round arriving to the replies of all its chunks here."""

from __future__ import annotations

import os
from typing import Any

from sluice.transport.timeline import Timeline, now_us
from sluice.transport.wire import Kind, Message

#: rounds followed at once (a hostile or lost worker must not grow this without bound)
MAX_ROUNDS = 1 << 16


class ServerTrace:
    def __init__(self, path: str, role: str, rank: int, chunks: dict[tuple[int, int], Any]) -> None:
        self.timeline = Timeline(path, f"{role} {rank}", os.getpid())
        self._chunks = chunks  # the store's (key, chunk) -> Chunk: which chunks of a tensor live here
        self._owned: dict[int, int] = {}
        #: (key, round) -> [first push arrived (us), chunks replied, priority, channel]
        self._rounds: dict[tuple[int, int], list[Any]] = {}

    def pushed(self, msg: Message, channel: int, replies: list[tuple[str, int, Message]]) -> None:
        """A push was taken and answered with `replies` (the round's results, once its sum is complete)."""
        key = (msg.key, msg.round)
        entry = self._rounds.get(key)
        if entry is None:
            if len(self._rounds) >= MAX_ROUNDS:
                return
            entry = self._rounds[key] = [now_us(), set(), msg.priority, channel]
        entry[1].update(reply.chunk for _, _, reply in replies if reply.kind == Kind.REPLY)
        owned = self._owned.get(msg.key)
        if owned is None:
            owned = self._owned[msg.key] = sum(1 for k, _ in self._chunks if k == msg.key)
        if len(entry[1]) >= owned:
            del self._rounds[key]
            chunk = self._chunks.get((msg.key, msg.chunk))
            name = chunk.name if chunk is not None else f"key {msg.key}"
            self.timeline.span("SUM", name, entry[0], now_us(),
                               {"step": msg.round, "priority": entry[2], "channel": entry[3], "chunks": owned})

    def close(self) -> None:
        self.timeline.close()
