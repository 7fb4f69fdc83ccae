"""The ZeroMQ transport's receiving half (Receiver): each message validated, then acted on or handed to the handler.

Nothing a peer sends can end the I/O thread; the handler gets each poll's messages most urgent first.
Order of checks for a message (each before the next spends anything): a banned stranger's is dropped
after its first frame; a router-side message must come from the name its connection proved (CURVE's
ZAP User-Id) and not claim a peer we dialled; `decode` with the socket's header limit; a shared-memory
descriptor must name a segment this very peer announced. Acknowledgements, segment announcements and
their confirmations are the transport's own; everything else goes to the handler. Any exception on
the way is the last resort's: the message is dropped, counted and logged once per kind.
"""
from __future__ import annotations

import ctypes
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import zmq

from sluice.transport.base import Handler
from sluice.transport.config import TransportConfig
from sluice.transport.incarnations import Incarnations, hello_token
from sluice.transport.metrics import TransportMetrics
from sluice.transport.rejects import Rejections
from sluice.transport.shm import SharedPayloads
from sluice.transport.wire import Flag, Kind, Message, WireError, decode, encode
from sluice.transport.zmq_seal import Seals

log = logging.getLogger("sluice.transport")

_RECV_BATCH = 64
_MAX_ROUTER_PEERS = 4096

# Credit comes back lazily (Receiver.flush_acks), as an ACK costs a send here and a wake-up at the sender, as
# much as a small message: once a route's unacknowledged bytes reach 1/8 of the bound (7/8 stay usable)
# or 1 MiB, or its oldest byte is ACK_DELAY_S old (ack_threshold: why no sender waits for that). A
# pipeline's 32 KiB messages come a few ms apart: 20 ms sends 1 ACK for 5-7 of them (5 ms: for 2-3,
# and its timer wake-ups cost what it saves): 1-8% more samples/s, 4% less CPU (bench/pipeline.py,
# 1F1B, M=8, P=2 and 4; 50 ms did no better).
ACK_SHARE = 8
ACK_MAX_BYTES = 1 << 20
ACK_DELAY_S = 0.020


