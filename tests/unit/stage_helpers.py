"""A transport stand-in for a stage's exchange that records what it is asked to send or refuse: `Recorder`."""

from __future__ import annotations

from sluice.transport.wire import Message


class Recorder:
    """What a transport is asked to do, kept (the exchange's only I/O)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, int, Message]] = []
        self.refused: list[str] = []

    def send(self, peer: str, channel: int, msg: Message) -> None:
        self.sent.append((peer, channel, msg))

    def refuse(self, peer: str, text: str) -> None:
        self.refused.append(text)
