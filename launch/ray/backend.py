"""Sluice as a Ray Train backend: `TorchTrainer(train_func, torch_config=SluiceConfig(servers=M))`.

`on_start` (in Ray Train's controller, on the driver's node) starts the job's scheduler and servers
as subprocesses there (launch/ray/roles.py), then gives every Ray worker its place in the job: the
SLUICE_* variables `sluice launch` would set, torchrun's RANK/LOCAL_RANK/..., and the job secret
through a pipe inside the worker's own process (launch/ray/worker_side.py), so that
`import sluice.torch as hvd; hvd.init()` in the training function joins the job. `on_shutdown` has
every worker say goodbye, then ends the scheduler and servers. Ranks are Ray's world ranks (the
worker group's order); local ranks follow from the workers' node addresses, as Sluice's own do.
"""

from __future__ import annotations

import copy
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray
from ray.train.backend import BackendConfig
from ray.train.torch.config import TorchConfig, _TorchBackend

from sluice.launch.config import ConfigError, load_config
from sluice.launch.ray.roles import RoleGroup
from sluice.launch.ray.worker_side import SluiceContext, join_job, leave_job, node_address, place_environ
from sluice.scheduler.bootstrap import NodeEnv, new_secret

if TYPE_CHECKING:  # a private module, and only in recent Ray: named for the type checker alone
    from ray.train._internal.base_worker_group import BaseWorkerGroup

logger = logging.getLogger(__name__)
#: seconds the workers get to say goodbye at shutdown (a worker stuck in a dead peer's collective may not)
LEAVE_TIMEOUT = 30.0


@dataclass
class SluiceConfig(TorchConfig):
    """Ray Train's backend configuration for a Sluice job (a TorchConfig, so TorchTrainer takes it).

    servers: parameter servers to start (0: allreduce among the workers only). config_file and
    settings: Sluice's configuration as `sluice launch --config PATH --set SECTION.FIELD=VALUE` takes
    it (SLUICE_<SECTION>_<FIELD> variables of the driver apply too), resolved here on the driver so a
    mistake fails at once. torch_process_group: also set up torch.distributed as TorchConfig does
    (gloo on CPU), for scripts that use Sluice's DDP comm hook.
    """

    servers: int = 0
    config_file: str | None = None
    settings: Sequence[str] = ()
    ready_timeout_s: float = 60.0
    shutdown_grace_s: float = 10.0
    torch_process_group: bool = False
    #: the resolved configuration, one dict per section (as SLUICE_CONFIG_JSON carries it)
    sections: dict[str, dict[str, Any]] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        if self.servers < 0:
            raise ValueError(f"SluiceConfig(servers={self.servers}): the server count must be 0 or more")
        if isinstance(self.settings, str):
            raise ValueError("SluiceConfig(settings=...) takes a list of 'section.field=value' items, not one string")
        try:
            config = load_config(self.config_file, os.environ, list(self.settings))
        except ConfigError as exc:
            raise ValueError(f"SluiceConfig: {exc}") from None
        if config.ps.recover:
            raise ValueError("SluiceConfig: ps.recover restarts dead servers, which only `sluice launch` does; "
                             "under Ray Train use FailureConfig(max_failures=N) to restart the whole run instead")
        self.sections = config.to_sections()

    @property
    def backend_cls(self) -> type[SluiceBackend]:
        return SluiceBackend

    @property
    def train_func_context(self) -> type[SluiceContext]:
        return SluiceContext

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "servers": self.servers, "settings": list(self.settings),
                "config_file": self.config_file, "torch_process_group": self.torch_process_group}


