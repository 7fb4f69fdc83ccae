"""How a launched process learns its job: the one place that reads SLUICE_* variables of a child.

The job secret is not among them: the launcher writes it into a pipe whose read end the child
inherits, and SLUICE_SECRET_FD names that descriptor. So the secret never appears in a command line,
in the environment (which tools and experiment trackers like to record) or in a log; it is read once
and the descriptor closed, so the worker's own subprocesses do not inherit it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sluice.errors import SluiceError
from sluice.transport.auth import MIN_SECRET_BYTES, JobKeys
from sluice.transport.config import TransportConfig

ENV_SCHEDULER = "SLUICE_SCHEDULER"
#: the standby scheduler's endpoint (scheduler.standby), which the nodes rejoin when the scheduler falls silent
ENV_STANDBY = "SLUICE_SCHEDULER_STANDBY"
#: "1": the schedulers form a ring (`sluice node` under Kubernetes, which starts a lost scheduler's pod again as a
#: standby at the same address): after the last standby, the nodes rejoin the scheduler's endpoint, and so on
ENV_STANDBY_RING = "SLUICE_STANDBY_RING"
#: how many pods of this index failed before this one (`sluice node` under Kubernetes: launch/node.py)
ENV_INDEX_FAILURES = "SLUICE_INDEX_FAILURES"
ENV_ROLE = "SLUICE_ROLE"
ENV_RANK = "SLUICE_RANK"
ENV_WORKERS = "SLUICE_NUM_WORKERS"
ENV_SERVERS = "SLUICE_NUM_SERVERS"
ENV_AGGREGATORS = "SLUICE_NUM_AGGREGATORS"
ENV_CONFIG = "SLUICE_CONFIG_JSON"
ENV_SECRET_FD = "SLUICE_SECRET_FD"
#: an elastic job's (sluice launch --elastic): the directory of the workers' commits on this host, the
#: generation, and the exit status by which a worker asks for the next generation
ENV_ELASTIC_DIR = "SLUICE_ELASTIC_DIR"
ENV_ELASTIC_GENERATION = "SLUICE_ELASTIC_GENERATION"
#: --elastic --in-place: the survivors of a lost worker re-form the job in their own processes
ENV_ELASTIC_IN_PLACE = "SLUICE_ELASTIC_IN_PLACE"
REFORM_EXIT = 75
SECRET_BYTES = 32
_MAX_SECRET_BYTES = 4096
#: secrets already read in this process, by descriptor (a script may call init() again)
_secrets_read: dict[int, bytes] = {}


def new_secret() -> bytes:
    """A fresh job secret (the launcher makes one per job)."""
    return secrets.token_bytes(SECRET_BYTES)


def secret_pipe(secret: bytes) -> int:
    """A descriptor a child inherits to read `secret` from; the caller closes it after starting the child."""
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, secret)  # 32 bytes: far below a pipe's buffer, never blocks
    finally:
        os.close(write_end)
    os.set_inheritable(read_end, True)
    return read_end


def read_secret(fd: int) -> bytes:
    """The job secret from an inherited pipe (closed after reading); cached for later calls."""
    if fd in _secrets_read:
        return _secrets_read[fd]
    chunks = []
    try:
        while chunk := os.read(fd, _MAX_SECRET_BYTES):
            chunks.append(chunk)
            if sum(map(len, chunks)) > _MAX_SECRET_BYTES:
                raise SluiceError(f"{ENV_SECRET_FD}={fd} holds more than a job secret")
    except OSError as exc:
        raise SluiceError(f"cannot read the job secret from {ENV_SECRET_FD}={fd}: {exc.strerror}") from None
    finally:
        os.close(fd)
    secret = _secrets_read[fd] = b"".join(chunks)
    return secret


def node_name(role: str, rank: int) -> str:
    """A member's name on the wire; with CURVE it is bound to the member's key."""
    return role if role == "scheduler" else f"{role}-{rank}"


def member_names(workers: int, servers: int, aggregators: int = 0) -> list[str]:
    return ["scheduler", *(node_name("server", r) for r in range(servers)),
            *(node_name("worker", r) for r in range(workers)),
            *(node_name("aggregator", r) for r in range(aggregators))]


@dataclass(frozen=True)
class NodeEnv:
    scheduler: str
    role: str
    rank: int
    workers: int
    servers: int
    #: the launcher's resolved configuration, one dict per section ("transport", "scheduler", ...)
    config: dict[str, Any]
    #: the job secret (empty: none given); never printed, never in to_environ()
    secret: bytes = field(default=b"", repr=False, compare=False)
    #: aggregator processes of the job (sum the pushes of a rack and forward one stream up: ps/aggregator.py)
    aggregators: int = 0
    #: the standby schedulers' endpoints, comma-separated, in the order the nodes rejoin them ("": none); a
    #: scheduler started with rank k >= 1 is the k-th standby
    standby: str = ""
    #: the schedulers' endpoints form a ring (ENV_STANDBY_RING): every one of them is started again as a standby
    #: when lost, so a node that rejoined the last standby rejoins the scheduler's endpoint next, and so on
    ring: bool = False

    def standbys(self) -> list[str]:
        """The standby schedulers' endpoints, in the order the nodes rejoin them."""
        return [endpoint for endpoint in self.standby.split(",") if endpoint]

    def next_scheduler(self, rejoins: int, unanswered: int) -> str | None:
        """The endpoint a node rejoins at its failover number `rejoins` (0: the first), `unanswered` of them in a
        row without a standby taking over; None: none left. In a ring, a full round of silent endpoints is the
        end: every scheduler was tried once since one last answered."""
        standbys = self.standbys()
        if not self.ring:
            return standbys[rejoins] if rejoins < len(standbys) else None
        ring = [*standbys, self.scheduler]
        return ring[rejoins % len(ring)] if standbys and unanswered < len(ring) else None

    def to_environ(self) -> dict[str, str]:
        return {
            **({ENV_STANDBY: self.standby} if self.standby else {}),
            **({ENV_STANDBY_RING: "1"} if self.ring else {}),
            ENV_SCHEDULER: self.scheduler,
            ENV_ROLE: self.role,
            ENV_RANK: str(self.rank),
            ENV_WORKERS: str(self.workers),
            ENV_SERVERS: str(self.servers),
            ENV_AGGREGATORS: str(self.aggregators),
            ENV_CONFIG: json.dumps(self.config, sort_keys=True),
        }

    def section(self, name: str) -> dict[str, Any]:
        value = self.config.get(name, {})
        return dict(value) if isinstance(value, dict) else {}

    def transport_config(self) -> TransportConfig:
        section = self.section("transport")
        for key in ("tos", "so_priority", "channel_levels"):
            if key in section:
                section[key] = tuple(section[key])
        return TransportConfig(**section)

    @property
    def name(self) -> str:
        return node_name(self.role, self.rank)

    @property
    def members(self) -> list[str]:
        """The names of every process of this job."""
        return member_names(self.workers, self.servers, self.aggregators)

    def job_keys(self) -> JobKeys | None:
        """The job's CURVE keys; None when transport.curve is off. Refuses to run unauthenticated by accident."""
        if not self.transport_config().curve:
            return None
        if len(self.secret) < MIN_SECRET_BYTES:
            raise SluiceError(
                "transport.curve is on (the default) but this process was given no job secret: start it with "
                f"`sluice launch`, which hands one to every process (through {ENV_SECRET_FD}), or turn "
                "authentication and encryption off with transport.curve = false on a network you trust"
            )
        if self.role != "scheduler" and self.rank < 0:
            raise SluiceError(f"{ENV_RANK} must be set for a {self.role} when transport.curve is on")
        return JobKeys(self.secret, self.members)

    def fingerprint(self) -> str:
        """Identifies the job-wide settings, so the scheduler can refuse a node configured differently.

        `transport.host` is left out: it is where this node listens, which differs from host to host; and
        `scheduler.port`, where the scheduler listens: the others find it at the endpoint they are given
        (a job that shrank in place moves its scheduler to a new port, launch/generations.py).
        """
        shared = {name: dict(self.section(name)) for name in self.config}
        shared.get("transport", {}).pop("host", None)
        shared.get("scheduler", {}).pop("port", None)
        shared.get("scheduler", {}).pop("standby_port", None)  # the same for its standby
        return json.dumps(shared, sort_keys=True)


