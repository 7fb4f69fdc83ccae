"""Members' CURVE keys and Unix-socket tickets, derived from the job secret; ZAP answers that admit only them.

Every process of a job holds the job secret (made by the launcher, handed to each child through an
inherited pipe, never on a command line or in a log). From it each member name ("scheduler",
"server-0", "worker-3", ...) gets its own CURVE key pair: secret key = HMAC-SHA256(job secret,
name). So every member can compute every member's public key (a DEALER must know its server's key
before the handshake) and a listening socket can tell, from the key a client proved it holds, which
member it is: that name becomes the connection's ZAP User-Id, and the transport drops any message
whose self-chosen ZeroMQ identity differs from it. A process without the secret cannot complete a
handshake at all: it does not know the servers' public keys, and no key it has maps to a member.
At a listener's Unix socket (peers on one host: local_endpoints.py) a member shows a ticket instead,
HMAC-SHA256(job secret, its name, that socket's name), from a process of our user. A secret kept
in a file (`sluice node --secret-file`, `jobs.registry_secret_file`) is read by `read_secret_file`,
which refuses one that others can read.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import stat
from collections.abc import Callable, Iterable, Sequence

import zmq
import zmq.utils.z85

from sluice.transport.local_endpoints import DOMAIN_PREFIX, PREFIX, domain_of, peer_uid

_CONTEXT = b"sluice curve key v1\x00"
_SEAL_CONTEXT = b"sluice seal key v1\x00"
_LOCAL_CONTEXT = b"sluice local ticket v1\x00"
_TICKET_CONTEXT = b"sluice seal ticket v1\x00"
MIN_SECRET_BYTES = 16
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_VERSION = b"1.0"
#: ZAP domains of sealed network listeners start so; the rest is the channel's number (transport/zmq_seal.py)
SEALED_PREFIX = b"sluice-seal-ch"
#: bytes of a sealed connection's session (random per dialling socket)
SESSION_BYTES = 16
#: the metadata property that tells a sealed connection's session (ZAP reply; read from every message)
SESSION_PROPERTY = b"X-Session"
_MAC_BYTES = 32


def canonical_address(text: str) -> str:
    """An IP address as both ends write it (brackets, zone and IPv4-mapped IPv6 removed); '' if not one."""
    text = text.strip().strip("[]").split("%", 1)[0]
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return ""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return str(address)


class JobKeys:
    """The key pairs of a job's members; `member` maps a client's public key back to its name."""

    def __init__(self, secret: bytes, members: Iterable[str]) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"a job secret needs at least {MIN_SECRET_BYTES} bytes, got {len(secret)}")
        self._secret = secret
        self._public: dict[str, bytes] = {}
        self._members: dict[bytes, str] = {}  # raw 32-byte public key -> member name
        self.names = frozenset(members)
        for name in self.names:
            self._members[zmq.utils.z85.decode(self.public_key(name))] = name

    def __repr__(self) -> str:  # never show the secret, whatever logs this object
        return f"JobKeys({len(self._members)} members)"

    def secret_key(self, name: str) -> bytes:
        """The Z85-encoded CURVE secret key of member `name`."""
        raw = hmac.new(self._secret, _CONTEXT + name.encode(), hashlib.sha256).digest()
        return bytes(zmq.utils.z85.encode(raw))

    def seal_key(self, sender: str, receiver: str, channel: int, session: bytes) -> bytes:
        """The 32-byte AES-256-GCM key of the messages `sender` sends `receiver` on `channel` of the
        connection whose (random, per connection) `session` both know (transport/seal.py)."""
        if not sender or not receiver or "\0" in sender + receiver or not 0 <= channel < 256 or not session:
            raise ValueError("a sealing key needs two member names without NUL, a channel in [0, 256), a session")
        context = b"\0".join((_SEAL_CONTEXT, sender.encode(), receiver.encode(), bytes([channel]), session))
        return hmac.new(self._secret, context, hashlib.sha256).digest()

    def seal_ticket(self, name: str, receiver: str, channel: int, session: bytes, address: str) -> bytes:
        """The PLAIN password with which member `name` dials `receiver`'s sealed listener on `channel` from
        `address`, for the connection of `session` (transport/zmq_seal.py): the session, a MAC of all of
        these (raw bytes), and the address (in clear: a listener that sees another one can say so)."""
        return session + self._ticket_mac(name, receiver, channel, session, address) + address.encode()

    def _ticket_mac(self, name: str, receiver: str, channel: int, session: bytes, address: str) -> bytes:
        context = b"\0".join((_TICKET_CONTEXT, name.encode(), receiver.encode(), bytes([channel]), session,
                              address.encode()))
        return hmac.new(self._secret, context, hashlib.sha256).digest()

    def local_ticket(self, name: str, domain: bytes) -> bytes:
        """The PLAIN password with which member `name` dials the local listener of ZAP domain `domain`
        (transport/local_endpoints.py): bound to that one socket."""
        context = _LOCAL_CONTEXT + name.encode() + b"\0" + domain
        return hmac.new(self._secret, context, hashlib.sha256).hexdigest().encode()

    def public_key(self, name: str) -> bytes:
        """The Z85-encoded CURVE public key of member `name` (cached: a scalar multiplication each)."""
        key = self._public.get(name)
        if key is None:
            key = self._public[name] = bytes(zmq.curve_public(self.secret_key(name)))
        return key

    def member(self, raw_public_key: bytes) -> str | None:
        """The member holding this (raw, 32-byte) public key, or None for a stranger."""
        return self._members.get(raw_public_key)

    def secure_server(self, sock: zmq.Socket[bytes], name: str) -> None:
        """Make a listening socket a CURVE server with `name`'s keys (clients are checked by ZAP)."""
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret_key(name))
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public_key(name))

    def secure_client(self, sock: zmq.Socket[bytes], name: str, server: str) -> None:
        """Make a connecting socket a CURVE client of member `server`, proving it is `name`."""
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.public_key(server))
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public_key(name))
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret_key(name))

    def secure_dialer(self, sock: zmq.Socket[bytes], name: str, server: str, endpoint: str) -> None:
        """Make a connecting socket prove it is member `name` to member `server` listening at `endpoint`: with
        its ticket at a local Unix socket (local_endpoints.py), else as a CURVE client that checks the server."""
        if endpoint.startswith(PREFIX):
            sock.setsockopt(zmq.PLAIN_USERNAME, name.encode())
            sock.setsockopt(zmq.PLAIN_PASSWORD, self.local_ticket(name, domain_of(endpoint).encode()))
        else:
            self.secure_client(sock, name, server)

    def zap_reply(self, request: Sequence[bytes], receiver: str = "",
                  admitted: Callable[[str, int, bytes | None], None] | None = None) -> list[bytes]:
        """The reply to one ZAP request at member `receiver`'s listener: 200 with the member's name as User-Id
        (and, on a sealed or local listener, the connection's session as metadata), or 400 for a stranger.
        `admitted(name, channel, session or None)` hears of each member let in at a sealed or local listener.

        Request frames (RFC 27): version, request id, domain, address, identity, mechanism, credentials.
        """
        if len(request) < 6 or request[0] != ZAP_VERSION:
            return [ZAP_VERSION, request[1] if len(request) > 1 else b"", b"500", b"malformed request", b"", b""]
        request_id, domain, address = request[1], request[2], request[3]
        mechanism, credentials = request[5], request[6:]
        session: bytes | None = None
        why = b"not a member of this job"
        local = domain.startswith(DOMAIN_PREFIX.encode())
        digits = domain.rpartition(b"ch")[2]  # local and sealed listeners' domains end in their channel
        channel = int(digits) if digits.isdigit() and len(digits) <= 3 else -1
        if local:  # a local listener: PLAIN, our user, a ticket for this socket
            name = self._local_member(domain, address, credentials) if mechanism == b"PLAIN" else None
        elif domain.startswith(SEALED_PREFIX):  # a sealed network listener: PLAIN, a ticket for this address
            name, session, why = self._sealed_member(receiver, channel, address, mechanism, credentials)
        else:
            name = self.member(credentials[0]) if mechanism == b"CURVE" and len(credentials) == 1 else None
        if name is None:
            return [ZAP_VERSION, request_id, b"400", why, b"", b""]
        if not local and session is None:  # CURVE
            return [ZAP_VERSION, request_id, b"200", b"OK", name.encode(), b""]
        if admitted is not None:
            admitted(name, channel, session)
        told = session.hex().encode() if session is not None else b""
        metadata = bytes([len(SESSION_PROPERTY)]) + SESSION_PROPERTY + len(told).to_bytes(4, "big") + told
        return [ZAP_VERSION, request_id, b"200", b"OK", name.encode(), metadata]

    def _sealed_member(self, receiver: str, channel: int, address: bytes, mechanism: bytes,
                       credentials: Sequence[bytes]) -> tuple[str | None, bytes | None, bytes]:
        """(name, session, '') of a valid sealed ticket shown from `address`, else (None, None, why not)."""
        stranger = (None, None, b"not a member of this job")
        if mechanism != b"PLAIN" or len(credentials) != 2 or not receiver or not 0 <= channel < 256:
            return stranger
        name = credentials[0].decode("utf-8", "replace")
        ticket = credentials[1]
        session, mac = ticket[:SESSION_BYTES], ticket[SESSION_BYTES:SESSION_BYTES + _MAC_BYTES]
        try:
            claimed_address = ticket[SESSION_BYTES + _MAC_BYTES:].decode("ascii")
        except UnicodeDecodeError:
            return stranger
        if name not in self.names or len(mac) != _MAC_BYTES:
            return stranger
        if canonical_address(claimed_address) != claimed_address:  # it may be logged: an address, nothing else
            return stranger
        source = canonical_address(address.decode("ascii", "replace"))
        if hmac.compare_digest(mac, self._ticket_mac(name, receiver, channel, session, source)):
            return name, session, b""
        if claimed_address != source and hmac.compare_digest(
                mac, self._ticket_mac(name, receiver, channel, session, claimed_address)):
            return None, None, (f"{name} dialled from {claimed_address} but its connection comes from "
                                f"{source}").encode()
        return stranger

    def _local_member(self, domain: bytes, address: bytes, credentials: Sequence[bytes]) -> str | None:
        if len(credentials) != 2 or peer_uid(address) != os.getuid():
            return None
        name = credentials[0].decode("utf-8", "replace")
        if name not in self.names or not hmac.compare_digest(credentials[1], self.local_ticket(name, domain)):
            return None
        return name


