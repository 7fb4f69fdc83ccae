"""The transport interface callers use; backends (ZeroMQ today, RDMA later) implement it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import numpy as np

from sluice.transport.auth import JobKeys
from sluice.transport.config import TransportConfig
from sluice.transport.wire import Message

#: called on the transport's I/O thread for every valid message: (peer name, channel, message).
#: It must not block, and must be done with the payload when it returns: the payload is a zero-copy
#: view (of a received frame, or of the sender's shared memory, which the sender reuses once acked).
Handler = Callable[[str, int, Message], None]


class Transport(Protocol):
    name: str
    config: TransportConfig
    #: called (message, queued at, sent at; monotonic seconds) as each message goes to its socket
    tracer: Callable[[Message, float, float], None] | None

    def listen(self, port: int = 0) -> list[str]:
        """Bind one endpoint per channel on the configured host; return their addresses.

        `port` 0: ports the OS picks. Otherwise channel c binds `port + c`, an address others can be
        told in advance (the scheduler's, on Kubernetes); one already taken raises OSError naming it."""
        ...

    def connect(self, peer: str, endpoints: Sequence[str], control: bool = False, tos: int | None = None) -> None:
        """Open one channel per endpoint to `peer`; with fewer endpoints, higher channels use the last.

        `control`: the peer is the control plane (the scheduler), whose messages carry large headers. `tos`:
        where this transport marks its packets, the ToS byte of every channel to `peer` (the scheduler's
        messages: scheduler.control_tos), not each channel's own."""
        ...

    def replace_peer(self, peer: str, endpoints: Sequence[str], control: bool = False,
                     tos: int | None = None) -> None:
        """`peer` died and a new process of its name listens on `endpoints`: forget everything owed to or
        from the old one (queued messages, in-flight credit, shared memory) and connect to the new one
        (`control`, `tos`: as connect's, the standby of a silent scheduler). Messages queued for it are dropped:
        the caller sends again what it still needs."""
        ...

    def send(self, peer: str, channel: int, msg: Message) -> None:
        """Queue `msg` for `peer` on `channel`, ordered by msg.priority; thread-safe, never blocks.

        The payload buffer may be sent zero-copy: the caller must not change it until the peer replies.
        """
        ...

    def withdraw(self, match: Callable[[str, int, Message], bool]) -> list[tuple[str, int, Message]]:
        """Take back the messages queued here that `match(peer, channel, msg)` picks and that have not begun to
        leave (no peer has seen any of them), as (peer, channel, msg); the caller sends them again, or not."""
        ...

    def alloc(self, count: int, dtype: np.dtype) -> np.ndarray:
        """A zeroed 1-D array that is sent without a copy when it is itself a message's payload.

        (Shared memory for peers on this host.) It must not change while a message sent from it
        is unacknowledged.
        """
        ...

    def stats(self, reset: bool = False) -> dict[str, Any]:
        """Metrics since the start (or the last reset): bytes per channel and queueing delay per
        priority, as `TransportMetrics.snapshot()` gives them."""
        ...

    def set_inflight(self, nbytes: int) -> None:
        """Change the in-flight bound of every channel (after a calibration)."""
        ...

    def refuse(self, peer: str, text: str) -> None:
        """Count and log (rate-limited) a message the handler refused; call it from the handler."""
        ...

    def close(self, flush_seconds: float = 1.0, linger_seconds: float = 2.0) -> None:
        """Send what is queued (up to `flush_seconds`), stop the I/O thread, close the sockets (what they still
        hold for a peer gets up to `linger_seconds` to leave)."""
        ...

    def on_failure(self, listener: Callable[[str], None]) -> None:
        """Call `listener(error)` once if the I/O thread stops on an unexpected error (at once if it has):
        nothing is sent or received after that, so the owner must fail instead of waiting."""
        ...


def open_transport(name: str, config: TransportConfig, handler: Handler, keys: JobKeys | None = None,
                   control: bool = False, members: Iterable[str] = ()) -> Transport:
    """The transport implementation named by config.backend. With config.curve (the default), `keys`
    authenticate every connection and encrypt those between hosts, `name` being this member's name among them.
    `control`: this transport serves the control plane (the scheduler). `members`: the names of the
    job's processes (known from `keys` too): their routes are never forgotten, they are never banned,
    and only they may share memory with this process."""
    from sluice.transport.zmq_transport import ZmqTransport

    return ZmqTransport(name, config, handler, keys, control, members)
