"""A stage's direct lanes (transport/lane.py) to its neighbours on its own host: offered, connected, polled.

The stage before listens and offers (STAGE_LANE through the transport: its name and secret); the stage
after connects once the offer is in. Messages for a neighbour whose lane is not connected yet wait in
order. A stage that cannot connect (the name is not in its network namespace: "one host" by name only)
declines (STAGE_LANE {declined}); both then send through the transport, which delivers as before. All
of it runs on the stage's own thread, inside `send` and the waits of `receive`; the I/O thread only
hands over offers and declines, and wakes a wait (`wake`) when something it delivered changes the answer.
"""

from __future__ import annotations

import logging
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sluice.transport import lane as lanes
from sluice.transport.base import Transport
from sluice.transport.rejects import Rejections
from sluice.transport.wakeup import Wakeup
from sluice.transport.wire import Kind, Message, WireError

log = logging.getLogger("sluice.worker")

Deliver = Callable[[str, Message], None]
Refuse = Callable[[str, str], None]


@dataclass
class Link:
    """The lane to one neighbour, in whichever state it is."""

    peer: str
    listener: lanes.LaneListener | None = None
    offer: tuple[str, str] | None = None  # (name, secret) the neighbour offered; set on the I/O thread
    lane: lanes.Lane | None = None
    waiting: list[tuple[int, Message]] = field(default_factory=list)  # (channel, message) before a lane
    #: why this pair talks through the transport instead (a lane could not connect), set on either side
    declined: str | None = None

    def state(self) -> str:
        """For a deadline's message: where the lane stands."""
        if self.declined:
            return f"through the transport (no direct lane: {self.declined})"
        if self.lane is not None:
            return "its direct lane closed: it exited" if self.lane.closed else "over a direct lane"
        if self.listener is not None or self.offer is not None:
            return "a direct lane offered and not yet connected"
        return "no direct lane offered yet"


