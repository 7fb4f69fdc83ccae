"""Two ZmqTransports' names, an inbox that collects what a handler is given, and test messages."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from sluice.transport.wire import Kind, Message
from sluice.transport.zmq_transport import ZmqTransport

SERVER, CLIENT = "server-t", "client-t"


@dataclass
class Received:
    peer: str
    channel: int
    kind: Kind
    key: int
    priority: int
    data: bytes | None
    flags: int = 0


class Inbox:
    """Collects what a transport's handler is given; the payload is copied out of the zero-copy view."""

    def __init__(self, delay: Callable[[str, int, Message], None] | None = None) -> None:
        self.items: list[Received] = []
        self._cond = threading.Condition()
        self._delay = delay

    def __call__(self, peer: str, channel: int, msg: Message) -> None:
        if self._delay is not None:
            self._delay(peer, channel, msg)
        data = None if msg.payload is None else bytes(msg.payload)
        with self._cond:
            self.items.append(Received(peer, channel, msg.kind, msg.key, msg.priority, data, msg.flags))
            self._cond.notify_all()

    def wait_for(self, count: int, timeout: float = 15.0) -> list[Received]:
        with self._cond:
            if not self._cond.wait_for(lambda: len(self.items) >= count, timeout):
                raise AssertionError(f"received {len(self.items)} of {count} messages within {timeout} s")
            return list(self.items)

    def snapshot(self) -> list[Received]:
        with self._cond:
            return list(self.items)


def message(key: int, channel_priority: int = 1, payload: np.ndarray | None = None) -> Message:
    if payload is None:
        return Message(Kind.PUSH, sender=1, key=key, priority=channel_priority)
    return Message(
        Kind.PUSH, sender=1, key=key, priority=channel_priority, dtype="uint8", shape=payload.shape, payload=payload
    )


def warm_up(sender: ZmqTransport, to: str, inbox: Inbox, channels: int, key: int = 1 << 30) -> None:
    """One message per channel, waited for: the connections are up and the receiver knows the sender."""
    before = len(inbox.snapshot())
    for channel in range(channels):
        sender.send(to, channel, message(key + channel))
    inbox.wait_for(before + channels)