MAX_SECRET_FILE = 4096


class SecretFileError(ValueError):
    """A secret file that cannot be used: unreadable, readable by others, too short or too long."""


def read_secret_file(path: str) -> bytes:
    """The job secret in `path`, without surrounding whitespace; refused if others can read the file."""
    try:  # O_NONBLOCK: a FIFO put there is refused below instead of blocking this open
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise SecretFileError(f"cannot read the secret file {path}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)  # of what was opened, so the file checked is the file read
        if not stat.S_ISREG(info.st_mode):
            raise SecretFileError(f"the secret file {path} is not a regular file: write the job secret into a file "
                                  "(on Kubernetes: mount the Secret as a volume)")
        if info.st_mode & 0o007:
            mode = stat.S_IMODE(info.st_mode)
            raise SecretFileError(f"the secret file {path} can be read by others (mode {mode:04o}): run chmod 600 "
                                  f"{path} (on Kubernetes: give the Secret volume defaultMode 0400)")
        data = b""
        while len(data) <= MAX_SECRET_FILE and (chunk := os.read(fd, MAX_SECRET_FILE + 1 - len(data))):
            data += chunk
    finally:
        os.close(fd)
    if len(data) > MAX_SECRET_FILE:
        raise SecretFileError(f"the secret file {path} holds more than {MAX_SECRET_FILE} bytes: is it the job secret?")
    secret = data.strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise SecretFileError(f"the secret file {path} holds {len(secret)} bytes (without whitespace); a job secret "
                              f"needs at least {MIN_SECRET_BYTES}: make one with `openssl rand -hex 32`")
    return secret
