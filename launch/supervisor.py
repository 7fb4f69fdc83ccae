"""Starts the scheduler, servers and workers of a job, here or over ssh or srun; relays output; ends them together."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import shlex
import signal
import sys
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any, BinaryIO, TextIO

from sluice.launch.blame import exit_description
from sluice.launch.children import SSH_FAILED, Child, Sink, death_signal_hook
from sluice.launch.cluster import ClusterPlan
from sluice.launch.config import SluiceConfig
from sluice.launch.janitor import Janitor
from sluice.launch.master_port import MasterPortError, choose, free_port
from sluice.launch.output import launcher_lines
from sluice.launch.preload import PreloadError
from sluice.launch.run_options import RunOptions
from sluice.launch.run_task import task_folder
from sluice.launch.spawner import Spawner
from sluice.launch.standby import Schedulers
from sluice.launch.starting import Starting
from sluice.launch.takeover import PROBE_S, Takeovers, host_answers
from sluice.ps.mirror_links import ENV_TAKEOVER
from sluice.ps.snapshot import remove_state_files, state_path, state_tag
from sluice.scheduler.bootstrap import new_secret

#: how often the launcher says which workers it still waits for once the job ended
STILL_RUNNING_EVERY_S = 60.0


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


class Job(Starting):
    def __init__(self, config: SluiceConfig, workers: int, servers: int, command: Sequence[str],
                 grace: float, ready_timeout: float, out: BinaryIO, err: TextIO, aggregators: int = 0,
                 plan: ClusterPlan | None = None, worker_env: Mapping[str, str] | None = None,
                 options: RunOptions | None = None) -> None:
        self.config, self.workers, self.servers, self.command = config, workers, servers, list(command)
        self.options = options or RunOptions()
        self.aggregators, self.plan = aggregators, plan
        self.grace, self.ready_timeout = grace, ready_timeout
        self.sink, self.err = Sink(out), err
        self.children: list[Child] = []
        loop = asyncio.get_running_loop()
        self.interrupted: asyncio.Future[int] = loop.create_future()
        self.kill_now = asyncio.Event()
        self.stopping = False
        self.base_env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.options.environ()}
        self.threads_note = ""
        if "OMP_NUM_THREADS" not in os.environ:
            # like torchrun: N workers each spinning up one thread per core would overload the machine
            threads = max(1, (os.cpu_count() or 1) // max(self.busiest_host(), 1))
            self.base_env["OMP_NUM_THREADS"] = str(threads)
            self.threads_note = f"OMP_NUM_THREADS={threads} for each process (set it to override)"
        self.spawner = Spawner(config, workers, servers, aggregators, plan, new_secret(), self.sink, self.base_env,
                               death_signal_hook(), free_port(), worker_env or {}, self.options.output)
        self.janitor: Janitor | None = None
        self.endpoint = ""  # the scheduler's, once it announced it
        self.restarts = 0  # servers restarted (ps.recover)
        self.takeovers = Takeovers(config, plan, servers)  # servers moved off a lost host (ps.replicas)
        self.probing: set[str] = set()  # hosts being checked after a server there fell silent
        self.probes: set[asyncio.Task[None]] = set()
        self.schedulers: Schedulers | None = None  # the scheduler and its standby, once started

    def hands_over_preloader(self) -> bool:
        """Whether the preloader outlives this job, for the next (an elastic job's generations)."""
        return False

    def busiest_host(self) -> int:
        """The most workers any one host runs."""
        if self.plan is None:
            return self.workers
        return max(self.plan.workers_on(p.host) for p in self.plan.layout.processes)

    def say(self, text: str, debug: bool = False) -> None:
        """A [launch] line on the terminal, unless --log-level keeps it back."""
        if not self.options.quiet and (not debug or self.options.log_level == "DEBUG"):
            self.sink.write(launcher_lines(text, self.options.output.timestamps))

    def complain(self, text: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            print(f"sluice launch: {text}", file=self.err, flush=True)

    def on_signal(self, sig: signal.Signals) -> None:
        if self.interrupted.done() or self.stopping:
            self.kill_now.set()  # Ctrl-C while stopping: skip the rest of the SIGTERM grace
        else:
            self.interrupted.set_result(128 + sig)
            self.complain(f"received {sig.name}; stopping the job")

    async def spawn(self, role: str, rank: int, argv: list[str], scheduler: str, moved_to: str | None = None,
                    extra_env: dict[str, str] | None = None) -> Child:
        child = await self.spawner.start(role, rank, argv, scheduler, moved_to, extra_env)
        self.children.append(child)
        self.say(f"started {child.name}: {shlex.join(argv)}", debug=True)
        self._tell_janitor(child)
        return child

    def _tell_janitor(self, child: Child) -> None:
        if (janitor := self.janitor) is not None:  # told at once: a launcher killed now leaves nothing behind
            pid = child.pid
            janitor.spawned(pid)
            child.done.add_done_callback(lambda _: janitor.reaped(pid))

    def report(self, child: Child, why: str) -> None:
        self.complain(f"{child.name} {exit_description(child.returncode or 0)}{why}")
        self.complain(f"last lines of {child.label}:\n{child.last_lines()}")

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.add_signal_handler(sig, self.on_signal, sig)
        # started before any child, so that no child can outlive a launcher killed by SIGKILL
        self.janitor = Janitor()
        for item in self.state_items():
            self.janitor.state(item)
        if (folder := task_folder(self.command)) is not None:  # the caller of sluice.run killed: its launcher too
            self.janitor.state(folder)
        if self.plan is not None and self.plan.reach.method == "srun":
            self.janitor.srun()
        self.started()
        if self.janitor.error:
            self.complain(f"warning: cannot start the janitor ({self.janitor.error}); if this launcher is "
                          "killed by SIGKILL, its children's subprocesses and shared memory may be left behind")
        try:
            return await self._run()
        finally:
            self.ended()
            await self.stop_all()
            if not self.hands_over_preloader():
                await self.spawner.stop_preloader()  # after the workers forked from it
            state = self.state_items()
            if self.config.ps.recover:  # the servers' committed state dies with the job
                remove_state_files(state_tag(self.spawner.secret))
            await self.spawner.sweep(self.swept(state), lost=self.takeovers.lost_hosts)  # and on the other hosts
            self.janitor.close()
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                loop.remove_signal_handler(sig)

    async def _run(self) -> int:
        # what was set, not the 70 defaults (--verbose or --log-level DEBUG: every key; `sluice config` prints them)
        self.say(self.config.describe(), debug=True)
        if changed := self.config.describe(changed_only=True):
            self.say(changed)
        if self.plan is not None:
            self.say(self.plan.describe())
        if self.threads_note:
            self.say(self.threads_note)
        if self.config.ps.recover:  # where to look on a host, and what the job removes at its end
            self.say(f"ps.recover: the servers commit their state to {state_path(state_tag(self.spawner.secret), 0)}"
                     "-like files on their hosts")
        role_argv = [sys.executable, "-m", "sluice.launch.cli"]
        if self.options.preload and self.spawner.local_workers():  # it imports them while the roles start
            adopted = self.spawner.preloader_child  # an elastic job's earlier generation's, still running
            self._tell_janitor(adopted or await self.spawner.start_preloader(self.options.preload))
        try:  # before anything starts: a port taken there is the user's to change
            self.spawner.master_port = await choose(self.spawner, self.options.master_port)
        except MasterPortError as exc:
            self.complain(str(exc))
            return 2
        schedulers = await self._start_schedulers(role_argv)
        if isinstance(schedulers, int):
            return schedulers
        self.schedulers, sched, standbys, endpoint = schedulers, schedulers.primary, schedulers.standbys, self.endpoint
        aggregators = f", {_count(self.aggregators, 'aggregator')}" if self.aggregators else ""
        self.say(f"scheduler ready at {endpoint}; starting {_count(self.servers, 'server')}, "
                 f"{_count(self.workers, 'worker')}{aggregators}")
        plan = [("server", rank, [*role_argv, "server"]) for rank in range(self.servers)]
        plan += [("aggregator", rank, [*role_argv, "aggregator"]) for rank in range(self.aggregators)]
        plan += [("worker", rank, self.command) for rank in range(self.workers)]
        try:
            await self.spawner.preloaded(self.ready_timeout, self.interrupted)
        except PreloadError as exc:
            self.complain(f"--preload {','.join(self.options.preload)}: {exc}; fix the module names, or leave it out")
            return 2
        if self.interrupted.done():  # Ctrl-C while the preloader imported
            return self.interrupted.result()
        started: list[Child] = []
        for role, rank, argv in plan:
            try:
                started.append(await self.spawn(role, rank, argv, endpoint))
            except OSError as exc:
                self.complain(f"cannot start {role} {rank} ({shlex.join(argv)}): {exc}")
                return 1
        roles = [sched, *standbys, *(c for c in started if c.role != "worker")]
        workers = [c for c in started if c.role == "worker"]
        self.running()
        return await self._watch(roles, workers)

    async def _watch(self, roles: list[Child], workers: list[Child]) -> int:
        running: dict[asyncio.Future[Any], Child] = {child.done: child for child in workers}
        role_tasks: dict[asyncio.Future[Any], Child] = {child.done: child for child in roles}
        ended: Child | None = None  # the first role that exited 0 while workers were still running
        deadline = ended_at = math.inf
        loop = asyncio.get_running_loop()
        while running:
            watched: list[asyncio.Future[Any]] = [*running, *role_tasks, self.interrupted]
            timeout = None if ended is None else max(0.0, deadline - loop.time())
            done, _ = await asyncio.wait(watched, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if self.interrupted.done():
                return self.interrupted.result()
            if not done:  # the job ended: a worker's script may still run (saving, evaluating after shutdown()),
                assert ended is not None  # as under horovodrun or torchrun: wait for its own exit code, and say so
                names = ", ".join(child.label for child in running.values())
                verb, pronoun = ("runs", "it") if len(running) == 1 else ("run", "them")
                self.say(f"the job ended ({ended.label} exited 0) {loop.time() - ended_at:.0f} s ago and {names} "
                         f"still {verb}; waiting for {pronoun} to exit (Ctrl-C stops the job)")
                deadline = loop.time() + STILL_RUNNING_EVERY_S
                continue
            for task in sorted(done, key=lambda t: t in role_tasks):  # a failed worker is the likelier cause
                if task not in role_tasks and task not in running:  # a role a replacement took the place of
                    continue
                code: int = task.result()
                if task in role_tasks:
                    child = role_tasks.pop(task)
                    if code != 0 and (replacement := await self._replace(child)) is not None:
                        role_tasks[replacement.done] = replacement
                        roles[roles.index(child)] = replacement
                        continue
                    if code != 0 and self.schedulers and (line := self.schedulers.survive(child, code)):
                        self.complain(line)
                        continue
                    if code != 0:
                        return await self._failed(child)
                    # the scheduler ends the job once every worker said goodbye, which is usually a moment
                    # before those workers exit: after `grace`, say which still run (and go on waiting)
                    if ended is None:
                        ended, ended_at = child, loop.time()
                        deadline = ended_at + self.grace
                    continue
                child = running.pop(task)
                if code != 0 and (swap := await self._replace_worker(child)) is not None:
                    worker, old_roles, new_roles = swap  # replaced in place, or gone (--elastic --in-place)
                    if worker is not None:
                        running[worker.done] = worker
                    for old in old_roles:
                        role_tasks.pop(old.done, None)
                    role_tasks.update((role.done, role) for role in new_roles)
                    roles[:] = [r for r in roles if r not in old_roles] + new_roles
                    continue
                if code != 0:
                    return await self._worker_failed(child)
        self.say("all workers finished")
        return await self._wind_down(roles)

    async def _replace(self, dead: Child) -> Child | None:
        """With ps.recover, start a dead server (ps/snapshot.py, scheduler/recovery.py) or aggregator (on its host;
        with ps.replicas on another when its host is lost) again under its name, up to ps.max_restarts times in the
        job; None when it is not to be replaced."""
        ps = self.config.ps
        moved_to = self.takeovers.aggregator_host_lost(dead)
        if dead.role not in ("server", "aggregator") or not ps.recover or self.stopping \
                or (dead.role == "aggregator" and dead.returncode == SSH_FAILED and moved_to is None):
            return None
        if self.restarts >= ps.max_restarts:
            self.complain(f"{dead.name} {exit_description(dead.returncode or 0)}, and the job already restarted "
                          f"servers {self.restarts} times (ps.max_restarts)")
            return None
        self.restarts += 1
        if dead.role == "aggregator":
            where = f" on {self.plan.address(moved_to)}, as its host is lost" if moved_to and self.plan else ""
            self.report(dead, f"; restarting it{where} ({self.restarts} of at most {ps.max_restarts} restarts)")
            self.children.remove(dead)
            try:
                return await self.spawn("aggregator", dead.rank, [sys.executable, "-m", "sluice.launch.cli",
                                                                  "aggregator"], self._acting_scheduler(), moved_to)
            except OSError as exc:
                self.complain(f"cannot restart {dead.label}: {exc}")
                return None
        moved_to = self.takeovers.host_lost(dead)
        if moved_to is not None:
            self.complain(self.takeovers.describe(dead, moved_to))
        self.complain(f"{dead.name} {exit_description(dead.returncode or 0)}; restarting it "
                      f"({self.restarts} of at most {ps.max_restarts} restarts)")
        self.complain(f"last lines of {dead.label}:\n{dead.last_lines()}")
        self.children.remove(dead)  # what it did is told; the blame of a later failure is its replacement's
        try:
            # a moved server's state file is the mirror it took over, restarted or not (ps/mirror_links.py)
            moved = self.takeovers.host_of(dead.rank)
            took_from = {ENV_TAKEOVER: str(self.takeovers.took_from[dead.rank])} if moved is not None else None
            return await self.spawn("server", dead.rank, [sys.executable, "-m", "sluice.launch.cli", "server"],
                                    self._acting_scheduler(), moved, took_from)
        except OSError as exc:
            self.complain(f"cannot restart {dead.label}: {exc}")
            return None

    def _acting_scheduler(self) -> str:
        """Where a restarted role registers: the scheduler, or the standby that took the job over from it."""
        if self.schedulers is None:
            return self.endpoint
        acting = self.schedulers.acting()
        return acting.ready.result() if acting.ready.done() and not acting.ready.cancelled() else self.endpoint

    def _node_silent(self, role: str, rank: int) -> None:
        """The scheduler says `role` `rank` fell silent: if it runs on another host reached over ssh, check at once
        whether that host still answers, rather than wait for ssh to find the session dead."""
        child = next((c for c in self.children if c.role == role and c.rank == rank and not c.done.done()), None)
        if child is None or child.host is None or child.via != "ssh" or self.plan is None or child.host in self.probing:
            return
        self.probing.add(child.host)
        self.probes.add(task := asyncio.create_task(self._probe(child.host, child.label)))
        task.add_done_callback(self.probes.discard)

    async def _probe(self, host: str, label: str) -> None:
        assert self.plan is not None
        address, port = self.plan.address(host), self.plan.reach.ssh_port or 22
        try:
            if await host_answers(address, port):
                return
        finally:
            self.probing.discard(host)
        self.complain(f"{label} is silent and its host {address} does not answer on port {port} within "
                      f"{PROBE_S:g} s: taking the host as lost")
        for child in self.children:
            if child.host == host and child.via == "ssh" and not child.done.done():
                child.host_lost = True
                with contextlib.suppress(ProcessLookupError):
                    child.proc.kill()

    def state_items(self) -> list[str]:
        """The job's state in /dev/shm on each host, as launch/janitor.py names it."""
        return [state_tag(self.spawner.secret)] if self.config.ps.recover else []

    def swept(self, items: list[str]) -> list[str]:
        """What of `items` to remove from the other hosts as this job ends."""
        return items

    # hooks for an elastic job's generations (launch/generations.py)
    def started(self) -> None:
        """The janitor is up, no child yet."""

    def running(self) -> None:
        """Every process of the job was started."""

    def ended(self) -> None:
        """The job is over; its processes are about to be stopped."""

    async def _replace_worker(self, dead: Child) -> tuple[Child | None, list[Child], list[Child]] | None:
        """An elastic job's hook (launch/generations.py): a worker died; (its replacement, None when the job
        went on without it, the roles stopped, the roles started in their place) when it was handled in
        place, else None."""
        return None

    async def _worker_failed(self, child: Child) -> int:
        return await self._failed(child)


async def supervise(config: SluiceConfig, workers: int, servers: int, command: Sequence[str], *,
                    grace: float = 10.0, ready_timeout: float = 60.0,
                    out: BinaryIO | None = None, err: TextIO | None = None, aggregators: int = 0,
                    plan: ClusterPlan | None = None, options: RunOptions | None = None) -> int:
    """Runs one job to its end, on this machine or over `plan`'s hosts; returns the launcher's exit code."""
    return await Job(config, workers, servers, command, grace, ready_timeout,
                     out if out is not None else sys.stdout.buffer, err if err is not None else sys.stderr,
                     aggregators, plan, options=options).run()


def run_on_loop(job: Coroutine[Any, Any, int]) -> int:
    """`job` on uvloop (its subprocesses honour preexec_fn), or on asyncio's loop without it."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(job)
    return int(uvloop.run(job))
