"""The coordinator tree's controllers in memory, for the negotiation tests: every message through the wire format."""

from __future__ import annotations

from sluice.transport.wire import DATA_HEADER_BYTES, decode, encode
from sluice.worker.collective.negotiation import Controller, Decision, Down, Request, Up
from sluice.worker.collective.negotiation_codec import decode_down, decode_up, encode_down, encode_up
from sluice.worker.collective.tree import build_tree

Sent = tuple[int, int, Up | Down]


def wire(message: Up | Down) -> tuple[Up | Down, int]:
    """`message` through the real wire format, and its size in bytes."""
    frames = [bytes(f) for f in encode(encode_up(message) if isinstance(message, Up) else encode_down(message))]
    assert len(frames[0]) < DATA_HEADER_BYTES
    back = decode(frames)
    return (decode_up(back) if isinstance(message, Up) else decode_down(back)), sum(map(len, frames))


class Net:
    """Every rank's Controller; a round: each rank (not skipped) takes its inbox, then ticks; what it sends
    lands in the receivers' inboxes (through the wire format) for the next round."""

    def __init__(self, n: int, arity: int, stall: float = 60.0, hosts: list[str] | None = None) -> None:
        self.tree = build_tree(hosts or ["h"] * n, arity)
        self.ctl = [Controller(r, self.tree, stall) for r in range(n)]
        self.inbox: list[list[tuple[int, Up | Down]]] = [[] for _ in range(n)]
        self.decided: list[list[Decision]] = [[] for _ in range(n)]
        self.now = 0.0
        self.taken_per_tick: list[list[int]] = [[] for _ in range(n)]  # messages taken in each tick
        self.bytes: list[int] = []

    def submit(self, rank: int, request: Request) -> None:
        self.ctl[rank].submit(request, self.now)

    def round(self, skip: frozenset[int] = frozenset(), dt: float = 0.001) -> list[Sent]:
        self.now += dt
        sent: list[Sent] = []
        for rank in range(len(self.ctl)):
            if rank in skip:
                continue
            box, self.inbox[rank] = self.inbox[rank], []
            self.taken_per_tick[rank].append(len(box))
            for source, message in box:
                self.take(rank, source, message)
            out, decisions = self.tick(rank)
            assert sum(isinstance(m, Up) for _, m in out) <= 1  # at most one message up per tick
            sent += [(rank, dest, m) for dest, m in out]
            self.decided[rank] += decisions
        for source, dest, message in sent:
            parsed, size = wire(message)
            assert parsed == message
            self.bytes.append(size)
            self.inbox[dest].append((source, parsed))
        return sent

    def take(self, rank: int, source: int, message: Up | Down) -> None:
        """Rank `rank` takes a message from `source` (a subclass may do more with it)."""
        self.ctl[rank].receive(source, message, self.now)

    def tick(self, rank: int) -> tuple[list[tuple[int, Up | Down]], list[Decision]]:
        """Rank `rank`'s tick: what it sends, and what it decided."""
        ctl = self.ctl[rank]
        return ctl.tick(self.now), ctl.take_decisions()

    def settle(self, rounds: int = 40) -> None:
        for _ in range(rounds):
            self.round()

    def wait(self, seconds: float) -> None:
        for _ in range(int(seconds / 0.25) + 1):
            self.round(dt=0.25)
        self.settle(20)

    def names(self, rank: int) -> list[str]:
        return [d.request.name for d in self.decided[rank]]

    def failures(self) -> set[str | None]:
        return {c.failure for c in self.ctl}

    def errors(self) -> set[tuple[str, str | None, int]]:
        """(name, error, position in the decision list) of every failed op, over every rank."""
        return {(d.request.name, d.error, at) for decided in self.decided for at, d in enumerate(decided)
                if d.error is not None}


def grad(i: int, columns: int = 3, priority: int = 0) -> Request:
    return Request(f"grad.{i}", "allreduce", "float32", ((4, columns),), priority=priority)


def brief(sent: list[Sent]) -> list[tuple[int, int, str, int, int, int]]:
    """(from, to, U/D, seq or ack, ready or decided bits, new ops or table entries) of each message."""
    return [(s, d, "U", m.seq, m.ready, len(m.new)) if isinstance(m, Up) else (s, d, "D", m.ack, m.decided,
                                                                                len(m.entries)) for s, d, m in sent]
