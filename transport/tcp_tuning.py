"""TCP congestion control per connection (transport.congestion_control), set as libzmq opens each connection.

libzmq does not expose TCP_CONGESTION, but its socket monitor reports each listener it opens (EVENT_LISTENING,
as bind() returns) and each connection it dials (EVENT_CONNECTED) with the descriptor's number; the transport's
I/O thread sets the algorithm on it then. The sender's algorithm is the one that counts, so both ends need it:
connections a listener accepts inherit its algorithm from their first packet, and the listener is set before
its address is published; a dialled connection is switched after its handshake (it began on the host's default).
Why a job would choose one: docs/priority.md (congestion control).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import socket
from contextlib import suppress
from pathlib import Path

log = logging.getLogger("sluice.transport")

AVAILABLE = Path("/proc/sys/net/ipv4/tcp_available_congestion_control")
ALLOWED = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control")
_NAME = re.compile(r"[a-z][a-z0-9_]{0,14}")


def check_congestion_control(name: str) -> None:
    """Refuse, saying what to do, a name that is no algorithm or that this kernel has not loaded."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"transport.congestion_control must name a Linux TCP congestion control such as cubic or "
                         f"bbr (lower case, at most 15 characters), got {name!r:.40}; empty: the system's default")
    if not AVAILABLE.exists():  # not Linux: the setting is for the job's Linux hosts
        return
    available = AVAILABLE.read_text().split()
    if name not in available:
        raise ValueError(f"transport.congestion_control {name!r} is not available in this kernel (it has "
                         f"{' '.join(available)}); load it as root (modprobe tcp_{name}) or choose one of those")


def _port(endpoint: str) -> int | None:
    """The port of a tcp:// endpoint; None for any other transport (a Unix socket has no congestion)."""
    match = re.fullmatch(r"tcp://\[?[^\]]*\]?:(\d+)", endpoint)
    return int(match.group(1)) if match else None


def set_congestion_control(fd: int, endpoint: str, listener: bool, name: str) -> bool:
    """Set `name` on the TCP socket `fd` that libzmq just opened: a listener on `endpoint`, or a connection it
    dialled to `endpoint`; whether it was set. The descriptor is checked to be that socket first: the event is
    read after the fact, and a connection that closed meanwhile may have left its number to another descriptor.

    OSError when the kernel refuses the algorithm (not allowed to this process, or not loaded)."""
    port = _port(endpoint)
    if port is None or fd < 0:
        return False
    try:
        conn = socket.socket(fileno=os.dup(fd))  # a duplicate: libzmq keeps, and closes, its own
    except OSError:
        return False  # closed meanwhile
    with conn:
        try:
            if conn.type != socket.SOCK_STREAM or conn.family not in (socket.AF_INET, socket.AF_INET6):
                return False
            # the port tells: ours for a listener (a wildcard bind names no host), the peer's for a dialled
            # connection (whose host libzmq may have resolved from a name)
            if (conn.getsockname() if listener else conn.getpeername())[1] != port:
                return False
        except OSError:
            return False  # not connected any more
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())
    return True


def refusal_advice(name: str, exc: OSError) -> str:
    """What to do when the kernel refused `name` on a connection."""
    if exc.errno == errno.EPERM:
        allowed = ""
        with suppress(OSError):
            allowed = ALLOWED.read_text().strip()
        return (f"this process may not use {name!r} (allowed to processes without CAP_NET_ADMIN: {allowed or '?'}); "
                f"as root, sysctl -w net.ipv4.tcp_allowed_congestion_control='{allowed} {name}', or give the job "
                "CAP_NET_ADMIN, or leave transport.congestion_control empty")
    if exc.errno == errno.ENOENT:
        return f"the kernel has no {name!r}: as root, modprobe tcp_{name}, or leave transport.congestion_control empty"
    return f"{os.strerror(exc.errno or 0)}; leave transport.congestion_control empty to keep the system's default"
