"""How a launched process learns its job: the one place that reads SLUICE_* variables of a child."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from scheduler.errors import SluiceError
from transport.config import TransportConfig

ENV_SCHEDULER = "SLUICE_SCHEDULER"
ENV_ROLE = "SLUICE_ROLE"
ENV_RANK = "SLUICE_RANK"
ENV_WORKERS = "SLUICE_NUM_WORKERS"
ENV_SERVERS = "SLUICE_NUM_SERVERS"
ENV_CONFIG = "SLUICE_CONFIG_JSON"


@dataclass(frozen=True)
class NodeEnv:
    scheduler: str
    role: str
    rank: int
    workers: int
    servers: int
    #: the launcher's resolved configuration, one dict per section ("transport", "scheduler", ...)
    config: dict[str, Any]

    def to_environ(self) -> dict[str, str]:
        return {
            ENV_SCHEDULER: self.scheduler,
            ENV_ROLE: self.role,
            ENV_RANK: str(self.rank),
            ENV_WORKERS: str(self.workers),
            ENV_SERVERS: str(self.servers),
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

    def fingerprint(self) -> str:
        """Identifies the job-wide settings, so the scheduler can refuse a node configured differently.

        `transport.host` is left out: it is where this node listens, which differs from host to host.
        """
        shared = {name: dict(self.section(name)) for name in self.config}
        shared.get("transport", {}).pop("host", None)
        return json.dumps(shared, sort_keys=True)


def from_environ(environ: Mapping[str, str] | None = None) -> NodeEnv:
    env = os.environ if environ is None else environ
    if ENV_SCHEDULER not in env:
        raise SluiceError(
            f"{ENV_SCHEDULER} is not set: start this script with `sluice launch -w N -s M -- python SCRIPT`"
        )
    try:
        config = json.loads(env.get(ENV_CONFIG, "{}"))
        return NodeEnv(
            scheduler=env[ENV_SCHEDULER],
            role=env.get(ENV_ROLE, "worker"),
            rank=int(env.get(ENV_RANK, "-1")),
            workers=int(env.get(ENV_WORKERS, "0")),
            servers=int(env.get(ENV_SERVERS, "0")),
            config=config if isinstance(config, dict) else {},
        )
    except ValueError as exc:
        raise SluiceError(f"malformed SLUICE_* environment: {exc}") from None
