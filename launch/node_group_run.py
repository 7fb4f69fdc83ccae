"""One machine's share of a job run with a launcher per machine (launch/node_group.py): started, watched, stopped."""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import signal
import sys
from dataclasses import replace

import zmq

from sluice.launch.blame import judge
from sluice.launch.children import Child, Sink, death_signal_hook
from sluice.launch.config import ConfigError, SluiceConfig
from sluice.launch.ending import SETTLE_SECONDS
from sluice.launch.hosts import HostsError
from sluice.launch.janitor import Janitor
from sluice.launch.machine_zero import MachineZero, Place, RankError, RankService, Starts, rank_keys
from sluice.launch.node import NodeError, Start, job_secret, plan
from sluice.launch.node_group import NodeGroup, port_clash, processes, rank_port
from sluice.launch.node_ranks import JobBook, nodes_text
from sluice.launch.preload import ForkedProcess, Preloader, PreloadError, forkable
from sluice.launch.reach import host_address
from sluice.launch.run_options import RunOptions
from sluice.launch.torchrun_env import torchrun_env
from sluice.scheduler.bootstrap import ENV_SECRET_FD, secret_pipe
from sluice.transport.auth import SecretFileError

#: how long the processes get to end after SIGTERM before SIGKILL
STOP_S = 10.0
#: with more than one machine, how often a launcher looks whether another machine's failure ended the job (or, with
#: --max-restarts, started it again)
WATCH_S = 0.5
#: the job over on another machine's failure that machine 0 could not name (the failed machine never said what): how
#: long this machine's processes get to fail by themselves, naming the cause as they learned it (a peer that left),
#: before the launcher stops them; a collective the lost peer never joined fails 5 s after it left (worker/collective's
#: LEFT_GRACE_S). With the cause named, the launcher stops them at once, saying it
OWN_FAILURE_S = 10.0
#: machine 0, the job over on a failure: how long it keeps answering the other launchers, which ask every WATCH_S
#: whether the job goes on, before it leaves (without it, a machine whose own processes wait for a scheduler that
#: never started would wait out their rendezvous timeout)
OVER_LINGER_S = 2.0
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class NodeGroupRun:
    """This machine's processes of the job: planned, started (workers forked with --preload), watched, stopped."""

    def __init__(self, group: NodeGroup, args: argparse.Namespace, command: list[str], servers: int | None,
                 options: RunOptions, sets: list[str], config: SluiceConfig, restarts: int = 0,
                 zero: MachineZero | None = None) -> None:
        """`servers`: -s, or None for one a machine (of each start, with an elastic range)."""
        self.group, self.args, self.command = group, args, command
        self.servers_given = servers
        #: --max-restarts, and this machine's line to machine 0 (None on machine 0, or without restarts or an
        #: asked rank)
        self.restarts, self.zero = restarts, zero
        self.config = config
        self.options, self.sets = options, sets
        self.sink = Sink(sys.stdout.buffer)
        self.children: list[Child] = []
        self.janitor: Janitor | None = None
        #: --preload: the process this machine's workers are forked from (launch/preload.py)
        self.preloader: Preloader | None = None
        #: this machine's place in the current start, and what failed here in it (told machine 0, which tells the
        #: other machines: "machine 1 (host): worker 3 exited with code 1")
        self.place: Place | None = None
        self.failure = ""

    @property
    def servers(self) -> int:
        """-s, else one a machine of the current start."""
        return self.group.nnodes if self.servers_given is None else self.servers_given

    def say(self, text: str) -> None:
        if not self.options.quiet:
            self.sink.write(f"[launch] {text}\n".encode())

    def complain(self, text: str) -> None:
        print(f"sluice launch: {text}", file=sys.stderr, flush=True)

    def _namespace(self, index: int) -> argparse.Namespace:
        """`sluice node`'s arguments for process `index` of the job (launch/node.py plans each the same way)."""
        host, port = self.group.rendezvous
        return argparse.Namespace(
            workers=self.group.nnodes * self.group.nproc, servers=self.servers, aggregators=0, standbys=[],
            index=index, index_failures=0, worker_command=self.command, scheduler=f"{host}:{port}",
            config=self.args.config, sets=self.sets, secret_file=self.args.secret_file,
            master=f"{host}:{self.group.master_port}")

    def _plan(self, role: str, rank: int) -> Start:
        """How process (`role`, `rank`) starts: as `sluice node` would start it; NodeError, ConfigError or
        SecretFileError saying what to change."""
        index = 0 if role == "scheduler" else 1 + rank if role == "server" else 1 + self.servers + rank
        return plan(self._namespace(index), os.environ)

    def _plans(self, place: Place) -> list[tuple[Start, int]]:
        """This machine's processes in `place`, each planned as `sluice node` would start it (NodeError, ConfigError or
        SecretFileError saying what to change)."""
        self.group = replace(self.group, nnodes=place.nnodes, node_rank=place.rank)
        return [(self._plan(role, rank), local) for role, rank, local in processes(self.group, self.servers)]

    async def _start(self, start: Start, local_rank: int, place: Place) -> Child:
        role, rank = start.role, start.rank
        env = {**start.env, **self.options.environ()}
        if role == "worker":  # torchrun's variables for a worker of this machine
            env.update(torchrun_env(rank, place.nnodes * self.group.nproc, local_rank, self.group.nproc, place.rank,
                                    place.nnodes, place.failures, self.restarts))
        secret_fd = secret_pipe(start.secret) if start.secret else None
        if secret_fd is not None:
            env[ENV_SECRET_FD] = str(secret_fd)
        stderr = asyncio.subprocess.PIPE if self.options.output.split else asyncio.subprocess.STDOUT
        if self.options.verbose:
            self.say(f"starting {role} {rank}: {shlex.join(start.argv)}")
        forked = forkable(start.argv, sys.executable, env.get("PATH")) if self.preloader and role == "worker" else None
        proc: asyncio.subprocess.Process | ForkedProcess
        try:
            if forked is not None and self.preloader is not None and secret_fd is not None:
                proc = await self.preloader.spawn(start.argv, forked, env, secret_fd, self.options.output.split)
            else:
                proc = await asyncio.create_subprocess_exec(
                    *start.argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=stderr,
                    env=env, start_new_session=True, preexec_fn=death_signal_hook(),
                    pass_fds=() if secret_fd is None else (secret_fd,))
        finally:
            if secret_fd is not None:
                os.close(secret_fd)
        child = Child(role, rank, proc, self.sink, options=self.options.output)
        if (janitor := self.janitor) is not None:  # told at once: a launcher killed now leaves nothing behind
            janitor.spawned(proc.pid)
            child.done.add_done_callback(lambda _: janitor.reaped(proc.pid))
        return child

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        interrupted: asyncio.Future[int] = loop.create_future()

        def on_signal(sig: signal.Signals) -> None:
            if not interrupted.done():
                interrupted.set_result(128 + sig)

        for sig in _SIGNALS:
            loop.add_signal_handler(sig, on_signal, sig)
        group = self.group
        if (clash := port_clash(group, self.config.transport.channels)) is not None:
            self.complain(f"error: {clash}")
            return 2
        try:  # every process planned before any starts: a missing secret file or a bad setting starts nothing
            plans = self._plans(Place(0, group.node_rank or 0, group.nnodes or group.nodes[1], 0))
        except (NodeError, ConfigError, SecretFileError) as exc:
            self.complain(f"error: {exc}")
            return 2
        for note in dict.fromkeys(note for start, _ in plans for note in start.notes):
            self.complain(note)
        ranks = self._serve_ranks(loop) if group.node_rank == 0 else None
        # with more than one machine, each follows the job's starts on machine 0: a failure anywhere ends (or, with
        # --max-restarts, restarts) every machine's processes, not only the failed machine's
        several = self.restarts or group.nodes[1] > 1  # an elastic range's maximum is above 1 too
        job = Starts(ranks, self.zero, self.config.scheduler.rendezvous_timeout, self.say, group.join_s) \
            if several and (ranks or self.zero) else None
        self.janitor = Janitor()  # before any child: should this launcher be killed outright, it stops them
        try:
            if group.elastic and job is None:
                return 2  # machine 0 could not serve the others (said)
            if self.options.preload and (code := await self._preload()):
                return code
            start = 0
            while True:
                fixed = None if group.elastic else Place(start, group.node_rank or 0, group.nnodes, start)
                try:
                    place = await job.place(start, fixed, interrupted) if job is not None else fixed
                except RankError as exc:
                    self.complain(f"{exc}; this machine cannot start")
                    return 1
                if place is None:  # interrupted, or the job failed on another machine with no restart left
                    return interrupted.result() if interrupted.done() else 1
                plans = self._plans(place)
                code, failed = await self._run_start(plans, place, interrupted, job)
                await self._stop()
                if job is None or not failed:
                    return code
                try:
                    start, over = await job.failed(place.start, self.failure) if failed == "here" else await job.now(
                        (place.start, True))
                except RankError as exc:
                    self.complain(f"{exc}; this machine cannot start again")
                    return code
                if over:
                    if self.restarts:
                        self.complain(f"the job failed with no restart left (--max-restarts {self.restarts}); "
                                      "ending it")
                    return code
                self.say(f"restarting this machine's processes: start {start + 1}" + (
                    f" (--nnodes {nodes_text(group.nodes)}, --max-restarts {self.restarts})" if group.elastic else
                    f" of at most {self.restarts + 1} (--max-restarts {self.restarts}; the workers see "
                    f"TORCHELASTIC_RESTART_COUNT={start})"))
        finally:
            await self._stop()
            if ranks is not None:
                if job is not None and ranks.state()[1]:  # over: the others learn it from us before we go
                    await asyncio.sleep(OVER_LINGER_S)
                ranks.close()
            if self.zero is not None:
                self.zero.close()
            if self.preloader is not None:  # after the workers forked from it
                await self.preloader.close()
            self.janitor.close()
            for sig in _SIGNALS:
                loop.remove_signal_handler(sig)

    def _serve_ranks(self, loop: asyncio.AbstractEventLoop) -> RankService | None:
        """Machine 0 serves the other launchers (launch/machine_zero.py: ranks for those started without one, the
        job's starts under --max-restarts) for the job's life; None (said) when it cannot: they then say that machine
        0 does not answer."""
        host, _ = self.group.rendezvous
        port = rank_port(self.group, self.config.transport.channels)

        def said(text: str) -> None:  # on the service's thread
            loop.call_soon_threadsafe(self.say, text)

        try:
            secret = job_secret(self.args.secret_file, self.config.transport.curve, [])
            return RankService(host_address(host), port, rank_keys(secret) if secret else None,
                               JobBook(self.group.nodes, self.group.nproc, self.restarts, self.group.last_call_s),
                               said)
        except (HostsError, NodeError, SecretFileError, zmq.ZMQError) as exc:
            if self.group.elastic:
                self.complain(f"error: cannot serve the other machines at {host}:{port} ({exc}), which an elastic "
                              "range (--nnodes MIN:MAX) needs: free the port, or give another --rdzv-endpoint")
            else:
                self.complain(f"warning: cannot hand out machine ranks at {host}:{port} ({exc}); machines started "
                              "without --node-rank cannot join")
            return None

    async def _preload(self) -> int:
        """Start the preloader and wait for its imports; an exit code when it failed, else 0."""
        preloader = await Preloader.launch(self.options.preload, os.environ, death_signal_hook())
        relay = Child("preload", 0, preloader.proc, self.sink, options=self.options.output)
        if (janitor := self.janitor) is not None:
            janitor.spawned(preloader.proc.pid)
            relay.done.add_done_callback(lambda _: janitor.reaped(preloader.proc.pid))
        try:
            await preloader.imported(self.args.ready_timeout)
        except PreloadError as exc:
            self.complain(f"--preload {','.join(self.options.preload)}: {exc}; fix the module names, or leave it out")
            await preloader.close()
            return 2
        self.preloader = preloader
        return 0

    async def _run_start(self, plans: list[tuple[Start, int]], place: Place, interrupted: asyncio.Future[int],
                         job: Starts | None) -> tuple[int, str]:
        """Start this machine's processes of `place` (machine 0 started its own of it) and watch them: the exit code,
        and "here" when one failed, "elsewhere" when the job moved on to another start (or ended) because of another
        machine, "" otherwise."""
        host, port = self.group.rendezvous
        self.say(f"machine {place.rank} of {place.nnodes}: "
                 + ", ".join(f"{start.role} {start.rank}" if start.role != "scheduler" else "the scheduler"
                             for start, _ in plans) + f"; the scheduler at {host}:{port}")
        self.children, self.place, self.failure = [], place, ""
        for plan_, local in plans:
            try:
                self.children.append(await self._start(plan_, local, place))
            except OSError as exc:
                self.complain(f"cannot start {plan_.role} {plan_.rank}: {exc}")
                return 1, ""
        if job is not None:
            job.started(place.start)
        return await self._watch(interrupted, job, place.start)

    async def _watch(self, interrupted: asyncio.Future[int], job: Starts | None, restart: int) -> tuple[int, str]:
        running: dict[asyncio.Future[int], Child] = {child.done: child for child in self.children}
        while running:
            done, _ = await asyncio.wait([*running, interrupted], timeout=None if job is None else WATCH_S,
                                         return_when=asyncio.FIRST_COMPLETED)
            if interrupted.done():
                self.complain(f"received {signal.Signals(interrupted.result() - 128).name}; stopping this "
                              "machine's processes")
                return interrupted.result(), ""
            for task in done:
                child = running.pop(task)  # not `interrupted`: that returned above
                code = task.result()
                if code != 0:
                    return await self._failed(child, code), "here"
            if not done and job is not None and (moved := await job.now((restart, False))) != (restart, False):
                # with no cause from machine 0 (the failed machine could not say), this machine's processes get to
                # say why, in their words (e.g. which worker left)
                if moved[1] and not job.failure and (own := await self._own_failure(running)) is not None:
                    return own, "here"
                cause = (f"another machine's processes failed ({job.failure})" if job.failure else
                         "the job's machines changed (one joined)" if self.group.elastic else
                         "another machine's processes failed")
                self.complain(cause + ("; stopping this machine's" if moved[1] else
                                       f"; the job starts again (start {moved[0] + 1})"))
                return 1, "elsewhere"
        self.say(f"machine {self.group.node_rank}: every process finished")
        return 0, ""

    async def _own_failure(self, running: dict[asyncio.Future[int], Child]) -> int | None:
        """The job ended on another machine: give this machine's processes OWN_FAILURE_S to fail by themselves (they
        learn of a lost peer through the scheduler, and name it); the exit code said, or None when they did not."""
        done, _ = await asyncio.wait(list(running), timeout=OWN_FAILURE_S, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if (code := task.result()) != 0:
                return await self._failed(running[task], code)
        return None

    async def _failed(self, first: Child, code: int) -> int:
        """Name the first cause (launch/blame.py: a process killed from outside, else the first a process here
        reported, such as a lost machine's worker, else the first exit) and show its last lines."""
        if code > 0:  # a consequence, maybe: the report of its cause, or the cause's own exit, may be a moment behind
            await asyncio.sleep(SETTLE_SECONDS)
        failed = [c for c in self.children if c.returncode and c.ended_at is not None]
        first = min(failed, key=lambda c: c.ended_at or 0.0, default=first)  # seen first, not woken for first
        verdict = judge(first, self.children, lambda _: "")
        self.complain(f"{verdict.headline}; stopping this machine's processes")
        shown = verdict.cause if isinstance(verdict.cause, Child) else first
        self.complain(f"last lines of {shown.label}:\n{shown.last_lines()}")
        here = self.place.rank if self.place is not None else self.group.node_rank
        last = next((line.strip() for line in reversed(shown.tail) if line.strip()), "")
        self.failure = f"machine {here} ({os.uname().nodename}): {verdict.headline}" + (
            f"; its last line: {last}" if last else "")
        code = first.returncode or code
        return code if code > 0 else 128 - code

    async def _stop(self) -> None:
        live = [child for child in self.children if not child.done.done()]
        for child in live:
            child.stop()
        if live:
            await asyncio.wait([child.done for child in live], timeout=STOP_S)
        for child in live:
            child.signal_group(signal.SIGKILL)
        await asyncio.gather(*(child.done for child in self.children), return_exceptions=True)
