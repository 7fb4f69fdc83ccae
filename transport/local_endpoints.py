"""Endpoints for peers on this host: abstract Unix sockets, authenticated by a ticket instead of encrypted.

Every transport that listens also binds, on each channel's ROUTER, an abstract Unix socket
(`ipc://@sluice-<128 random bits>-ch<channel>`) next to its TCP port, and publishes both. A peer on this
host (by its TCP endpoints, as shared memory decides, and with those names listening in its own network
namespace) dials the Unix socket. With CURVE on, that listener runs ZeroMQ's PLAIN mechanism: the dialler
names itself and shows a ticket, HMAC(job secret, its name, that socket's name), which the ZAP handler
checks together with the connecting process's user (the kernel's SO_PEERCRED, in ZAP's address); the
connection's name is then the proven member's, as with CURVE. Nothing is encrypted: what passes through a
Unix socket can be read only by root (out of scope), as shared memory, never on a network. A name is
chosen at bind time, so nobody can hold it first; a dialler comes back to a name that went away only after
10 minutes (zmq_guard.LOCAL_RECONNECT_MS: a socket of a process that exited could be taken by another user
after it), and a ticket is good for its one name.
"""

from __future__ import annotations

import secrets
import sys
from collections.abc import Sequence

import zmq

from sluice.transport.config import on_this_host

#: ZeroMQ binds "ipc://@name" in the abstract namespace (Linux); a local endpoint's prefix
ABSTRACT = "ipc://@"
PREFIX = ABSTRACT + "sluice-"
#: the ZAP domain of local listeners starts so; the rest is the socket's name (the ticket is bound to it)
DOMAIN_PREFIX = "sluice-local:"
AVAILABLE = sys.platform == "linux" and zmq.has("ipc")
_LISTENING = 1 << 16  # /proc/net/unix's flag of a listening socket (__SO_ACCEPTCON)


def new_names(channels: int) -> list[str]:
    """One fresh local endpoint per channel (128 random bits shared by the transport's channels)."""
    token = secrets.token_hex(16)
    return [f"{PREFIX}{token}-ch{channel}" for channel in range(channels)]


def socket_name(endpoint: str) -> str:
    """A local endpoint's abstract socket name (without the leading NUL the kernel's address has)."""
    return endpoint[len(ABSTRACT):]


def domain_of(endpoint: str) -> str:
    """The ZAP domain a local listener at `endpoint` sets (its name, which the tickets to it name)."""
    return DOMAIN_PREFIX + socket_name(endpoint)


def split(endpoints: Sequence[str]) -> tuple[list[str], list[str]]:
    """A published list's network endpoints and its local ones."""
    local = [e for e in endpoints if e.startswith(PREFIX)]
    return [e for e in endpoints if not e.startswith(PREFIX)], local


def listening(endpoints: Sequence[str]) -> bool:
    """Whether every one of these local endpoints is a listening socket in this network namespace."""
    wanted = {"@" + socket_name(e) for e in endpoints}  # /proc/net/unix writes the NUL as "@"
    try:
        with open("/proc/net/unix") as table:
            lines = table.read().splitlines()[1:]
    except OSError:
        return False
    found = set()
    for line in lines:
        fields = line.split()
        if len(fields) == 8 and fields[7] in wanted and int(fields[3], 16) & _LISTENING:
            found.add(fields[7])
    return found == wanted


def choose(endpoints: Sequence[str], channels: int, own_host: str) -> tuple[list[str], bool]:
    """The endpoints to dial, one per channel, and whether they are the local ones: those when the peer runs
    on this host and they listen here (or when it published no others), else its network endpoints."""
    network, local = split(endpoints)
    nearby = not network or on_this_host(network, own_host)
    if len(local) >= channels and nearby and listening(local[:channels]):
        return local[:channels], True
    if not network:
        raise ValueError(f"the peer listens only on this host's Unix sockets, which are not here: {local[:1]}")
    return network[:channels], False


def peer_uid(address: bytes) -> int | None:
    """The user of the process that connected to a Unix socket, from ZAP's address ("localhost:UID:GID:PID"
    where the kernel gave its credentials); None when the address does not say."""
    parts = address.split(b":")
    if len(parts) != 4 or parts[0] != b"localhost" or not parts[1].isdigit():
        return None
    return int(parts[1])