class Links:
    """Lanes to the neighbours in `ranks` (stage before and after, those on this host)."""

    def __init__(self, transport: Transport, me: int, ranks: dict[int, str], offer_to: int | None,
                 channel: int) -> None:
        self.links = {rank: Link(peer) for rank, peer in ranks.items()}
        self._transport, self._me, self._channel = transport, me, channel
        self._wake = Wakeup()
        self._owner: int | None = None  # the stage's thread, once it pumps
        #: what lanes brought that was refused (counted and logged here, on the stage's thread)
        self.rejects = Rejections(log)
        if offer_to is not None:
            link = self.links[offer_to]
            try:
                link.listener = lanes.LaneListener()
            except OSError as exc:  # no lane to offer (no Unix sockets here, say): both use the transport
                self._decline(link, f"cannot listen: {type(exc).__name__}: {exc}")
                return
            offer = Message(Kind.STAGE_LANE, sender=me, meta={"lane": link.listener.name,
                                                              "secret": link.listener.secret})
            transport.send(link.peer, channel, offer)

    def __contains__(self, rank: object) -> bool:
        return rank in self.links

    # ------------------------------------------------------------------ the I/O thread
    def offered(self, rank: int, meta: object) -> str | None:
        """A STAGE_LANE offer (or decline) from neighbour `rank`; why it is refused, or None."""
        link = self.links.get(rank)
        if link is not None and type(meta) is dict and set(meta) == {"declined"}:
            if type(meta["declined"]) is not str or link.declined is not None or link.lane is not None:
                return "a lane decline must say why, once, before any lane is up"
            link.declined = f"{link.peer} declined it: {meta['declined'][:200]}"
            self.wake()
            return None
        if link is None or link.listener is not None:
            return "this stage takes no direct lane from that worker"
        if link.offer is not None:
            return "it offered a direct lane twice"
        try:
            link.offer = lanes.offer_of(meta)
        except ValueError as exc:
            return str(exc)
        self.wake()
        return None

    def wake(self) -> None:
        """End the stage thread's current wait (any thread; a no-op once closed)."""
        if threading.get_ident() != self._owner:  # the stage's own thread checks anyway before it waits
            self._wake.ring()

    # ------------------------------------------------------------------ the stage's thread
    def send(self, rank: int, channel: int, msg: Message) -> None:
        """`msg` to neighbour `rank`: over its lane, or on `channel` of the transport if it declined one."""
        link = self.links[rank]
        if link.lane is not None:
            link.lane.send(msg)
            return
        link.waiting.append((channel, msg))
        self._connect(link)

    def pump(self, deliver: Deliver, refuse: Refuse) -> None:
        """Connect what can be, send what waits, and hand what arrived to `deliver`; never blocks."""
        self._owner = threading.get_ident()
        for link in self.links.values():
            if link.lane is None:
                self._connect(link)
            if link.lane is None:
                continue
            link.lane.flush()
            for got in link.lane.receive():
                if isinstance(got, WireError):
                    refuse(link.peer, f"dropped a lane message from {link.peer!r:.60}: {got}")
                else:
                    deliver(link.peer, got)

    def _connect(self, link: Link) -> None:
        if link.declined is not None:
            self._through_transport(link)
            return
        try:
            if link.listener is not None:
                link.lane = link.listener.accept()
                if link.listener.refused:
                    self.rejects.refuse(link.peer, f"refused {link.listener.refused} connection(s) to the lane "
                                        f"for {link.peer!r:.60}: another user's, or without its secret",
                                        time.monotonic())
                    link.listener.refused = 0
            elif link.offer is not None:
                link.lane = lanes.connect(*link.offer)
        except (OSError, ValueError) as exc:
            self._decline(link, f"{type(exc).__name__}: {exc}")
            return
        if link.lane is not None:
            link.listener = None
            for _, msg in link.waiting:
                link.lane.send(msg)
            link.waiting.clear()

    def _decline(self, link: Link, why: str) -> None:
        """This side cannot connect the lane offered: say so, and talk through the transport."""
        log.warning("no direct lane to %s (%s): its messages go through the transport", link.peer, why)
        link.declined, link.offer = why, None
        self._transport.send(link.peer, self._channel, Message(Kind.STAGE_LANE, sender=self._me,
                                                               meta={"declined": why[:200]}))
        self._through_transport(link)

    def _through_transport(self, link: Link) -> None:
        if link.listener is not None:
            link.listener.close()
            link.listener = None
        for channel, msg in link.waiting:
            self._transport.send(link.peer, channel, msg)
        link.waiting.clear()

    def wait(self, seconds: float) -> None:
        """Wait at most `seconds` for input on a lane, room for what waits to go, or a `wake`."""
        poller = select.poll()
        poller.register(self._wake.fileno(), select.POLLIN)
        for link in self.links.values():
            if link.lane is not None and not link.lane.closed:
                poller.register(link.lane, select.POLLIN | (select.POLLOUT if link.lane.pending else 0))
            elif link.listener is not None:
                poller.register(link.listener, select.POLLIN)
                for conn in link.listener.candidates():
                    poller.register(conn, select.POLLIN)
        poller.poll(max(0, int(seconds * 1e3)))
        self._wake.clear()

    def close(self, seconds: float) -> None:
        """Send what still waits (at most `seconds`), then close every lane."""
        deadline = time.monotonic() + seconds
        lanes_open = [link.lane for link in self.links.values() if link.lane is not None]
        while time.monotonic() < deadline and any(not lane.closed and not lane.flush() for lane in lanes_open):
            self.wait(min(0.05, max(0.0, deadline - time.monotonic())))
        for link in self.links.values():
            if link.lane is not None:
                (sent, out), (got, came) = link.lane.sent, link.lane.received
                log.info("direct lane to %s: %d messages sent (%.1f MiB), %d received (%.1f MiB)%s", link.peer,
                         sent, out / (1 << 20), got, came / (1 << 20),
                         f"; {link.lane.pending} not sent in time" if link.lane.pending else "")
                link.lane.close()
            if link.listener is not None:
                link.listener.close()
        self._wake.close()
