"""Direct lanes for the coordinator's messages to its tree neighbours on this host, kept in order with the transport.

Through the transport a message wakes five threads on its way (caller, Python I/O thread, ZeroMQ's, the
receiver's two); over a direct lane (transport/lane.py) the thread that ticks writes it into the socket
and this module's thread, waiting in poll(), reads it and hands it to the coordinator, which ticks
inline and wakes the waiting caller: two. On 2 cores each wake-up waits for a core.

Set-up: the rank that dials a neighbour (tree.dials) listens and offers the lane's name and secret
through the transport, right after its hello; the other connects, or declines when it cannot (the name
is not in its network namespace: "one host" by name only), and both keep to the transport.

Order: each direction of a pair is in order on its own path, but a message on the lane could overtake
one still in the transport. So a sender that changes path first says so on the old one (`{"path":
"lane"}` through the transport, `{"path": "transport"}` over the lane: a message larger than a lane
datagram goes through the transport); the receiver keeps what comes on the other path until that mark
arrives. A lane that closes (its peer exited) ends its path: what it still had was read before the end.
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
from sluice.transport.wire import Kind, Message, WireError, keep_payload

log = logging.getLogger("sluice.coordinator")

#: (neighbour rank, message, whether it came over the lane): to the coordinator, in order per neighbour
Deliver = Callable[[int, Message, bool], None]
#: messages kept from the path not in use yet, per neighbour; past it the neighbour breaks the rule above
MAX_EARLY = 1024
#: how often the lane thread retries a connection the listener's full backlog turned away
RETRY_S = 0.01


@dataclass
class _Pair:
    """The lane to one neighbour and which path each direction is on."""

    peer: str
    sends: Kind  # the kind of what this rank sends it (COORD_UP to the parent)
    listener: lanes.LaneListener | None = None
    offer: tuple[str, str] | None = None  # its name and secret, once offered (set on the I/O thread)
    lane: lanes.Lane | None = None
    declined: bool = False
    ended: bool = False  # its lane closed, and that was taken as its last word
    out_on_lane: bool = False  # the path of what this rank sends (the ticking thread's, under send_lock)
    in_on_lane: bool = False  # the path of what it receives (under receive_lock)
    early: list[Message] = field(default_factory=list)  # came on the other path, before its mark
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    receive_lock: threading.Lock = field(default_factory=threading.Lock)


def is_lane_control(msg: Message) -> bool:
    """Whether `msg` is this module's (an offer, a decline, a mark), not the controller's."""
    return msg.meta is not None and not msg.nbytes and bool(msg.meta.keys() & {"lane", "declined", "path"})


class CoordinatorLanes:
    """Lanes to `pairs` (neighbour rank -> its name, the kind it is sent); `offer_to`: those this rank offers to."""

    def __init__(self, transport: Transport, rank: int, node_id: int, pairs: dict[int, tuple[str, Kind]],
                 offer_to: set[int], deliver: Deliver) -> None:
        """`node_id`: the sender its messages name (the coordinator's); `rank`: its thread's name says it."""
        self._transport, self._node_id, self._deliver = transport, node_id, deliver
        self._pairs = {rank: _Pair(peer, kind) for rank, (peer, kind) in pairs.items()}
        #: the largest payload sent over a lane; a larger one goes through the transport
        self.piece = lanes.piece_bytes()
        self._wake = Wakeup()
        self._closed = False
        #: what lanes brought that was refused (counted and logged on the lane thread)
        self.rejects = Rejections(log)
        for rank in sorted(offer_to & set(self._pairs)):
            pair = self._pairs[rank]
            try:
                pair.listener = lanes.LaneListener()
            except OSError as exc:  # no lane here: the other side hears of none and keeps to the transport
                log.info("no direct lane to %s: %s", pair.peer, exc)
                continue
            self._control(pair, {"lane": pair.listener.name, "secret": pair.listener.secret})
        self._thread = threading.Thread(target=self._run, name=f"sluice-coordinator-lanes-{rank}", daemon=True)

    def start(self) -> None:
        """Start reading the lanes (once the owner is ready to take what they bring)."""
        self._thread.start()

    def __contains__(self, rank: object) -> bool:
        return rank in self._pairs

    def on_own_thread(self) -> bool:
        """Whether the caller is the lane thread (which counts what it refuses in `rejects`)."""
        return threading.current_thread() is self._thread

    # ------------------------------------------------------------------ the thread that ticks
    def send(self, rank: int, msg: Message) -> None:
        """`msg` to neighbour `rank`, over its lane if it has one and the message fits, else the transport."""
        pair = self._pairs[rank]
        with pair.send_lock:
            lane = pair.lane
            on_lane = lane is not None and not lane.closed and msg.nbytes <= min(self.piece, lane.piece)
            if on_lane != pair.out_on_lane:
                if pair.out_on_lane and lane is not None and not lane.closed:  # a closed lane says it by closing
                    lane.send(self._word(pair, {"path": "transport"}))
                elif not pair.out_on_lane:
                    self._control(pair, {"path": "lane"})
                pair.out_on_lane = on_lane
            if on_lane and lane is not None:
                lane.send(msg)
                if lane.pending:  # the socket is full: the lane thread must wait for room, not only for input
                    self._wake.ring()
            else:
                self._transport.send(pair.peer, 0, msg)

    # ------------------------------------------------------------------ the I/O thread, and the lane thread
    def arrive(self, rank: int, msg: Message, on_lane: bool) -> str | None:
        """A message from neighbour `rank` (its kind checked): a lane's own, handled here, or the controller's,
        delivered in its order; why it is refused, or None."""
        pair = self._pairs[rank]
        if is_lane_control(msg) and msg.meta is not None and set(msg.meta) != {"path"}:
            return "a lane offer or decline over the lane itself" if on_lane else self._offered(pair, msg.meta)
        with pair.receive_lock:
            if on_lane != pair.in_on_lane:  # marks too: one on the other path counts once that path is in use
                if len(pair.early) >= MAX_EARLY:
                    return f"{MAX_EARLY} messages came on the {'lane' if on_lane else 'transport'} before its mark"
                pair.early.append(msg if on_lane else keep_payload(msg))  # a transport's payload is lent
                return None
            return self._in_order(rank, pair, msg)

    def _in_order(self, rank: int, pair: _Pair, msg: Message) -> str | None:
        """Deliver `msg`, which came on the path in use; after a mark, what was kept from the other path."""
        refused = None
        taking = [msg]
        while taking:
            msg = taking.pop(0)
            if not is_lane_control(msg):
                self._deliver(rank, msg, pair.in_on_lane)
                continue
            assert msg.meta is not None
            if msg.meta != {"path": "transport" if pair.in_on_lane else "lane"}:
                refused = f"a path mark {msg.meta!r:.60} on the {'lane' if pair.in_on_lane else 'transport'}"
                continue
            pair.in_on_lane = not pair.in_on_lane  # what was kept came on the path now in use; the rest waits
            taking, pair.early = pair.early, taking
        return refused

    def _offered(self, pair: _Pair, meta: dict[str, object]) -> str | None:
        if set(meta) == {"declined"} and type(meta["declined"]) is str and pair.listener is not None:
            log.info("no direct lane to %s: it declined (%s)", pair.peer, meta["declined"][:200])
            pair.declined = True
            self._wake.ring()
            return None
        if pair.listener is not None or pair.offer is not None or pair.declined:
            return "a lane offer where none is expected"
        try:
            pair.offer = lanes.offer_of(meta)
        except ValueError as exc:
            return str(exc)
        self._wake.ring()
        return None

    # ------------------------------------------------------------------ the lane thread
    def _run(self) -> None:
        while not self._closed:
            poller = select.poll()
            poller.register(self._wake.fileno(), select.POLLIN)
            retry = False
            for rank, pair in self._pairs.items():
                if pair.lane is None:
                    retry |= self._connect(pair)
                if pair.lane is not None and not pair.ended:
                    self._read(rank, pair)
                    if not pair.lane.closed:
                        poller.register(pair.lane, select.POLLIN | (select.POLLOUT if pair.lane.pending else 0))
                elif pair.listener is not None:
                    poller.register(pair.listener, select.POLLIN)
                    for conn in pair.listener.candidates():
                        poller.register(conn, select.POLLIN)
            if not self._closed:
                poller.poll(RETRY_S * 1e3 if retry else None)
                self._wake.clear()

    def _connect(self, pair: _Pair) -> bool:
        """Connect `pair`'s lane if it can be; True when worth trying again soon (a full backlog)."""
        try:
            if pair.listener is not None:
                if pair.declined:
                    pair.listener.close()
                    pair.listener = None
                    return False
                pair.lane = pair.listener.accept()
                if pair.listener.refused:
                    self.rejects.refuse(pair.peer, f"refused {pair.listener.refused} connection(s) to the lane for "
                                        f"{pair.peer!r:.60}: another user's, or without its secret", time.monotonic())
                    pair.listener.refused = 0
            elif pair.offer is not None and not pair.declined:
                pair.lane = lanes.connect(*pair.offer)
                return pair.lane is None
        except (OSError, ValueError) as exc:
            log.info("no direct lane to %s (%s): the coordinator's messages to it go through the transport",
                     pair.peer, exc)
            pair.declined = True
            self._control(pair, {"declined": f"{type(exc).__name__}: {exc}"[:200]})
        if pair.lane is not None and pair.listener is not None:
            pair.listener = None  # accept() closed it
        return False

    def _read(self, rank: int, pair: _Pair) -> None:
        lane = pair.lane
        assert lane is not None
        with pair.send_lock:
            lane.flush()
        for got in lane.receive():
            if isinstance(got, WireError):
                why = str(got)
            elif got.kind != (Kind.COORD_DOWN if pair.sends == Kind.COORD_UP else Kind.COORD_UP):
                why = f"a {got.kind.name}, which that neighbour does not send"
            else:
                why = self.arrive(rank, got, on_lane=True) or ""
            if why:
                self.rejects.refuse(pair.peer, f"dropped a lane message from {pair.peer!r:.60}: {why}",
                                    time.monotonic())
        if lane.closed:  # its peer exited: the end of what it sent is a mark back to the transport
            pair.ended = True
            self.arrive(rank, Message(pair.sends, meta={"path": "transport"}), on_lane=True)

    # ------------------------------------------------------------------ any thread
    def _control(self, pair: _Pair, meta: dict[str, str]) -> None:
        """An offer, a decline or a path mark to `pair`'s neighbour through the transport."""
        self._transport.send(pair.peer, 0, self._word(pair, meta))

    def _word(self, pair: _Pair, meta: dict[str, str]) -> Message:
        return Message(pair.sends, sender=self._node_id, meta=meta)

    def close(self, seconds: float = 1.0) -> None:
        """Stop the lane thread, give what the lanes still hold up to `seconds` to leave, and close them."""
        self._closed = True
        self._wake.ring()
        if threading.current_thread() is not self._thread and self._thread.ident is not None:
            self._thread.join(5.0)
        deadline = time.monotonic() + seconds
        for pair in self._pairs.values():
            with pair.send_lock:
                if pair.lane is not None:
                    while not pair.lane.flush() and not pair.lane.closed and time.monotonic() < deadline:
                        select.select([], [pair.lane], [], max(0.0, deadline - time.monotonic()))
                    pair.lane.close()
                if pair.listener is not None:
                    pair.listener.close()
        self._wake.close()
