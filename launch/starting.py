"""How a job starts its scheduler and standbys: each spawned, then waited for until it announced its endpoint.

The part of the launcher's Job (launch/supervisor.py) that runs before any server or worker starts; an
elastic job's later generations (launch/generations.py) wait for their schedulers' announcements the
same way.
"""

from __future__ import annotations

import asyncio
from typing import Any

from sluice.launch.children import Child
from sluice.launch.cluster import ClusterPlan
from sluice.launch.config import SluiceConfig
from sluice.launch.ending import Ending
from sluice.launch.spawner import Spawner
from sluice.launch.standby import Schedulers, standby_count, standby_hosts


class Starting(Ending):
    """What Job does to start its schedulers; it holds these attributes and spawns children."""

    config: SluiceConfig
    plan: ClusterPlan | None
    spawner: Spawner
    ready_timeout: float
    endpoint: str

    async def spawn(self, role: str, rank: int, argv: list[str], scheduler: str, moved_to: str | None = None,
                    extra_env: dict[str, str] | None = None) -> Child:
        raise NotImplementedError

    def report(self, child: Child, why: str) -> None:
        raise NotImplementedError

    def _node_silent(self, role: str, rank: int) -> None:
        raise NotImplementedError

    async def _start_schedulers(self, role_argv: list[str]) -> Schedulers | int:
        """The scheduler and its standbys (scheduler.standby), each announced; else the launcher's exit code."""
        hosts = standby_hosts(self.plan, standby_count(self.config, self.plan))
        # the standbys start beside the scheduler, on other hosts when there are; the roles there then outlive
        # the launcher's host (not under srun: SLURM ends a step whose srun is gone)
        self.spawner.outlive = self.plan is not None and self.plan.reach.method == "ssh" \
            and any(host is not None for host in hosts)
        try:
            sched = await self.spawn("scheduler", 0, [*role_argv, "scheduler"], "")
            announced = await self._announced(sched)
            if isinstance(announced, int):
                return announced
            # the standbys once the scheduler's endpoint is known: each watches that port, and leaves when it stays
            # silent and no node rejoins (the launcher was SIGKILLed: scheduler/standby_watch.py)
            standbys = [await self.spawn("scheduler", rank, [*role_argv, "scheduler"], announced, host)
                        for rank, host in enumerate(hosts, 1)]
        except OSError as exc:
            self.complain(f"cannot start the scheduler: {exc}")
            return 1
        for child in standbys:
            announced_standby = await self._announced(child)
            if isinstance(announced_standby, int):
                return announced_standby
        self.endpoint = sched.ready.result()
        for standby in standbys:
            self.say(f"{standby.label} ready at {standby.ready.result()}")
        self.spawner.standby = ",".join(standby.ready.result() for standby in standbys)
        for child in (sched, *standbys):
            child.on_silent = self._node_silent
        return Schedulers(sched, standbys)

    async def _announced(self, child: Child) -> str | int:
        """A scheduler's endpoint once it announced it, or the launcher's exit code if it did not."""
        first: list[asyncio.Future[Any]] = [child.ready, child.done, self.interrupted]
        await asyncio.wait(first, timeout=self.ready_timeout, return_when=asyncio.FIRST_COMPLETED)
        if self.interrupted.done():
            return self.interrupted.result()
        if not child.ready.done():
            if child.done.done():
                self.report(child, " before announcing its endpoint")
            else:
                self.complain(f"{child.name} did not announce its endpoint within {self.ready_timeout:g} s")
            return 1
        return child.ready.result()
