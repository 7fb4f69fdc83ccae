"""Pushes an aggregator holds across a switch of trees inside a round, until the round before theirs is answered.

A switch of aggregation trees (scheduler/hierarchy/switch.py) may move a worker from below the server
to below this aggregator from one round of a chunk to the next. That worker then has the server's
reply of round r at the same time as this aggregator, over another connection, and its push of round
r + 1 may reach this aggregator before the reply of round r does. Refused, that push would never come
again and round r + 1 would never complete; so a push of the round after the one forwarded and not yet
answered, from ranks that were not in it, is kept (copied: the transport reuses the buffer) and taken
once that reply is in. Each rank is held once per chunk, so a chunk holds at most one push per worker.
"""

from __future__ import annotations

from sluice.transport.wire import Flag, Message, keep_payload

#: a held push: the peer and channel it came on, the push, the ranks it covers
HeldPush = tuple[str, int, Message, tuple[int, ...]]


class Held:
    """The pushes held at each chunk, oldest first, each with the peer, channel and ranks it came with."""

    def __init__(self) -> None:
        self._pushes: dict[tuple[int, int], list[HeldPush]] = {}

    def __bool__(self) -> bool:
        return bool(self._pushes)

    def admits(self, at: tuple[int, int], forwarded_round: int | None, pushed: set[int], msg: Message,
               ranks: tuple[int, ...]) -> bool:
        """Whether `msg`, covering `ranks`, is a first push of the round after `forwarded_round` (the round at
        `at` forwarded and not answered, of ranks `pushed`; None: none) from ranks outside it, not held yet."""
        return (forwarded_round is not None and msg.round == forwarded_round + 1 and pushed.isdisjoint(ranks)
                and not msg.flags & (Flag.RESEND | Flag.REPLAY)
                and all(set(ranks).isdisjoint(held[3]) for held in self._pushes.get(at, ())))

    def hold(self, at: tuple[int, int], peer: str, channel: int, msg: Message, ranks: tuple[int, ...]) -> None:
        self._pushes.setdefault(at, []).append((peer, channel, keep_payload(msg), ranks))

    def due(self, at: tuple[int, int], round_in_progress: int | None) -> list[HeldPush]:
        """The pushes held at `at` once the round they wait for is no longer in progress (forgotten here)."""
        held = self._pushes.get(at)
        if not held or round_in_progress == held[0][2].round - 1:
            return []
        del self._pushes[at]
        return held
