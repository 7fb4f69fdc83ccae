"""The transport's sockets: their defences (CURVE, tickets and ZAP, size caps, handshake counts, cut-offs), options.

- Every socket refuses frames over a cap (ZMQ_MAXMSGSIZE): libzmq reads a frame's length before its
  body and drops the connection of a peer that announces more, so an oversized frame is never held.
  Data sockets cap at the job's largest chunk, control sockets (to and from the scheduler) at the
  largest control header.
- With job keys, listening sockets are CURVE servers on the network (PLAIN servers checking address-bound
  tickets where data connections are sealed: transport/zmq_seal.py) and PLAIN servers on their local Unix
  sockets (transport/local_endpoints.py); a ZAP handler on the transport's own I/O thread admits only
  clients whose key (or ticket) belongs to a member, whose name becomes the connection's User-Id;
  connecting CURVE sockets authenticate the server they connect to by its key. A
  monitor counts handshakes that failed (strangers never get a message through); the same monitors give
  each TCP connection the job's congestion control as it opens (transport/tcp_tuning.py).
- Each socket's options: its ToS mark and priority, and the ZeroMQ I/O threads its connections may use.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket

import zmq
from zmq.utils.monitor import parse_monitor_message

from sluice.transport import local_endpoints
from sluice.transport.auth import ZAP_ENDPOINT, JobKeys
from sluice.transport.tcp_tuning import refusal_advice, set_congestion_control
from sluice.transport.zmq_seal import Seals, sealed_domain

log = logging.getLogger("sluice.transport")

_HWM = 100_000
#: CURVE wraps each frame in a MESSAGE command (a nonce, flags and a MAC, under 100 bytes), and libzmq
#: applies ZMQ_MAXMSGSIZE to that wrapped size
_FRAME_SLACK = 4096
_LINGER_MS = 2000
_FAILED_HANDSHAKES = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
#: a local dialler tries again this long after its Unix socket's peer went away: a Unix connection breaks only
#: when that process exits, and a name that went away could be another user's next, who would hear what is still
#: sent to it. Not "never" (-1): libzmq then drops what had arrived but was not yet read when the peer closed
LOCAL_RECONNECT_MS = 600_000
#: the ZAP domain of listeners on the network (CURVE)
NETWORK_DOMAIN = b"sluice"
#: at most one cut-off per banned peer per this many seconds (its DEALER reconnects by itself)
_CUT_INTERVAL = 1.0


def make_socket(ctx: zmq.Context[zmq.Socket[bytes]], kind: int, max_frame: int, tos: int | None,
                so_priority: int | None) -> zmq.Socket[bytes]:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, _LINGER_MS)
    sock.setsockopt(zmq.SNDHWM, _HWM)
    sock.setsockopt(zmq.RCVHWM, _HWM)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame + _FRAME_SLACK)
    if tos is not None:
        sock.setsockopt(zmq.TOS, tos)
    if so_priority is not None:
        sock.setsockopt(zmq.PRIORITY, so_priority)
    return sock


def io_thread_mask(channel: int, io_threads: int) -> int:
    """The ZeroMQ I/O threads a channel's connections may run on (zmq.AFFINITY): the urgent channel 0 has
    thread 0 to itself, so that its messages are never encrypted behind bulk; the other channels' connections
    spread over the rest, each to the least busy (libzmq's choice)."""
    return 1 if channel == 0 else (1 << io_threads) - 2


class Guard:
    """The ZAP handler and socket monitors of one transport; everything runs on its I/O thread."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], name: str, keys: JobKeys | None,
                 seals: Seals | None = None, congestion_control: str = "") -> None:
        self.name, self.keys = name, keys
        #: with sealed data connections (transport/zmq_seal.py): their sessions, sealers and openers
        self.seals = seals
        self.congestion_control = congestion_control
        self._told: set[bytes] = set()
        self.zap: zmq.Socket[bytes] | None = None
        #: each watched socket's monitor
        self.monitors: dict[zmq.Socket[bytes], zmq.Socket[bytes]] = {}
        #: handshakes that failed: no job secret, or (refused by ZAP) a key that is no member's
        self.refused_handshakes = 0
        #: listeners and dialled TCP connections given the congestion control; whether the kernel refused it (said once)
        self.tuned_connections = 0
        self._tuning_refused = False
        self._cut_at: dict[str, float] = {}
        if keys is not None:  # bound before any listening socket exists, so no client slips past it
            self.zap = ctx.socket(zmq.REP)
            self.zap.setsockopt(zmq.LINGER, 0)
            self.zap.bind(ZAP_ENDPOINT)

    def watch(self, sock: zmq.Socket[bytes], listening: bool = True) -> zmq.Socket[bytes] | None:
        """The monitor (to poll) of a socket, before it binds or connects: of a listening one when handshakes can
        fail (job keys), and of each when its connections take a congestion control."""
        events = _FAILED_HANDSHAKES if listening and self.keys is not None else 0
        if self.congestion_control:  # a listener's: the connections it accepts inherit it from the start
            events |= zmq.EVENT_LISTENING if listening else zmq.EVENT_CONNECTED
        if not events:
            return None
        monitor = self.monitors[sock] = sock.get_monitor_socket(events)
        return monitor

    def unwatch(self, sock: zmq.Socket[bytes]) -> zmq.Socket[bytes] | None:
        """Stop and close a socket's monitor, before the socket closes; the monitor, to unregister, if it had one."""
        monitor = self.monitors.pop(sock, None)
        if monitor is not None:
            sock.disable_monitor()
            monitor.close(linger=0)
        return monitor

    def secure_listener(self, sock: zmq.Socket[bytes], endpoint: str, channel: int = 0) -> None:
        """The mechanism of the socket's next bind, at `endpoint`: PLAIN with tickets on a local one, and on the
        network with sealing (a ticket for the address), else CURVE. libzmq copies a socket's options into each
        listener as it binds, so one ROUTER runs both."""
        if self.keys is None:
            return
        if endpoint.startswith(local_endpoints.PREFIX):
            sock.setsockopt(zmq.PLAIN_SERVER, 1)
            sock.setsockopt(zmq.ZAP_DOMAIN, local_endpoints.domain_of(endpoint).encode())
        elif self.seals is not None:
            sock.setsockopt(zmq.PLAIN_SERVER, 1)
            sock.setsockopt(zmq.ZAP_DOMAIN, sealed_domain(channel))
        else:
            self.keys.secure_server(sock, self.name)
            sock.setsockopt(zmq.ZAP_DOMAIN, NETWORK_DOMAIN)  # not a local one (libzmq refuses an empty one)

    def secure_dialer(self, sock: zmq.Socket[bytes], peer: str, endpoint: str, channel: int = 0,
                      control: bool = False) -> str:
        """Prepare `sock` to dial `peer` at `endpoint` as this member: with a ticket on a local endpoint
        (reconnecting only after LOCAL_RECONNECT_MS), sealed with a ticket for its address on a data connection
        over the network (with sealing), else as a CURVE client that checks it. What to connect."""
        if endpoint.startswith(local_endpoints.PREFIX):
            sock.setsockopt(zmq.RECONNECT_IVL, LOCAL_RECONNECT_MS)
        elif self.seals is not None and not control:
            return self.seals.dial(sock, peer, channel, endpoint)
        if self.keys is not None:
            self.keys.secure_dialer(sock, self.name, peer, endpoint)
        return endpoint

    def answer_zap(self) -> None:
        """Answer pending ZAP requests. A refusal is not counted here: libzmq reports it to the
        handshake monitor too (EVENT_HANDSHAKE_FAILED_AUTH), which counts every failed handshake."""
        assert self.zap is not None and self.keys is not None
        while True:
            try:
                request = self.zap.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            reply = self.keys.zap_reply(request, self.name, self.seals.admitted if self.seals is not None else None)
            why = reply[3] if len(reply) > 3 else b""
            elsewhere = b" but its connection comes from " in why
            if reply[2] != b"200" and elsewhere and why not in self._told and len(self._told) < 64:
                self._told.add(why)  # a member that cannot get in: say why once (it retries for good)
                log.warning("transport %s: refused a connection: %s: a ticket read off the network, or hosts that "
                            "see each other under other addresses (then set transport.cipher = curve)",
                            self.name, why.decode("utf-8", "replace"))
            self.zap.send_multipart(reply)

    def read_monitor(self, monitor: zmq.Socket[bytes]) -> int:
        """Count failed handshakes reported by one monitor, and tune the connections it saw open; how many
        handshakes failed."""
        failed = 0
        while True:
            try:
                event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
            except (ValueError, KeyError, IndexError):  # an event we do not parse
                continue
            if event["event"] & _FAILED_HANDSHAKES:
                failed += 1
            elif event["event"] & (zmq.EVENT_LISTENING | zmq.EVENT_CONNECTED):
                self._tune(int(event["value"]), bytes(event["endpoint"]).decode("ascii", "replace"),
                           event["event"] == zmq.EVENT_LISTENING)
        self.refused_handshakes += failed
        return failed

    def tune_listener(self, monitor: zmq.Socket[bytes]) -> None:
        """Give a listener that just bound the congestion control now, before its address is published: what it
        accepts later inherits it. libzmq reports the bind as it returns; the wait is a bound, not a pause."""
        if self.congestion_control and monitor.poll(1000, zmq.POLLIN):
            self.read_monitor(monitor)

    def _tune(self, fd: int, endpoint: str, listener: bool) -> None:
        if self._tuning_refused:  # (its events are asked for only where a congestion control is set)
            return
        try:
            self.tuned_connections += set_congestion_control(fd, endpoint, listener, self.congestion_control)
        except OSError as exc:  # the same for every connection of this process: say it once, stop trying
            self._tuning_refused = True
            log.warning("transport %s: cannot set TCP congestion control %r on its connections: %s; they keep "
                        "the host's default", self.name, self.congestion_control,
                        refusal_advice(self.congestion_control, exc))

    def cut(self, peer: str, frame: zmq.Frame, now: float) -> bool:
        """Shut the TCP connection a banned peer's message came on; its DEALER reconnects, and is cut again.

        The descriptor comes from the message just read (ZMQ_SRCFD) and is only shut down (libzmq
        closes it itself when it sees the end), never closed here."""
        if now - self._cut_at.get(peer, -_CUT_INTERVAL) < _CUT_INTERVAL:
            return False
        if len(self._cut_at) > 4096:
            self._cut_at.clear()
        self._cut_at[peer] = now
        with contextlib.suppress(OSError, zmq.ZMQError, ValueError):
            fd = frame.get(zmq.SRCFD)
            if isinstance(fd, int) and fd >= 0:
                dup = socket.socket(fileno=os.dup(fd))
                try:
                    if dup.type == socket.SOCK_STREAM:
                        dup.shutdown(socket.SHUT_RDWR)
                        return True
                finally:
                    dup.close()
        return False

    def close(self) -> None:
        for sock in [*self.monitors.values(), *([self.zap] if self.zap is not None else [])]:
            sock.close(linger=0)