def ack_threshold(config: TransportConfig) -> int:
    """Unacknowledged bytes on a route that are acknowledged at once, while no bound was set (after
    set_inflight: 1). What we hold below it would wait ACK_DELAY_S if its sender ran out of credit; it
    cannot while this leaves room for its largest message, a chunk C (larger frames are refused),
    within its bound B (and C contiguous bytes in its ring of B + 2C). We know B while no bound was
    set: every process keeps the configured one. Set bounds may differ (a calibration sweeps them
    from one chunk, a worker keeps its own proposal until its plan): then, as for calibration
    probes, every turn acknowledges what it received."""
    bound = config.inflight_limit
    return max(1, min(bound // ACK_SHARE, bound - config.chunk_limit, ACK_MAX_BYTES))


Route = tuple[str, int]  # (peer name, channel)
Frames = list[Any]  # one message's frames, as encode() gives them
Arrived = list[tuple[int, int, str, int, Message]]  # (priority, arrival index, peer, channel, message)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def _keep_large_buffers_mapped() -> None:
    """Stop glibc from mmap-ing (and unmapping) every received 1 MiB frame.

    libzmq mallocs each large incoming message; above the mmap threshold every one costs fresh page
    faults. Measured with 2 workers x 2 servers, 64 MiB push_pull: 816k -> 56k minor faults and a
    third less system time with the threshold at 64 MiB.
    """
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, 64 << 20)
        libc.mallopt(_M_TRIM_THRESHOLD, 256 << 20)
    except (OSError, AttributeError):  # not glibc: keep the allocator's defaults
        pass


class RouterPeers:
    """The peers that dialled our ROUTERs, as learnt from what they sent: the identity a reply to each needs
    (the sending half looks it up), and a channel each is surely connected on."""

    def __init__(self, members: frozenset[str]) -> None:
        self._members = members
        #: members' identities, kept for good; the others' (all, when the members are not known) in a bounded FIFO
        self.router_idents: dict[str, bytes] = {}
        self.strangers: dict[str, bytes] = {}
        self.heard_on: dict[str, int] = {}

    def remember(self, source: str, ident: bytes, channel: int) -> None:
        """Keep the identity a ROUTER needs to reply, and a channel the peer is surely connected on
        (its others may still be in their handshake). The job's members are kept for good; others
        (all peers, when the members are not known) in a bounded FIFO, so a flood of fresh identities
        can neither grow memory nor push a member's route out."""
        if source in self.heard_on:  # known already (the usual case, once per message): nothing to do
            return
        if source in self._members:
            self.router_idents[source] = ident
        else:
            if len(self.strangers) >= _MAX_ROUTER_PEERS:
                gone = next(iter(self.strangers))
                del self.strangers[gone]
                del self.heard_on[gone]
            self.strangers[source] = ident
        self.heard_on[source] = channel

    def ident(self, peer: str) -> bytes | None:
        return self.router_idents.get(peer) or self.strangers.get(peer)

    def new_process(self, source: str, channel: int) -> None:
        """`source` is a new process, whose HELLO came on `channel`: the channel the old one was heard on first may
        not be connected by this one yet (what is sent there, a shared-memory announcement, would be lost)."""
        if source in self.heard_on:
            self.heard_on[source] = channel


class Receiver:
    """The receiving half of ZmqTransport, run on its I/O thread: reads a socket the transport polled,
    acknowledges what arrived, and answers shared-memory announcements. It sends through the sending
    half's `send_frames` and returns credit through its `credit`; the sockets are the transport's."""

    def __init__(self, name: str, config: TransportConfig, handler: Handler, *, curve: bool,
                 members: frozenset[str], peers: RouterPeers, dealers: dict[str, list[zmq.Socket[bytes]]],
                 local: set[str] | None, shared: SharedPayloads, metrics: TransportMetrics, rejects: Rejections,
                 cut: Callable[[str, zmq.Frame, float], bool], send_frames: Callable[[Route, Frames], bool],
                 credit: Callable[[Route, int], None], forget_peer: Callable[[str], None],
                 seals: Seals | None = None) -> None:
        self._name = name
        self._handler = handler
        #: with CURVE, a router-side peer's name must be the one its key proved (ZAP's User-Id)
        self._curve = curve
        self._members = members
        self.peers = peers
        #: the transport's DEALERs, by peer (peers we dialled); shared, not ours to change
        self._dealers = dealers
        #: peers on this host that read our shared memory (None: shared memory is off), and that memory
        self._local = local
        self._shared = shared
        self._metrics = metrics
        self._rejects = rejects
        self._cut = cut
        self._send_frames = send_frames
        self._credit = credit
        #: drops all that is kept for a peer whose process a new one replaced (the transport's)
        self._forget_peer = forget_peer
        #: sealed connections (transport/zmq_seal.py): what arrives on them is opened before anything reads it
        self._seals = seals
        self._incarnations = Incarnations()
        self._unacked: defaultdict[Route, int] = defaultdict(int)
        #: per route with unacknowledged bytes, when the oldest of them arrived (the I/O turn's start)
        self._unacked_since: dict[Route, float] = {}
        #: when the next delayed acknowledgement is due (the I/O loop's poll ends by then), or None
        self.ack_due: float | None = None
        #: unacknowledged bytes on a route that are acknowledged at once (ack_threshold; 1 once bounds were set)
        self.ack_bytes = ack_threshold(config)

    def receive(self, sock: zmq.Socket[bytes], peer: str | None, channel: int, max_header: int,
                arrived: Arrived) -> None:
        """Read up to a batch from `sock` (a DEALER to `peer`, or a ROUTER: None), whose headers may have
        `max_header` bytes: transport messages are handled now, the rest goes to `arrived`."""
        for _ in range(_RECV_BATCH):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                self._take(frames, sock, peer, channel, max_header, arrived)
            except Exception as exc:  # the last resort: nothing a peer sends may end this thread
                self._rejects.refuse(peer or "a router peer", f"transport {self._name}: a message on channel "
                                     f"{channel} could not be processed ({type(exc).__name__}); dropped",
                                     time.monotonic(), exc_info=True)

    def _take(self, frames: list[Any], sock: zmq.Socket[bytes], peer: str | None, channel: int, max_header: int,
              arrived: Arrived) -> None:
        """Validate one received message; act on transport messages, queue the others for the handler."""
        source = peer
        if source is None:  # a ROUTER: the first frame names the sender, as the sender chose it
            ident = frames.pop(0).bytes
            source = ident.decode("utf-8", "replace")
            if self._rejects.banned(source):
                now = time.monotonic()
                self._rejects.drop_banned(now)
                if frames:
                    self._cut(source, frames[0], now)
                return
            problem = self._impostor(source, frames)
            if problem:
                self._refuse(source, channel, problem)
                return
            self.peers.remember(source, ident, channel)  # the route back, for acknowledgements of what it sent
        try:
            if self._seals is not None:
                frames = self._seals.open(frames, sock if peer is not None else None, source, channel)
            msg = decode(frames, max_header)
            if msg.shm is not None:
                self._unacked[(source, channel)] += msg.shm[2]
                msg.payload = self._map_shared(source, msg.shm)
                msg.shm = None
        except WireError as exc:
            self._refuse(source, channel, f"dropped a message from {source!r:.60} on channel {channel}: {exc}")
            return
        if peer is None:
            if not self.is_member(source):  # keep the score that can get a stranger banned
                self._rejects.accept(source)
            if (msg.flags & Flag.LOCAL and self._local is not None and source not in self._local
                    and self._trusted(source)):
                self._local.add(source)
                self._shared.announce_registered([source])
        if msg.kind == Kind.ACK:
            self._credit((source, channel), msg.round)
            return
        if msg.kind == Kind.HELLO:
            if peer is None and self.is_member(source):
                self._hello(source, channel, msg)
            return
        if msg.kind in (Kind.SHM_OPEN, Kind.SHM_MAPPED):
            self._on_shm(source, channel, msg)
            return
        if msg.payload is not None:
            if not msg.flags & Flag.SHM:
                self._unacked[(source, channel)] += msg.payload.nbytes
            self._metrics.received_bytes[channel] += msg.payload.nbytes
            if msg.kind == Kind.PROBE:  # a calibration sweeps the prober's bound from one chunk up: its
                # credit must come back at once, or the sweep would measure our ACK delay, not the path
                self._unacked_since[(source, channel)] = float("-inf")
        arrived.append((msg.priority, len(arrived), source, channel, msg))

    def flush_acks(self, arrived_at: float) -> None:
        """Acknowledge each route whose unacknowledged bytes reached the threshold or whose oldest
        arrived ACK_DELAY_S ago; note when the next is due."""
        self.ack_due = None
        if not self._unacked:
            return
        threshold, now = self.ack_bytes, time.monotonic()
        for route, nbytes in list(self._unacked.items()):
            due = self._unacked_since.setdefault(route, arrived_at) + ACK_DELAY_S
            if (nbytes >= threshold or now >= due) and self._send_frames(
                    route, encode(Message(Kind.ACK, key=route[1], round=nbytes))):
                del self._unacked[route], self._unacked_since[route]
                self._metrics.acks_sent[route[1]] += 1
            else:  # not due yet, or the socket is full: on a later turn
                self.ack_due = due if self.ack_due is None else min(self.ack_due, due)

    def forget(self, routes: list[Route]) -> None:
        """Owe no acknowledgement on `routes` (their peer was replaced)."""
        for route in routes:
            self._unacked.pop(route, None)
            self._unacked_since.pop(route, None)

    def _impostor(self, source: str, frames: list[zmq.Frame]) -> str | None:
        """Why a router-side message cannot be from whom it claims, or None."""
        if source in self._dealers:
            return f"dropped a message whose sender calls itself {source!r:.60}, a peer we connected to"
        if not self._curve:
            return None
        user = frames[0].get("User-Id") if frames else None
        if user != source:
            return f"dropped a message from a connection authenticated as {user!r:.60} that calls itself {source!r:.60}"
        return None

    def _refuse(self, source: str, channel: int, text: str, delivered: bool = False) -> None:
        self._rejects.refuse(source, text, time.monotonic(), member=self.is_member(source), delivered=delivered)

    def is_member(self, peer: str) -> bool:
        """A member of the job (with CURVE every router-side peer is: ZAP admits only members' keys and
        the identity must be the key's name) or a peer we connected to: never banned, only counted.
        Any other peer that sends ten refused messages for each accepted one, a hundred or more, is."""
        return peer in self._members or peer in self._dealers

    def _trusted(self, peer: str) -> bool:
        """May `peer` read our shared memory or have us map its? A member; anyone, on a bare transport
        that was told no members."""
        return not self._members or self.is_member(peer)

    def _on_shm(self, source: str, channel: int, msg: Message) -> None:
        """A peer announces a segment it will send descriptors into, or confirms it mapped one of ours."""
        meta = msg.meta or {}
        name = meta.get("segment")
        if not isinstance(name, str):
            raise WireError(f"{msg.kind.name} without a segment name")
        if msg.kind == Kind.SHM_MAPPED:
            if meta.get("ok") is True:
                self._shared.confirmed(source, name)
            return
        size = meta.get("size")
        error = ""
        if self._local is None:
            error = "shared memory is off here"
        elif not self._trusted(source):
            error = "not a member of this job"
        elif type(size) is not int:
            error = "no size"
        else:
            try:
                self._shared.peers.adopt(source, name, size)
            except ValueError as exc:
                error = str(exc)
        if error:
            self._refuse(source, channel, f"refused the shared-memory segment {source!r:.60} announced: {error}",
                         delivered=True)
        reply = Message(Kind.SHM_MAPPED, meta={"segment": name, "ok": not error})
        self._send_frames((source, channel), encode(reply))

    def dispatch(self, arrived: Arrived) -> None:
        """Hand what one poll brought in to the handler, most urgent first, FIFO among equals: the
        receiving hop keeps the senders' priorities (a server sums and answers urgent chunks first)."""
        if len(arrived) > 1:
            arrived.sort()  # (priority, arrival index, ...): the index is unique, so nothing after it is compared
        for _, _, source, channel, msg in arrived:
            try:
                self._handler(source, channel, msg)
            except Exception as exc:  # the last resort: a handler's bug must not end the I/O thread
                self._rejects.refuse(source, f"handling {msg.kind.name} from {source!r:.60} failed "
                                     f"({type(exc).__name__}); message dropped", time.monotonic(), exc_info=True)

    def _hello(self, source: str, channel: int, msg: Message) -> None:
        """A dealer's first message on a connection (transport/incarnations.py): forget what belongs to a process
        of its name that this one replaced."""
        try:
            forget = self._incarnations.hello(source, channel, hello_token(msg))
        except WireError as exc:
            self._refuse(source, channel, f"dropped a HELLO from {source!r:.60}: {exc}")
            return
        if forget == "peer":
            self.peers.new_process(source, channel)
            self._forget_peer(source)
            log.info("transport %s: %s is a new process: what was kept for the one it replaced is dropped",
                     self._name, source)
        elif forget == "route":
            self.forget([(source, channel)])

    def owed(self, peer: str) -> list[Route]:
        """The routes of `peer` on which we owe acknowledgements."""
        return [route for route in self._unacked if route[0] == peer]

    def _map_shared(self, peer: str, descriptor: tuple[str, int, int]) -> memoryview:
        try:
            return self._shared.peers.view(peer, *descriptor)
        except ValueError as exc:
            raise WireError(str(exc)) from None

    def announce(self) -> None:
        """Send queued segment announcements; tell local peers of newly registered segments."""
        if self._local is not None and self._local and self._shared.registered_changed():
            self._shared.announce_registered(self._local, new_only=True)
        pending = self._shared.pending
        while pending:
            peer, name, size = pending[0]
            route = (peer, 0 if peer in self._dealers else self.peers.heard_on.get(peer, 0))
            if not self._send_frames(route, encode(Message(Kind.SHM_OPEN, meta={"segment": name, "size": size}))):
                return  # the socket is full: try again on the next turn
            pending.popleft()
