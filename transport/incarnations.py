"""Which process of a peer's name each of its connections to our ROUTERs comes from, told by its HELLO (pure).

A peer dials our ROUTER sockets under its name, and a process that replaces a dead one (a restarted
aggregator, ps.recover) dials them under the same name. What we keep per peer name would then mislead
us: replies queued for the dead process and the credit they hold, acknowledgements owed for what it
sent (an ACK to the new process frees shared-memory ring space it has not handed over: corruption),
our shared-memory segments it had mapped (the new one has not), its segments we mapped. So every
dealer's first message on each connection is a HELLO naming its transport (`process`, a random token
per transport). The first HELLO of a new token from a known peer forgets everything of the old
process; a later one on another channel, what arrived on that channel since (old messages still in
its socket). A HELLO precedes every other message of its connection, so nothing of the new process
is forgotten.
"""

from __future__ import annotations

from typing import Literal

from sluice.transport.wire import Message, WireError, meta_field

#: what a token may be: a transport makes one of 16 hexadecimal digits
MAX_TOKEN = 64
#: peers remembered at most (members only reach here; this bounds a job's misconfiguration)
MAX_PEERS = 1 << 16

Route = tuple[str, int]
Forget = Literal["", "peer", "route"]


def hello_token(msg: Message) -> str:
    """The HELLO's process token, checked (WireError)."""
    token: str = meta_field(msg, "process", str)
    if not 0 < len(token) <= MAX_TOKEN or not token.isalnum():
        raise WireError(f"a HELLO's process token must be 1..{MAX_TOKEN} letters or digits")
    return token


class Incarnations:
    """The process each peer's connections came from, and what a HELLO says to forget."""

    def __init__(self) -> None:
        self._process: dict[str, str] = {}
        self._route: dict[Route, str] = {}

    def hello(self, peer: str, channel: int, token: str) -> Forget:
        """"peer": a new process of `peer`'s name (forget everything of the old one); "route": forget what arrived
        on this channel before (the old process's); "": nothing to forget."""
        known = self._process.get(peer)
        if known is None and len(self._process) >= MAX_PEERS:
            return ""
        self._process[peer] = token
        before = self._route.get((peer, channel))
        self._route[peer, channel] = token
        if known is not None and known != token:
            return "peer"
        return "route" if before is not None and before != token else ""