class SluiceBackend(_TorchBackend):
    """Starts a Sluice job for a Ray Train worker group and ends it with the group."""

    def __init__(self) -> None:
        # Ray keeps one backend object per process (a singleton): the jobs of the groups it set up, by group
        self.jobs: dict[int, RoleGroup] = {}

    def on_start(self, worker_group: BaseWorkerGroup, backend_config: BackendConfig) -> None:
        backend_config = _sluice_config(backend_config)
        if backend_config.torch_process_group:
            super().on_start(worker_group, backend_config)
        hosts: list[str] = worker_group.execute(node_address)
        roles, environs, secret = start_job(hosts, backend_config.sections, backend_config.servers,
                                            backend_config.ready_timeout_s)
        self.jobs[id(worker_group)] = roles
        try:
            joins: list[Any] = [worker_group.execute_single_async(rank, join_job, environ, secret)
                                for rank, environ in enumerate(environs)]
            ray.get(joins)
        except BaseException:
            self.jobs.pop(id(worker_group), None)
            roles.stop(0.0)  # what went wrong is the exception's to say (a role's failure carries its last lines)
            raise

    def on_shutdown(self, worker_group: BaseWorkerGroup, backend_config: BackendConfig) -> None:
        backend_config = _sluice_config(backend_config)
        roles = self.jobs.pop(id(worker_group), None)
        try:
            # each worker's goodbye lets the scheduler and servers end by themselves; a crashed one cannot say it
            leaves: list[Any] = worker_group.execute_async(leave_job)
            ray.get(leaves, timeout=LEAVE_TIMEOUT)
        except Exception as exc:  # the roles must be stopped whatever the workers did
            logger.warning("not every Ray worker left the Sluice job cleanly (%s); stopping the scheduler and "
                           "servers regardless", type(exc).__name__)
        finally:
            if roles is not None:
                for note in roles.stop(backend_config.shutdown_grace_s):
                    print(f"[sluice] {note}", file=sys.stderr, flush=True)
            if backend_config.torch_process_group:
                super().on_shutdown(worker_group, backend_config)


def start_job(hosts: list[str], sections: dict[str, dict[str, Any]], servers: int,
              ready_timeout: float) -> tuple[RoleGroup, list[dict[str, str]], bytes]:
    """The scheduler and `servers` servers of a job, started on this node, for workers on `hosts` (by rank):
    the roles, each worker's variables (place_environ) and the job secret (empty with transport.curve off)."""
    workers, here = len(hosts), node_address()
    # one node: loopback, so that peers on this host use shared memory, as `sluice launch` does on one machine
    one_node = all(host == here for host in hosts)
    sections = copy.deepcopy(sections)
    secret = new_secret() if bool(sections.get("transport", {}).get("curve", True)) else b""

    def listening_on(host: str) -> dict[str, dict[str, Any]]:
        placed = copy.deepcopy(sections)
        placed.setdefault("transport", {})["host"] = "127.0.0.1" if one_node else host
        return placed

    roles = RoleGroup()
    try:
        scheduler = NodeEnv("", "scheduler", 0, workers, servers, listening_on(here), secret)
        endpoint = roles.start_scheduler(scheduler, ready_timeout)
        roles.start_servers([NodeEnv(endpoint, "server", rank, workers, servers, listening_on(here), secret)
                             for rank in range(servers)])
    except BaseException:
        roles.stop(0.0)
        raise
    print(f"[sluice] scheduler at {endpoint}; {servers} server(s) on {here}, {workers} Ray workers on "
          f"{len(set(hosts))} node(s)", flush=True)
    environs = [place_environ(NodeEnv(endpoint, "worker", rank, workers, servers, listening_on(host)), hosts, rank)
                for rank, host in enumerate(hosts)]
    return roles, environs, secret


def _sluice_config(config: BackendConfig) -> SluiceConfig:
    if not isinstance(config, SluiceConfig):
        raise TypeError(f"SluiceBackend runs with a SluiceConfig, got {type(config).__name__}: pass "
                        "torch_config=SluiceConfig(...) (or backend_config= to a DataParallelTrainer)")
    return config


__all__ = ["SluiceBackend", "SluiceConfig"]
