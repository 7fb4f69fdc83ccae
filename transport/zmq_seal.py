"""Sealed TCP data connections: each one's session, its sealer and opener in both directions, and its dialling.

With `transport.cipher = "aes-gcm"` (the default), a data transport's TCP connections do not run CURVE. The
dialler (a DEALER) picks a random session per socket and proves itself with ZeroMQ's PLAIN mechanism: its
name, and a ticket `JobKeys.seal_ticket` binds to its name, the listener's name and channel, the session and
the address it dials from (forced on the socket, so the listener sees that very address). The listener's
ZAP handler (`JobKeys.zap_reply`) admits only a ticket that checks out for the address the connection
really comes from, makes the name the connection's User-Id and the session its `X-Session` property, and
tells this table. Every message on such a connection is then sealed in both directions under keys derived
from the job secret, both names, the channel and the session (transport/seal.py, `JobKeys.seal_key`).
Connections over a Unix socket (peers on one host) and the scheduler's (control) connections are not
sealed: they keep what they had (tickets; CURVE). docs/security.md says what this defends, and why.
"""

from __future__ import annotations

import secrets
import socket
from collections.abc import Sequence
from typing import Any

import zmq

from sluice.transport.auth import SEALED_PREFIX, SESSION_BYTES, SESSION_PROPERTY, JobKeys, canonical_address
from sluice.transport.seal import Opener, Sealer
from sluice.transport.wire import WireError

#: sealed sessions a listener keeps openers for (members' sockets only: a session needs a valid ticket), the oldest
#: dropped first
MAX_SESSIONS = 1 << 16


def sealed_domain(channel: int) -> bytes:
    return SEALED_PREFIX + str(channel).encode()


def source_route(endpoint: str) -> tuple[str, str]:
    """(what to connect, the address it leaves from) for a TCP `endpoint`: the source the kernel would pick
    for that destination, forced on the connection (libzmq's `tcp://SOURCE:0;HOST:PORT`), so that the
    ticket names the address the listener will see. OSError when the host has no route to it."""
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"a sealed connection dials TCP, not {endpoint!r:.80}")
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    host = host.strip("[]")
    family, _, _, _, destination = socket.getaddrinfo(host, int(port), type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:  # a UDP connect sends nothing: it only routes
        probe.connect(destination)
        source = canonical_address(probe.getsockname()[0])
    shown = f"[{source}]" if ":" in source else source
    return f"tcp://{shown}:0;{endpoint[len('tcp://'):]}", source


class Seals:
    """The sealers and openers of one transport's sealed connections; used on its I/O thread only."""

    def __init__(self, name: str, keys: JobKeys) -> None:
        self._name, self._keys = name, keys
        #: connections we dialled: by DEALER socket, what seals our messages and opens the listener's
        self._dialled: dict[zmq.Socket[bytes], tuple[Sealer, Opener]] = {}
        #: connections to our listeners: by (peer, channel, session), what opens theirs and seals our replies
        self._accepted: dict[tuple[str, int, str], tuple[Sealer, Opener]] = {}
        #: the session of each (peer, channel)'s newest connection, where our replies go (ROUTER_HANDOVER)
        self._newest: dict[tuple[str, int], str] = {}

    def dial(self, sock: zmq.Socket[bytes], peer: str, channel: int, endpoint: str) -> str:
        """Prove this member on `sock` (before it connects) to `peer` listening at TCP `endpoint` on `channel`;
        keep the connection's sealer and opener. What to connect (the source address forced)."""
        try:
            dialled, source = source_route(endpoint)
        except OSError as exc:  # the ticket names the address we leave from: without a route there is none
            raise OSError(exc.errno, f"cannot dial {peer} at {endpoint}: this host has no route there "
                          f"({exc.strerror or exc})") from None
        session = secrets.token_bytes(SESSION_BYTES)
        sock.setsockopt(zmq.PLAIN_USERNAME, self._name.encode())
        sock.setsockopt(zmq.PLAIN_PASSWORD, self._keys.seal_ticket(self._name, peer, channel, session, source))
        self._dialled[sock] = (Sealer(self._keys.seal_key(self._name, peer, channel, session)),
                               Opener(self._keys.seal_key(peer, self._name, channel, session)))
        return dialled

    def connections(self) -> int:
        """Sealed connections this transport dialled or admitted (a reconnect keeps its session: not counted)."""
        return len(self._dialled) + len(self._accepted)

    def sealer(self, sock: zmq.Socket[bytes]) -> Sealer | None:
        """What seals the messages of `sock`, a DEALER we dialled (None: not sealed)."""
        pair = self._dialled.get(sock)
        return pair[0] if pair is not None else None

    def hung_up(self, sock: zmq.Socket[bytes]) -> None:
        self._dialled.pop(sock, None)

    def admitted(self, peer: str, channel: int, session: bytes | None) -> None:
        """The ZAP handler let `peer` in on `channel`: sealed under `session`, or (None) over a Unix socket."""
        if session is None:
            self._newest.pop((peer, channel), None)
            return
        tag = session.hex()
        self._newest[peer, channel] = tag
        if (peer, channel, tag) not in self._accepted:
            if len(self._accepted) >= MAX_SESSIONS:  # the oldest session: long replaced (a member dials 1 a channel)
                del self._accepted[next(iter(self._accepted))]
            self._accepted[peer, channel, tag] = (Sealer(self._keys.seal_key(self._name, peer, channel, session)),
                                                  Opener(self._keys.seal_key(peer, self._name, channel, session)))

    def seal(self, frames: Sequence[Any], sock: zmq.Socket[bytes] | None, peer: str, channel: int) -> Sequence[Any]:
        """`frames` as they go out to `peer` on `channel`: on `sock` (a DEALER we dialled) or, None, on our
        listener, to that peer's newest connection; sealed where that connection is."""
        if sock is not None:
            pair = self._dialled.get(sock)
        else:
            tag = self._newest.get((peer, channel))
            pair = self._accepted.get((peer, channel, tag)) if tag is not None else None
        return frames if pair is None else pair[0].seal(frames)

    def open(self, frames: list[Any], sock: zmq.Socket[bytes] | None, peer: str, channel: int) -> list[Any]:
        """The plain frames of a message that came from `peer` on `channel`, on `sock` (a DEALER we dialled) or,
        None, on our listener; WireError for one that is not sealed where its connection is, or does not open."""
        if sock is not None:
            pair = self._dialled.get(sock)
            return frames if pair is None else pair[1].open(frames)
        tag = frames[0].get(SESSION_PROPERTY.decode()) if frames else ""
        if not tag:  # a connection over a Unix socket (its ZAP reply tells no session)
            return frames
        pair = self._accepted.get((peer, channel, tag))
        if pair is None:
            raise WireError("a sealed connection whose session is not known here")
        return pair[1].open(frames)
