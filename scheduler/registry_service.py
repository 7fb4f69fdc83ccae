"""The cluster's job registry served over ZeroMQ: one scheduler keeps every job's entry; the others report and read.

Each scheduler with `jobs.registry = "HOST:PORT"` sends its JobState about once a second on a DEALER
and gets the whole table back in the reply (one request, one reply: scheduler/registry_client.py).
The table lives in a thread of a scheduler on HOST that bound PORT (RegistryServer); it is soft
state, rebuilt within a second by the reports, so whichever scheduler binds the port next (when the
serving job ends) serves the same table without replicating anything. Every request is checked like
the per-host files (size, schema, ranges, scheduler/jobs_registry.py parse_state); a malformed one
gets no reply and is counted, and the server goes on. With a registry secret, the ROUTER is a CURVE
server and a ZAP handler admits only clients whose key derives from it (transport/auth.py JobKeys), so
a process without the secret never gets a request through; its failed handshakes are counted too.
"""

from __future__ import annotations

import json
import logging
import socket
from dataclasses import asdict, dataclass

from sluice.scheduler.jobs_registry import MAX_ENTRY_BYTES, JobState, parse_state
from sluice.transport.auth import JobKeys, read_secret_file
from sluice.transport.request_server import RequestServer, json_within

log = logging.getLogger("sluice.scheduler")

PROTOCOL = 1
#: the member names the registry's keys derive from (transport/auth.py): the server and any scheduler
SERVER_NAME, CLIENT_NAME = "registry", "registry-client"
MAX_REQUEST_BYTES = MAX_ENTRY_BYTES + 512
#: entries the table holds; a new job beyond it is refused (a flood of invented jobs cannot grow memory)
MAX_JOBS = 1024
#: one entry's JSON is under 2 KiB even with a 200-character job name escaped as \\uXXXX
MAX_REPLY_BYTES = MAX_JOBS * 2048 + 1024
#: libzmq drops the connection of a peer announcing a bigger frame before reading its body; requests
#: between MAX_REQUEST_BYTES and this are read, refused and counted
REQUEST_FRAME_CAP = 64 * 1024
#: an entry its scheduler has not refreshed for this long is dropped (the server's own clock: hosts' clocks differ)
SERVED_STALE_S = 10.0
_OPS = ("report", "withdraw", "list")


def registry_keys(secret: bytes) -> JobKeys:
    """The registry's CURVE keys, derived from the cluster's registry secret as a job's are from its job secret."""
    return JobKeys(secret, (SERVER_NAME, CLIENT_NAME))


def load_keys(secret_file: str, curve: bool) -> JobKeys | None:
    """The keys from jobs.registry_secret_file; None (unauthenticated) only where the job runs without CURVE."""
    if not secret_file:
        if curve:
            raise ValueError("jobs.registry is set but jobs.registry_secret_file is not: give every host the same "
                             "registry secret in a file (chmod 600; make one with `openssl rand -hex 32`), or "
                             "run with transport.curve = false on a network you trust")
        return None
    return registry_keys(read_secret_file(secret_file))


def split_endpoint(text: str) -> tuple[str, int]:
    """("HOST", PORT) of "HOST:PORT" (IPv6 as "[::1]:PORT"); ValueError unless it is one."""
    host, colon, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, e.g. node1:29450, got {text!r}")
    return host, int(port)


def local_addresses(host: str) -> list[str]:
    """The addresses HOST resolves to (a scheduler may serve the registry only on one of its own)."""
    try:
        return sorted({str(info[4][0]) for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)})
    except OSError:
        return []


@dataclass(frozen=True)
class Request:
    seq: int
    op: str  # report | withdraw | list
    state: JobState | None = None
    job: str = ""


def encode_request(request: Request) -> bytes:
    body: dict[str, object] = {"v": PROTOCOL, "seq": request.seq, "op": request.op}
    if request.op == "report":
        assert request.state is not None
        body["state"] = asdict(request.state)
    if request.op == "withdraw":
        body["job"] = request.job
    return json.dumps(body).encode()