def state_tag(secret: bytes) -> str:
    """The job's name in this host's shared memory (servers' state files, local groups' stores): every member
    of a job (a replacement too) can compute it; other jobs and users cannot guess it."""
    return hmac.new(secret, b"state", hashlib.sha256).hexdigest()[:16]


def elastic_generation(environ: Mapping[str, str] | None = None) -> int:
    """The generation of the elastic job this process serves (ENV_ELASTIC_GENERATION, which the launcher gives its
    workers and schedulers); 0 when there is none."""
    raw = (os.environ if environ is None else environ).get(ENV_ELASTIC_GENERATION, "0")
    return int(raw) if raw.isdigit() else 0


def from_environ(environ: Mapping[str, str] | None = None) -> NodeEnv:
    env = os.environ if environ is None else environ
    if ENV_SCHEDULER not in env:
        raise SluiceError(
            f"{ENV_SCHEDULER} is not set: start this script with `sluice launch -w N -s M -- python SCRIPT`"
        )
    try:
        config = json.loads(env.get(ENV_CONFIG, "{}"))
        secret = read_secret(int(env[ENV_SECRET_FD])) if ENV_SECRET_FD in env else b""
        return NodeEnv(
            scheduler=env[ENV_SCHEDULER],
            role=env.get(ENV_ROLE, "worker"),
            rank=int(env.get(ENV_RANK, "-1")),
            workers=int(env.get(ENV_WORKERS, "0")),
            servers=int(env.get(ENV_SERVERS, "0")),
            aggregators=int(env.get(ENV_AGGREGATORS, "0")),
            config=config if isinstance(config, dict) else {},
            secret=secret,
            standby=env.get(ENV_STANDBY, ""),
            ring=env.get(ENV_STANDBY_RING) == "1",
        )
    except ValueError as exc:
        raise SluiceError(f"malformed SLUICE_* environment: {exc}") from None
