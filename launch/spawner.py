"""How the launcher starts one process of a job: its variables, and where (here, or through ssh/srun on its host).

Every process learns its place from SLUICE_* variables (scheduler/bootstrap.py); workers also get
torchrun's (RANK, LOCAL_RANK, MASTER_ADDR, ...), so DDP scripts run unchanged. The job secret never
travels in a command line or an environment: here it is an inherited pipe; on another host it is
in the header the remote stub reads from the session's stdin (launch/reach.py, launch/remote.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import sys
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from sluice.launch.children import Child, Sink
from sluice.launch.cluster import ClusterPlan
from sluice.launch.config import SluiceConfig
from sluice.launch.layout import Process
from sluice.launch.output import folder
from sluice.launch.preload import ForkedProcess, Preloader, forkable
from sluice.launch.reach import forwarded_env, header_line, stub_argv
from sluice.launch.run_options import OutputOptions
from sluice.launch.torchrun_env import torchrun_env
from sluice.scheduler.bootstrap import ENV_ELASTIC_GENERATION, ENV_SECRET_FD, NodeEnv, secret_pipe

_PROJECT_ROOT = str(Path(__file__).resolve().parent.parent)


class Spawner:
    def __init__(self, config: SluiceConfig, workers: int, servers: int, aggregators: int, plan: ClusterPlan | None,
                 secret: bytes, sink: Sink, base_env: Mapping[str, str], preexec: Callable[[], None] | None,
                 master_port: int, worker_env: Mapping[str, str], output: OutputOptions | None = None) -> None:
        self.config, self.workers, self.servers, self.aggregators = config, workers, servers, aggregators
        self.plan, self.secret, self.sink, self.preexec = plan, secret, sink, preexec
        self.base_env = dict(base_env)
        #: more variables every worker gets (the elastic state directory and generation)
        self.worker_env = dict(worker_env)
        self.master_port = master_port
        #: per-rank log files and timestamps (launch/output.py)
        self.output = output or OutputOptions()
        #: the standby scheduler's endpoint, once it announced it (scheduler.standby); every node is told it
        self.standby = ""
        #: roles on other hosts outlive the end of their session (a standby runs on one: launch/remote.py)
        self.outlive = False
        #: local workers are forked from it (`--preload`) when their command allows (launch/preload.py)
        self.preloader: Preloader | None = None
        self.starting: Preloader | None = None  # started, maybe not ready yet
        self.preloader_child: Child | None = None  # its output relayed, its exit watched
        # torch.distributed's rendezvous (ddp_hook) is worker 0's
        self.master_addr = "127.0.0.1" if plan is None else plan.address(plan.place("worker", 0).host)

    def _pythonpath(self) -> str:
        """Our own modules first: role processes run them, wherever the launcher was started."""
        return os.pathsep.join(p for p in (_PROJECT_ROOT, self.base_env.get("PYTHONPATH")) if p)

    def node_environ(self, role: str, rank: int, scheduler: str, moved_to: str | None = None
                     ) -> tuple[dict[str, str], str | None]:
        """The variables that give a process its place in the job, and the host it runs on if not here
        (`moved_to`: a server started on another host than the plan's, ps.replicas)."""
        sections = self.config.to_sections()
        place = self.plan.place(role, rank) if self.plan is not None and role != "scheduler" else None
        if place is not None and moved_to is not None:
            place = dataclasses.replace(place, host=moved_to)
        elif self.plan is not None and moved_to is not None:  # the standby scheduler, on a host of its own
            place = Process(role, rank, moved_to, 0)
        if self.plan is not None:  # every process listens on its own host's address
            sections["transport"]["host"] = self.plan.address(place.host) if place else self.plan.launcher_address
        node = NodeEnv(scheduler, role, rank, self.workers, self.servers, sections, aggregators=self.aggregators,
                       standby=self.standby if role != "scheduler" else "")
        env = node.to_environ()
        if role != "worker":  # role processes run our own module, wherever the launcher was started
            env["PYTHONPATH"] = self._pythonpath()
            if role == "scheduler" and ENV_ELASTIC_GENERATION in self.worker_env:  # it refuses another's REJOIN
                env[ENV_ELASTIC_GENERATION] = self.worker_env[ENV_ELASTIC_GENERATION]
        else:  # torchrun's variables, so a DDP script's init_process_group() works unchanged (ddp_hook)
            local_rank, local_size, group, groups = rank, self.workers, 0, 1
            if place is not None and self.plan is not None:
                local_rank, local_size = place.local_rank, self.plan.workers_on(place.host)
                hosts = list(dict.fromkeys(p.host for p in self.plan.layout.processes if p.role == "worker"))
                group, groups = hosts.index(place.host) if place.host in hosts else len(hosts), max(len(hosts), 1)
            env.update(torchrun_env(rank, self.workers, local_rank, local_size, group, groups),
                       MASTER_ADDR=self.master_addr, MASTER_PORT=str(self.master_port), **self.worker_env)
        remote = place is not None and self.plan is not None and self.plan.is_remote(place.host)
        return env, place.host if remote and place is not None else None

    async def start(self, role: str, rank: int, argv: list[str], scheduler: str, moved_to: str | None = None,
                    extra_env: Mapping[str, str] | None = None) -> Child:
        env, host = self.node_environ(role, rank, scheduler, moved_to)
        env.update(extra_env or {})
        proc: asyncio.subprocess.Process | ForkedProcess
        command = forkable(argv, sys.executable, self.base_env.get("PATH")) \
            if self.preloader is not None and role == "worker" else None
        if host is None and command is not None:
            proc = await self._fork_here(argv, command, {**self.base_env, **env})
        elif host is None:
            proc = await self._start_here(argv, {**self.base_env, **env})
        else:
            proc = await self._start_there(host, argv, env, split=self.output.split, outlive=self.outlive)
        output = self.output
        if role == "worker" and output.ranks is not None and int(env["LOCAL_RANK"]) not in output.ranks:
            output = dataclasses.replace(output, console=frozenset())  # the same files, kept apart from the terminal
        return Child(role, rank, proc, self.sink, host, self.plan.reach.method if host and self.plan else "",
                     output, folder(role, rank, self.workers))

    async def sweep(self, items: list[str], timeout: float = 15.0, lost: Collection[str] = ()) -> None:
        """Remove the job's state (launch/janitor.py's `state` items) on every other host of the job but the
        `lost` ones."""
        if self.plan is None or not items:
            return
        hosts = [h for h in dict.fromkeys(p.host for p in self.plan.layout.processes)
                 if self.plan.is_remote(h) and h not in lost]
        argv = [sys.executable, "-m", "sluice.launch.janitor", "--remove", *items]
        env = {"PYTHONPATH": self._pythonpath()}
        started = []
        for host in hosts:
            with contextlib.suppress(OSError):
                proc = await self._start_there(host, argv, env)
                assert proc.stdin is not None
                proc.stdin.close()  # the stub runs it to its end, whatever the session does
                started.append(proc.communicate())
        if started:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*started, return_exceptions=True), timeout)

    async def run_there(self, host: str, python_argv: list[str], timeout: float) -> tuple[int | None, str]:
        """Run our Python with `python_argv` on `host` to its end: (exit status, output), None on timeout."""
        proc = await self._start_there(host, [sys.executable, *python_argv], {"PYTHONPATH": self._pythonpath()})
        assert proc.stdout is not None and proc.stdin is not None
        try:  # stdin stays open until the end: its end would stop the program (launch/remote.py)
            output = await asyncio.wait_for(proc.stdout.read(), timeout)
        except TimeoutError:
            proc.kill()
            output = b""
        proc.stdin.close()
        code = await proc.wait()
        return (None if not output and code < 0 else code), output.decode(errors="replace")

    async def _start_here(self, argv: list[str], env: dict[str, str]) -> asyncio.subprocess.Process:
        secret_fd = secret_pipe(self.secret)  # the job secret: through a pipe, never argv, environ or logs
        env[ENV_SECRET_FD] = str(secret_fd)
        # one pipe keeps stdout and stderr lines in the order written; two, when log files keep them apart
        stderr = asyncio.subprocess.PIPE if self.output.split else asyncio.subprocess.STDOUT
        try:
            return await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=stderr, env=env,
                start_new_session=True, preexec_fn=self.preexec,
                pass_fds=(secret_fd,),
            )
        finally:
            os.close(secret_fd)

    async def start_preloader(self, modules: Sequence[str]) -> Child:
        """Start the process local workers are forked from (`--preload`); its own output is relayed as
        `[preload]`'s. Workers are forked from it only once `preloaded()` said it is ready."""
        self.starting = await Preloader.launch(modules, self.base_env, self.preexec)
        self.preloader_child = Child("preload", 0, self.starting.proc, self.sink, options=self.output)
        return self.preloader_child

    def local_workers(self) -> bool:
        """Does any worker run on this machine (where `--preload` forks them)?"""
        return self.plan is None or any(not self.plan.is_remote(self.plan.place("worker", rank).host)
                                        for rank in range(self.workers))

    async def preloaded(self, timeout: float, interrupted: asyncio.Future[int]) -> None:
        """Wait for the preloader to have imported its modules (PreloadError saying why it did not), or for
        the launcher to be `interrupted`."""
        if self.starting is None:
            return
        imported = asyncio.ensure_future(self.starting.imported(timeout))
        either: list[asyncio.Future[Any]] = [imported, interrupted]
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if not imported.done():
            imported.cancel()
            return
        imported.result()
        self.preloader = self.starting

    async def stop_preloader(self) -> None:
        if self.starting is not None:
            await self.starting.close()
            self.starting = self.preloader = self.preloader_child = None

    def hand_over_preloader(self) -> tuple[Preloader, Child] | None:
        """The preloader, ready and still running, for an elastic job's next generation, whose workers are then
        forked at once; this spawner no longer stops it. None when there is none to hand over."""
        preloader, child = self.preloader, self.preloader_child
        if preloader is None or child is None or preloader.proc.returncode is not None:
            return None
        self.starting = self.preloader = self.preloader_child = None
        return preloader, child

    def adopt_preloader(self, held: tuple[Preloader, Child]) -> None:
        """Fork local workers from the preloader a previous generation handed over."""
        self.starting = self.preloader = held[0]
        self.preloader_child = held[1]

    async def _fork_here(self, argv: list[str], command: list[str], env: dict[str, str]) -> ForkedProcess:
        """A worker forked from the preloader (`command` as launch/preload.py's forkable() gives it)."""
        assert self.preloader is not None
        secret_fd = secret_pipe(self.secret)
        env[ENV_SECRET_FD] = str(secret_fd)  # the worker's own descriptor number replaces it there
        try:
            return await self.preloader.spawn(argv, command, env, secret_fd, self.output.split)
        finally:
            os.close(secret_fd)

    async def _start_there(self, host: str, argv: list[str], env: dict[str, str],
                           split: bool = False, outlive: bool = False) -> asyncio.subprocess.Process:
        """ssh (or srun) running the remote stub on `host`; the header, secret included, goes on its stdin,
        which stays open: its end is the role's end (launch/remote.py). `split`: the role's stderr comes
        apart from its stdout, on ssh's (srun's) own stderr."""
        assert self.plan is not None
        cwd = os.getcwd()
        proc = await asyncio.create_subprocess_exec(
            *stub_argv(self.plan.reach, host, sys.executable, cwd), stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE if split else asyncio.subprocess.STDOUT,
            env=self.base_env, start_new_session=True, preexec_fn=self.preexec,
        )
        assert proc.stdin is not None
        # ssh may be gone already (refused, unreachable): its exit status and output then tell why
        with contextlib.suppress(ConnectionError, RuntimeError):
            proc.stdin.write(header_line(argv, {**forwarded_env(self.base_env), **env}, cwd, self.secret, split,
                                         outlive))
            await proc.stdin.drain()
        return proc


class KeptPreloader:
    """The preloader (--preload) kept from one job of a launcher to the next (an elastic job's generations, the starts
    of a job under --max-restarts), so that the next forks its workers at once; close() when the last has run."""

    def __init__(self) -> None:
        self.held: tuple[Preloader, Child] | None = None

    async def run(self, spawner: Spawner, job: Awaitable[int]) -> int:
        """Run `job`, whose processes `spawner` starts, from the preloader kept; keep its preloader if it hands it
        over (also when `job` raised: close() then stops it)."""
        if self.held is not None:
            spawner.adopt_preloader(self.held)
        try:
            return await job
        finally:
            self.held = spawner.hand_over_preloader()

    async def close(self) -> None:
        if self.held is not None:
            await self.held[0].close()
            self.held = None
