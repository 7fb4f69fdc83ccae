"""Messages for a receiver that does not exist yet (a peer connected sooner), kept until it attaches."""

from __future__ import annotations

import threading
from collections.abc import Callable

from sluice.transport.wire import Message, keep_payload

Receiver = Callable[[str, Message], None]


class Mailbox:
    """`deliver` hands a message to the attached receiver, or keeps it (payload copied: the view is only
    valid during the transport's handler call) until `attach`, which replays what was kept, in order.
    At most `limit` messages and `limit_bytes` of payload are kept; more are passed to `refuse`."""

    def __init__(self, limit: int, refuse: Callable[[str, str], None], limit_bytes: int = 1 << 30) -> None:
        self._limit, self._limit_bytes, self._refuse = limit, limit_bytes, refuse
        self._bytes = 0
        self._lock = threading.Lock()
        self._kept: list[tuple[str, Message]] = []
        self._target: Receiver | None = None

    def deliver(self, peer: str, msg: Message) -> None:
        target = self._target  # set once, after the replay: no lock once attached
        if target is not None:
            target(peer, msg)
            return
        with self._lock:
            if self._target is not None:
                self._target(peer, msg)
            elif len(self._kept) < self._limit and self._bytes + msg.nbytes <= self._limit_bytes:
                self._bytes += msg.nbytes
                self._kept.append((peer, keep_payload(msg)))
            else:
                self._refuse(peer, f"dropped {msg.kind.name} from {peer!r:.60}: {len(self._kept)} messages "
                                   f"({self._bytes} bytes) are already kept for a receiver that has not started")

    def attach(self, target: Receiver) -> None:
        with self._lock:
            for peer, msg in self._kept:
                target(peer, msg)
            self._kept.clear()
            self._bytes = 0
            self._target = target