def parse_request(data: bytes) -> Request:
    """A request, or ValueError saying what is wrong with it."""
    raw = json_within(data, MAX_REQUEST_BYTES, "")
    keys = {"report": {"v", "seq", "op", "state"}, "withdraw": {"v", "seq", "op", "job"}, "list": {"v", "seq", "op"}}
    if type(raw) is not dict or raw.get("op") not in _OPS or set(raw) != keys[raw["op"]]:
        raise ValueError("not a registry request (v, seq, op and its field)")
    if raw["v"] != PROTOCOL or type(raw["seq"]) is not int or not 0 <= raw["seq"] < 1 << 53:
        raise ValueError(f"protocol {raw['v']!r:.20} or sequence number out of range")
    if raw["op"] == "report":
        state = parse_state(raw["state"])
        if state is None:
            raise ValueError("a job state without its fields, types or ranges")
        return Request(raw["seq"], "report", state=state)
    if raw["op"] == "withdraw":
        if type(raw["job"]) is not str or not 0 < len(raw["job"]) <= 200:
            raise ValueError("withdraw without a job name")
        return Request(raw["seq"], "withdraw", job=raw["job"])
    return Request(raw["seq"], "list")


def encode_reply(seq: int, jobs: list[JobState], refused: int) -> bytes:
    return json.dumps({"v": PROTOCOL, "seq": seq, "jobs": [asdict(j) for j in jobs], "refused": refused}).encode()


def parse_reply(data: bytes) -> tuple[int, list[JobState], int]:
    """(seq, the cluster's jobs, messages the registry refused), or ValueError: a reply is checked like a request."""
    raw = json_within(data, MAX_REPLY_BYTES, "a reply ")
    if (type(raw) is not dict or set(raw) != {"v", "seq", "jobs", "refused"} or raw["v"] != PROTOCOL
            or type(raw["seq"]) is not int or type(raw["refused"]) is not int or raw["refused"] < 0
            or type(raw["jobs"]) is not list or len(raw["jobs"]) > MAX_JOBS):
        raise ValueError("not a registry reply")
    jobs = [parse_state(entry) for entry in raw["jobs"]]
    if any(state is None for state in jobs):
        raise ValueError("a reply with a malformed job entry")
    return raw["seq"], [j for j in jobs if j is not None], raw["refused"]


class RegistryServer:
    """The table of the cluster's jobs, served on a ROUTER by a thread of its own until close()."""

    def __init__(self, address: str, port: int, keys: JobKeys | None, stale_s: float = SERVED_STALE_S) -> None:
        """Bind address:port (zmq.ZMQError when it cannot: taken, or not this host's) and start serving."""
        self.stale_s = stale_s
        self._table: dict[str, tuple[JobState, float]] = {}
        self._server = RequestServer(SERVER_NAME, address, port, keys, REQUEST_FRAME_CAP, self._answer, log,
                                     "job registry")
        self.endpoint, self.rejects = self._server.endpoint, self._server.rejects
        self._server.start()

    @property
    def refused(self) -> int:
        """Requests refused (malformed, oversized, too many jobs) and handshakes failed (no registry secret)."""
        return self._server.refused

    def _answer(self, peer: str, data: bytes, now: float) -> bytes:
        request = parse_request(data)
        if request.op == "report":
            assert request.state is not None
            if request.state.job not in self._table and len(self._table) >= MAX_JOBS:
                raise ValueError(f"the registry holds {MAX_JOBS} jobs already")
            self._table[request.state.job] = (request.state, now)
        elif request.op == "withdraw":
            self._table.pop(request.job, None)
        self._table = {job: entry for job, entry in self._table.items() if now - entry[1] <= self.stale_s}
        jobs = sorted((state for state, _ in self._table.values()), key=lambda s: s.started)
        return encode_reply(request.seq, jobs, self.refused)

    def close(self) -> None:
        self._server.close()
