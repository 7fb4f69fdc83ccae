"""Horovod's `horovod.ray.RayExecutor` for Sluice: Ray actors that are the workers of one Sluice job, called at will.

As Horovod's: `start()` places the actors (a placement group of its own, or the caller's), ranks them
host by host, and can build an `executable_cls` object in each; `execute(fn)` runs `fn(executable)` on
every worker, `run(fn, args, kwargs)` runs `fn(*args, **kwargs)`, `run_remote` returns the ObjectRefs,
`execute_single` runs on rank 0, `shutdown()` ends it all. The job's scheduler and servers start on the
driver's node as under Ray Train (launch/ray/backend.py `start_job`), and each actor joins the job as a
Ray Train worker does (launch/ray/worker_side.py), so `hvd.init()` in a function or executable joins it.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from sluice.launch.ray.backend import LEAVE_TIMEOUT, SluiceConfig, start_job
from sluice.launch.ray.roles import RoleGroup
from sluice.launch.ray.worker_side import join_job, leave_job, node_address

logger = logging.getLogger(__name__)


@dataclass
class MiniSettings:
    """Horovod's settings for a RayExecutor; `timeout_s` bounds the job's start, `placement_group_timeout_s`
    the wait for Ray to place the workers (TimeoutError past it)."""

    nics: set[str] | None = None
    verbose: int = 1
    ssh_port: int | None = None
    ssh_identity_file: str | None = None
    timeout_s: int = 300
    placement_group_timeout_s: int = 100
    elastic: bool = False


class Worker:
    """One worker of the job (Horovod's BaseHorovodWorker), made a Ray actor by RayExecutor.start."""

    def __init__(self) -> None:
        self.executable: Any = None

    def node_address(self) -> str:
        return node_address()

    def hostname(self) -> str:
        return socket.gethostname()

    def gpu_ids(self) -> list[str]:
        return [str(i) for i in ray.get_gpu_ids()]

    def update_env_vars(self, env: dict[str, str]) -> None:
        os.environ.update({key: str(value) for key, value in env.items()})

    def env_vars(self) -> dict[str, str]:
        return dict(os.environ)

    def join(self, environ: dict[str, str], secret: bytes) -> None:
        join_job(environ, secret)

    def start_executable(self, cls: type | None, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        if cls is not None:
            self.executable = cls(*args, **kwargs)

    def execute(self, fn: Callable[[Any], Any]) -> Any:
        return fn(self.executable)

    def leave(self) -> None:
        leave_job()


class RayExecutor:
    """Horovod's RayExecutor with Sluice's job underneath. Horovod's arguments; Sluice's own, keyword-only:
    `servers` (parameter servers, 0: allreduce only), `config_file` and `config` (items `section.field=value`),
    as SluiceConfig takes them. Elastic execution (`min_workers`) is not offered."""

    @classmethod
    def create_settings(cls, timeout_s: int = 30, ssh_identity_file: str | None = None, ssh_str: str | None = None,
                        placement_group_timeout_s: int = 100, nics: set[str] | None = None) -> MiniSettings:
        if ssh_str and ssh_identity_file and not os.path.exists(ssh_identity_file):  # as Horovod's: the key's file
            with open(os.open(ssh_identity_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as key:
                key.write(ssh_str)
        return MiniSettings(ssh_identity_file=ssh_identity_file, timeout_s=timeout_s,
                            placement_group_timeout_s=placement_group_timeout_s, nics=nics)

    def __init__(self, settings: MiniSettings, num_workers: int | None = None, num_hosts: int | None = None,
                 num_workers_per_host: int = 1, cpus_per_worker: int = 1, use_gpu: bool = False,
                 gpus_per_worker: int | None = None, use_current_placement_group: bool = True,
                 min_workers: int | None = None, max_workers: int | None = None, reset_limit: int | None = None,
                 cooldown_range: list[int] | None = None, elastic_timeout: int = 600, override_discovery: bool = True,
                 *, servers: int = 0, config_file: str | None = None, config: Sequence[str] = ()) -> None:
        if max_workers and (not min_workers or min_workers <= 0):  # Horovod's checks and words, first
            raise ValueError("`max_workers` provided without any positive `min_workers`"
                             "Elastic workloads require a positive `min_workers`")
        if min_workers and num_workers:
            raise ValueError("Both `min_workers` and `num_workers` provided."
                             "Only one of the above is allowed as workloads cannot be elastic and non-elastic.")
        if min_workers is not None:
            raise ValueError("RayExecutor(min_workers=...): an elastic RayExecutor is not offered; use Ray Train's "
                             "TorchTrainer with sluice.ray.SluiceConfig and FailureConfig, or `sluice launch "
                             "--elastic`")
        if num_workers is None and num_hosts is None:
            raise ValueError("RayExecutor needs num_workers, or num_hosts (with num_workers_per_host)")
        if num_workers is not None and num_hosts is not None:
            raise ValueError("RayExecutor takes num_workers or num_hosts, not both")
        self.settings = settings
        self.config = SluiceConfig(servers=servers, config_file=config_file, settings=list(config))
        self.count = num_workers if num_workers is not None else (num_hosts or 0) * num_workers_per_host
        self.num_hosts, self.per_host = num_hosts, num_workers_per_host
        self.resources: dict[str, float] = {"CPU": cpus_per_worker}
        if use_gpu:
            self.resources["GPU"] = gpus_per_worker or 1
        self.use_current_placement_group = use_current_placement_group
        self.workers: list[Any] = []
        self.group: PlacementGroup | None = None  # one this executor made (removed at shutdown)
        self.roles: RoleGroup | None = None

    def start(self, executable_cls: type | None = None, executable_args: Sequence[Any] | None = None,
              executable_kwargs: dict[str, Any] | None = None, extra_env_vars: dict[str, str] | None = None) -> None:
        """Place the workers (TimeoutError if Ray cannot within placement_group_timeout_s), start the job, have
        every worker join it, then build `executable_cls(*executable_args, **executable_kwargs)` in each."""
        self.workers = actors = self._place()  # from here on, shutdown() ends them whatever fails
        timeout = self.settings.timeout_s
        hosts = ray.get([actor.node_address.remote() for actor in actors], timeout=timeout)
        order = sorted(range(len(actors)), key=lambda i: (hosts[i], i))  # ranks host by host, as Horovod's
        self.workers, hosts = [actors[i] for i in order], [hosts[i] for i in order]
        env = dict(extra_env_vars or {})
        envs = [env] * len(hosts)
        if "GPU" in self.resources:  # every worker of a node sees the node's workers' GPUs (local_rank picks one)
            node_gpus: dict[str, set[str]] = {}
            for host, mine in zip(hosts, ray.get([w.gpu_ids.remote() for w in self.workers], timeout=timeout),
                                  strict=True):
                node_gpus.setdefault(host, set()).update(mine)
            envs = [{**env, "CUDA_VISIBLE_DEVICES": ",".join(sorted(node_gpus[host], key=int))} for host in hosts]
        if any(envs):
            ray.get([w.update_env_vars.remote(e) for w, e in zip(self.workers, envs, strict=True)], timeout=timeout)
        self.roles, environs, secret = start_job(hosts, self.config.sections, self.config.servers, timeout)
        ray.get([w.join.remote(e, secret) for w, e in zip(self.workers, environs, strict=True)], timeout=timeout)
        ray.get([worker.start_executable.remote(executable_cls, list(executable_args or []),
                                                dict(executable_kwargs or {})) for worker in self.workers])

    def _place(self) -> list[Any]:
        """The actors, in the caller's placement group or one of their own."""
        group = get_current_placement_group() if self.use_current_placement_group else None
        if group is None:
            if self.num_hosts is None:
                group = placement_group([dict(self.resources)] * self.count, strategy="PACK")
            else:
                group = placement_group([{k: v * self.per_host for k, v in self.resources.items()}] * self.num_hosts,
                                        strategy="STRICT_SPREAD")
            self.group = group
            wait = self.settings.placement_group_timeout_s
            if not ray.wait([group.ready()], timeout=wait)[0]:
                raise TimeoutError(f"Ray could not place {self.count} workers of {self.resources} within {wait} s "
                                   "(placement_group_timeout_s): the cluster has too few free resources; ask for "
                                   "fewer workers or CPUs per worker, or add nodes")
        by_host = self.group is not None and self.num_hosts is not None  # our own bundles, one a host

        def bundle(rank: int) -> int:
            return rank // self.per_host if by_host else -1  # -1: any bundle of the group

        actor = ray.remote(Worker)
        return [actor.options(num_cpus=self.resources["CPU"], num_gpus=self.resources.get("GPU", 0),
                              scheduling_strategy=PlacementGroupSchedulingStrategy(
                                  group, placement_group_bundle_index=bundle(rank))).remote()
                for rank in range(self.count)]

    def _started(self) -> list[Any]:
        if not self.workers:
            raise RuntimeError("RayExecutor: call start() first")
        return self.workers

    def execute(self, fn: Callable[[Any], Any], callbacks: list[Callable[..., Any]] | None = None) -> list[Any]:
        """`fn(executable)` on every worker; the values by rank (callbacks: accepted, unused, as Horovod's)."""
        return ray.get([worker.execute.remote(fn) for worker in self._started()])

    def run(self, fn: Callable[..., Any], args: Sequence[Any] | None = None, kwargs: dict[str, Any] | None = None,
            callbacks: list[Callable[..., Any]] | None = None) -> list[Any]:
        """`fn(*args, **kwargs)` on every worker; the values by rank."""
        return ray.get(self.run_remote(fn, args, kwargs))

    def run_remote(self, fn: Callable[..., Any], args: Sequence[Any] | None = None,
                   kwargs: dict[str, Any] | None = None) -> list[Any]:
        """`fn(*args, **kwargs)` on every worker; their ObjectRefs, by rank, for ray.get."""
        call_args, call_kwargs = list(args or []), dict(kwargs or {})
        return [worker.execute.remote(lambda _: fn(*call_args, **call_kwargs)) for worker in self._started()]

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """`fn(executable)` on rank 0."""
        return ray.get(self._started()[0].execute.remote(fn))

    def shutdown(self) -> None:
        """Every worker leaves the job, the actors end, then the scheduler and servers; safe after a failed start."""
        workers, self.workers = self.workers, []
        if workers:
            try:
                ray.get([worker.leave.remote() for worker in workers], timeout=LEAVE_TIMEOUT)
            except Exception as exc:  # the roles must be stopped whatever the workers did
                logger.warning("not every worker left the Sluice job cleanly (%s); stopping it regardless",
                               type(exc).__name__)
        for worker in workers:
            ray.kill(worker)
        if self.group is not None:
            remove_placement_group(self.group)
            self.group = None
        if self.roles is not None:
            for note in self.roles.stop(self.config.shutdown_grace_s):
                print(f"[sluice] {note}", file=sys.stderr, flush=True)
            self.roles = None
