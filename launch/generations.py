"""An elastic job's generations (`sluice launch --elastic`): each one a Job; the next re-formed from how it ended.

A generation ends for the next when a worker dies (it is dropped: its slot goes with it) or asks
for it (REFORM_EXIT, after the host discovery reported more slots and the workers committed). The
rules for what comes next are launch/elastic.py's; the workers' side is worker/torch/elastic.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import BinaryIO, TextIO

from sluice.launch.blame import judge
from sluice.launch.children import SSH_FAILED, Child
from sluice.launch.cluster import ClusterPlan
from sluice.launch.config import SluiceConfig
from sluice.launch.elastic import (
    ENV_ELASTIC_DIR,
    ENV_GENERATION,
    REFORM_EXIT,
    ElasticSettings,
    Reform,
    grown,
    shrunk,
    slots,
    without,
)
from sluice.launch.elastic_io import discover, remove_state_dir, state_dir
from sluice.launch.ending import SETTLE_SECONDS
from sluice.launch.hosts import Host, HostsError
from sluice.launch.master_port import free_port
from sluice.launch.run_options import RunOptions
from sluice.launch.spawner import KeptPreloader
from sluice.launch.standby import Schedulers, standby_hosts
from sluice.launch.supervisor import Job, run_on_loop, supervise
from sluice.launch.torchrun_env import ENV_MAX_RESTARTS, ENV_RESTART_COUNT
from sluice.scheduler.bootstrap import ENV_ELASTIC_IN_PLACE
from sluice.scheduler.new_place import Place

Replan = Callable[[list[Host]], ClusterPlan | None]


class Generation(Job):
    def __init__(self, config: SluiceConfig, workers: int, servers: int, command: Sequence[str], grace: float,
                 ready_timeout: float, out: BinaryIO, err: TextIO, aggregators: int, plan: ClusterPlan | None,
                 elastic: ElasticSettings, worker_env: Mapping[str, str], options: RunOptions | None = None) -> None:
        super().__init__(config, workers, servers, command, grace, ready_timeout, out, err, aggregators, plan,
                         worker_env, options)
        self.elastic = elastic
        #: why this generation ended for the next; None: the job ended
        self.reform: Reform | None = None
        #: the hosts a discovery found, when they offer more slots than this generation uses
        self.grow_to: list[Host] | None = None
        self.discovery: asyncio.Task[None] | None = None
        #: workers replaced in place so far (--in-place)
        self.in_place = 0

    def state_items(self) -> list[str]:
        """The committed state too (the janitor removes it should the launcher be killed)."""
        return [*super().state_items(), self.spawner.worker_env[ENV_ELASTIC_DIR]]

    def swept(self, items: list[str]) -> list[str]:
        """The committed state outlives a generation that hands over to the next."""
        return [item for item in items if self.reform is None or not item.startswith("/")]

    def hands_over_preloader(self) -> bool:
        """A generation that ends for the next leaves its preloader running: the next forks its workers at once."""
        return self.reform is not None

    def running(self) -> None:
        if self.elastic.discovery is not None:
            self.discovery = asyncio.create_task(self._discover())

    def ended(self) -> None:
        if self.discovery is not None:
            self.discovery.cancel()

    async def _worker_failed(self, first: Child) -> int:
        """A worker asked to re-form the job (REFORM_EXIT, after new hosts came), or died and is dropped.
        A server or the scheduler at the origin is a failure no new generation mends."""
        code = first.returncode
        assert code is not None
        if code == REFORM_EXIT:
            self.reform = Reform((), grown=self.grow_to is not None)
            self.say(f"{first.label} asked to re-form the job" + (" (new hosts)" if self.grow_to else ""))
            return REFORM_EXIT
        if code > 0:  # a consequence, maybe: the report of its cause may be a moment behind
            await asyncio.wait([self.interrupted], timeout=SETTLE_SECONDS)
        verdict = judge(first, self.children, self._context)
        cause = verdict.cause if isinstance(verdict.cause, Child) else first
        if cause.role != "worker":
            return await self._failed(first)
        self.complain(f"{verdict.headline}; dropping {cause.label} and re-forming the job (--elastic)")
        self.complain(f"last lines of {cause.label}:\n{cause.last_lines()}")
        self.reform = Reform((cause.rank,), grown=self.grow_to is not None)
        return REFORM_EXIT

    async def _replace_worker(self, dead: Child) -> tuple[Child | None, list[Child], list[Child]] | None:
        """--in-place: a worker died on its own (the first cause): stop the scheduler and servers, start
        them again (the scheduler on the same port), tell the other workers to re-form in their processes
        (SIGUSR2), and start a new worker of the same rank in its slot, at the next generation; or, when its
        host is lost and no other has a free slot, go on without it, the survivors numbered again from 0
        (as Horovod's elastic mode shrinks a job), while --min-workers are left."""
        code = dead.returncode
        if not self.elastic.in_place or code in (None, REFORM_EXIT) or self.stopping or self.schedulers is None:
            return None
        if dead not in self.children:  # dropped already, with the rest of its lost host (below)
            return None, [], []
        if code > 0:  # a consequence, maybe: the report of its cause may be a moment behind
            await asyncio.wait([self.interrupted], timeout=SETTLE_SECONDS)
        verdict = judge(dead, self.children, self._context)
        if verdict.cause is not dead or self.interrupted.done():
            return None
        if self.in_place >= self.elastic.max_restarts:
            self.complain(f"{verdict.headline}; the job was re-formed in place {self.in_place} times "
                          "(--max-restarts)")
            return None
        moved_to = await self._slot_for(dead)
        survivors = sorted((c for c in self.children if c.role == "worker" and c is not dead), key=lambda c: c.rank)
        shrink = moved_to == ""
        # the others on a lost host go too: their sessions fail a moment later, and nobody may count on them
        gone = [c for c in survivors if shrink and c.host in self.takeovers.lost_hosts]
        survivors = [c for c in survivors if c not in gone]
        if shrink and len(survivors) < self.elastic.min_workers:
            return None  # the generation ends; the next would have fewer than --min-workers, which ends the job
        self.in_place += 1
        lost = time.monotonic()
        self.complain(f"{verdict.headline}; " + (
            f"going on without {' and '.join(c.label for c in [dead, *gone])}: the other {len(survivors)} workers "
            "keep their processes, numbered again from 0 (--in-place)" if shrink else
            f"replacing {dead.label} in place: the other workers keep their processes (--in-place)"))
        for child in (dead, *gone):
            self.children.remove(child)
        for child in gone:  # their host is lost: their ssh sessions have nothing left to stop
            child.signal_group(signal.SIGKILL)
        old = [c for c in self.children if c.role != "worker"]
        killed = await self.stop_children(old)
        for child in old:
            self.children.remove(child)
        generation = int(self.spawner.worker_env[ENV_GENERATION]) + 1
        self.spawner.worker_env[ENV_GENERATION] = str(generation)
        hosts, renamed = self._shrink(survivors) if shrink else ([], "")
        if moved_to and self.plan is not None:  # the plan follows it (what a later generation re-forms from)
            placed = self.placed()
            placed[dead.rank] = moved_to
            self.plan = self.spawner.plan = self.takeovers.plan = self.plan.with_workers(placed)
        role_argv = [sys.executable, "-m", "sluice.launch.cli"]
        previous, lost_hosts = self.schedulers.standbys, self.takeovers.lost_hosts
        endpoints = {p.rank: p.ready.result() for p in previous if p.ready.done()}
        standbys: dict[int, Child] = {}
        # each standby is told the scheduler's endpoint, the port it watches (and leaves when that stays silent with
        # no node rejoining: scheduler/standby_watch.py); a replacement's scheduler comes back at the same one, a
        # shrunk job's at a port known once it is up: there the standbys start after it
        moving = [away for away in previous if away.host in lost_hosts]
        kept = [p for p in previous if p.host not in lost_hosts]  # on their hosts and ports: everyone has them
        if not shrink:  # a standby whose host was lost starts on another host, on a port it learns there; awaited
            # first, as the newcomer is told where it went
            for child in [await self._standby_started(away, "", self.endpoint) for away in moving]:
                await self._standby_ready(child, "", standbys, endpoints)
        self.spawner.standby = ",".join(endpoints[rank] for rank in sorted(endpoints))
        # the newcomer first: its start (Python, the framework) is the longest; it finds the scheduler at the
        # same address once that is up
        worker = None if shrink else await self.spawn("worker", dead.rank, self.command, self.endpoint, moved_to,
                                                      self._local_env(moved_to))
        sched = await self.spawn("scheduler", 0, [*role_argv, "scheduler"], "")
        started = [] if shrink else [await self._standby_started(p, endpoints.get(p.rank, ""), self.endpoint)
                                     for p in kept]
        endpoint = await self._announced(sched)
        if not isinstance(endpoint, str) or (endpoint != self.endpoint and not shrink):
            self.complain(f"the scheduler of generation {generation} did not come back at {self.endpoint}")
            return None
        self.endpoint = endpoint
        if shrink:
            for child in [await self._standby_started(away, "", endpoint) for away in moving]:
                await self._standby_ready(child, "", standbys, endpoints)
            started = [await self._standby_started(p, endpoints.get(p.rank, ""), endpoint) for p in kept]
        for child in started:
            await self._standby_ready(child, endpoints.get(child.rank, ""), standbys, endpoints)
        self.spawner.standby = ",".join(endpoints[rank] for rank in sorted(endpoints))
        places: list[Place | None] = list(shrunk(hosts, endpoint, self.spawner.standby)) if shrink else \
            [self._place(c.rank) for c in survivors] if previous else [None] * len(survivors)
        for child, place in zip(survivors, places, strict=True):  # they re-form now: their scheduler is there again
            child.notify_reform(place, self.spawner.worker_env[ENV_ELASTIC_DIR])
        new = [sched, *[await self.spawn("server", rank, [*role_argv, "server"], self.endpoint, self._live(rank))
                        for rank in range(self.servers)]]
        self.schedulers = Schedulers(sched, [standbys[rank] for rank in sorted(standbys)])
        for child in (sched, *self.schedulers.standbys):
            child.on_silent = self._node_silent
        new += self.schedulers.standbys
        what = (f"the job went on with {len(survivors)} workers ({renamed})" if shrink else
                f"{dead.label} replaced in its slot")
        self.say(f"generation {generation}: {what} and the scheduler and servers started again "
                 f"{time.monotonic() - lost:.2f} s after the loss ({killed} stopped by SIGKILL)")
        return worker, old, new

    async def _standby_started(self, previous: Child, endpoint: str, scheduler: str) -> Child:
        """The next generation's standby in place of `previous`, watching the scheduler at `scheduler`: on its host
        and port (`endpoint`) while its host is up, so that every node still has its endpoint; else on another
        host, on a port the OS picks."""
        kept = previous.host not in self.takeovers.lost_hosts and endpoint
        self.config = self.spawner.config = dataclasses.replace(self.config, scheduler=dataclasses.replace(
            self.config.scheduler, standby_port=int(endpoint.rsplit(":", 1)[1]) if kept else 0))
        host = previous.host if kept else standby_hosts(self.plan, previous.rank, self.takeovers.lost_hosts)[-1]
        return await self.spawn("scheduler", previous.rank, [sys.executable, "-m", "sluice.launch.cli", "scheduler"],
                                scheduler, host)

    async def _standby_ready(self, standby: Child, expected: str, standbys: dict[int, Child],
                             endpoints: dict[int, str]) -> None:
        """Once `standby` listens (at `expected`, when it was started on its old port), it joins `standbys` and
        `endpoints` (what the spawner tells the nodes started from now on); if not, the job goes on without it."""
        endpoint = await self._announced(standby)
        if isinstance(endpoint, str) and endpoint == (expected or endpoint):
            standbys[standby.rank], endpoints[standby.rank] = standby, endpoint
            self.say(f"{standby.label} ready at {endpoint}")
            return
        self.complain(f"the {standby.label} did not come back{f' at {expected}' if expected else ''}: the job goes "
                      "on without it")
        endpoints.pop(standby.rank, None)

    def _place(self, rank: int) -> Place:
        """A worker's place as the spawner would give it now (what a survivor of a replacement is told: the
        standby's endpoint, and its local rank should a newcomer have moved to its host)."""
        env, _ = self.spawner.node_environ("worker", rank, self.endpoint)
        return Place(rank, self.workers, int(env["LOCAL_RANK"]), int(env["LOCAL_WORLD_SIZE"]), self.endpoint,
                     self.spawner.standby)

    def _shrink(self, survivors: list[Child]) -> tuple[list[str], str]:
        """The job goes on with `survivors` (in old rank order): each renumbered, the job's size and plan made
        smaller, its scheduler moved to a new port (no survivor's old connection may reach it: it is named by
        an old rank, another survivor's new one); their hosts, and a few words on who is who now."""
        assert self.plan is not None  # a host is lost only in a planned job (_slot_for)
        hosts = [child.host or self.plan.place("worker", child.rank).host for child in survivors]
        renamed = ", ".join(f"worker {c.rank} is worker {rank}" for rank, c in enumerate(survivors)
                            if c.rank != rank) or "the same ranks"
        for rank, child in enumerate(survivors):
            child.renumber(rank)
        self.workers = self.spawner.workers = len(survivors)
        self.plan = self.spawner.plan = self.takeovers.plan = self.plan.with_workers(hosts)
        self.config = self.spawner.config = dataclasses.replace(
            self.config, scheduler=dataclasses.replace(self.config.scheduler, port=free_port()))
        return hosts, renamed

    async def _slot_for(self, dead: Child) -> str | None:
        """Where a lost worker's replacement runs: its own slot (None) when its host is up, else a spare slot
        on another host, of the plan or, with a host discovery script, of the hosts it reports now; "" when
        there is none. A host is lost when its ssh session failed (exit 255)."""
        if self.plan is None or dead.host is None or dead.via != "ssh" or dead.returncode != SSH_FAILED:
            return None
        self.takeovers.lost_hosts.add(dead.host)
        busy = [c.host or "" for c in self.children if c.role == "worker" and c is not dead]
        spare = self.plan.spare_host(busy, self.takeovers.lost_hosts)
        found = ""
        if spare is None and self.elastic.discovery is not None:  # Horovod's way: what the discovery offers now
            try:
                plan = self.plan.with_hosts(await discover(self.elastic.discovery))
            except HostsError as exc:
                self.complain(f"the host discovery script, asked for a slot for {dead.label}, failed: {exc}")
            else:
                if (spare := plan.spare_host(busy, self.takeovers.lost_hosts)) is not None:
                    self.plan = self.spawner.plan = self.takeovers.plan = plan
                    found = ", which the host discovery script reports"
        self.complain(f"{dead.label}'s host {dead.host} is lost; " + (f"its replacement starts in a spare slot on "
                      f"{spare}{found}" if spare else "no other host has a free slot"))
        return spare or ""

    def _local_env(self, host: str | None) -> dict[str, str] | None:
        """LOCAL_RANK and LOCAL_WORLD_SIZE of a worker started in a spare slot of `host`."""
        if host is None:
            return None
        local = [c for c in self.children if c.role == "worker" and c.host == host]
        return {"LOCAL_RANK": str(len(local)), "LOCAL_WORLD_SIZE": str(len(local) + 1)}

    def _live(self, server: int) -> str | None:
        """Where server `server` starts again: its host, or the first live one when its host is lost."""
        if self.plan is None or self.plan.place("server", server).host not in self.takeovers.lost_hosts:
            return None
        return next((h.name for h in self.plan.hosts if h.name not in self.takeovers.lost_hosts), None)

    async def _discover(self) -> None:

        """Run the host discovery now and then; when it offers more slots, tell the workers (SIGUSR1:
        each re-forms the job at its next commit)."""
        assert self.elastic.discovery is not None
        while True:
            await asyncio.sleep(self.elastic.interval)
            try:
                found = await discover(self.elastic.discovery)
            except (HostsError, OSError) as exc:
                self.complain(f"warning: {exc}")
                continue
            hosts = grown(self.hosts(), found, self.elastic.max_workers)
            if slots(hosts) > self.workers and self.grow_to is None:
                self.grow_to = hosts
                self.say(f"host discovery: {slots(hosts)} slots now ({self.workers} in use); the workers re-form "
                         "the job at their next commit")
                for child in self.children:
                    if child.role == "worker":
                        child.notify_hosts_updated()

    def hosts(self) -> list[Host]:
        """This generation's hosts and the worker slots it uses on each."""
        if self.plan is None:
            return [Host("localhost", self.workers)]
        return [Host(h, self.plan.workers_on(h)) for h in dict.fromkeys(p.host for p in self.plan.layout.processes)
                if self.plan.workers_on(h)]

    def placed(self) -> list[str]:
        """The host of each worker, by rank."""
        if self.plan is None:
            return ["localhost"] * self.workers
        return [p.host for p in sorted(self.plan.layout.processes, key=lambda p: p.rank) if p.role == "worker"]


async def generations(config: SluiceConfig, workers: int, servers: int, command: Sequence[str], grace: float,
                      ready_timeout: float, aggregators: int, plan: ClusterPlan | None, elastic: ElasticSettings,
                      replan: Replan, options: RunOptions | None = None) -> int:
    """Run generation after generation until one ends the job; the launcher's exit code."""
    directory, generation, restarts = state_dir(), 0, 0
    os.mkdir(directory, 0o700)
    print(f"[launch] --elastic: the workers' committed state in {directory} on each host (removed at the end)",
          flush=True)
    if elastic.in_place:  # the survivors of a lost worker find the scheduler again where it was
        config = dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, port=free_port()))
    kept = KeptPreloader()  # the preloader (--preload), handed from one generation to the next
    try:
        while True:
            # torchrun counts a re-formed elastic job's rendezvous as a restart
            env = {ENV_ELASTIC_DIR: directory, ENV_GENERATION: str(generation), ENV_RESTART_COUNT: str(generation),
                   ENV_MAX_RESTARTS: str(elastic.max_restarts),
                   **({ENV_ELASTIC_IN_PLACE: "1"} if elastic.in_place else {})}
            job = Generation(config, workers, servers, command, grace, ready_timeout, sys.stdout.buffer,
                             sys.stderr, aggregators, plan, elastic, env, options)
            code = await kept.run(job.spawner, job.run())
            generation = int(job.spawner.worker_env[ENV_GENERATION])  # workers replaced in place count too
            if job.reform is None:
                return code
            hosts = without(job.hosts(), job.placed(), job.reform.dropped)
            if job.grow_to is not None:
                hosts = grown(hosts, job.grow_to, elastic.max_workers)
            restarts += not job.reform.grown
            if restarts > elastic.max_restarts:
                job.complain(f"the job was re-formed {elastic.max_restarts} times without new hosts "
                             "(--max-restarts); ending it")
                return code
            if slots(hosts) < elastic.min_workers:
                job.complain(f"{slots(hosts)} workers are left, fewer than --min-workers {elastic.min_workers}; "
                             "ending the job")
                return 1
            workers, generation = slots(hosts), generation + 1
            plan = replan(hosts)
            job.say(f"re-forming the job: generation {generation} with {workers} workers")
    finally:
        await kept.close()
        remove_state_dir(directory)


def run_job(config: SluiceConfig, workers: int, servers: int, command: Sequence[str], *, grace: float = 10.0,
            ready_timeout: float = 60.0, aggregators: int = 0, plan: ClusterPlan | None = None,
            elastic: ElasticSettings | None = None, replan: Replan | None = None,
            options: RunOptions | None = None, restarts: int = 0) -> int:
    """The launcher's job: one, started again after a failure up to `restarts` times (launch/restarts.py), or with
    `elastic` its generations (`replan` lays each out over its hosts)."""
    if elastic is None and restarts:
        from sluice.launch.restarts import restarting

        return run_on_loop(restarting(config, workers, servers, command, grace, ready_timeout, aggregators, plan,
                                      restarts, options))
    if elastic is None:
        return run_on_loop(supervise(config, workers, servers, command, grace=grace, ready_timeout=ready_timeout,
                                     aggregators=aggregators, plan=plan, options=options))
    return run_on_loop(generations(config, workers, servers, command, grace, ready_timeout, aggregators, plan,
                                   elastic, replan or (lambda hosts: None), options))
