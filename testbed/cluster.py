"""A real local cluster for tests and benchmarks: forked scheduler, server and worker processes on 127.0.0.1."""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import queue
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from sluice import close_at_exit
from sluice.scheduler.bootstrap import ENV_SECRET_FD, NodeEnv, new_secret, secret_pipe
from sluice.transport.shm import remove_segments_of
from testbed.children import child_tempdir, remove_tempdirs, use_tempdir

_ctx = mp.get_context("fork")


def _dump_stacks_on_request() -> None:
    """A process the test finds late prints every thread's stack (to the captured stderr) on SIGUSR1."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def _scheduler_main(env: NodeEnv, announce: Any) -> None:
    from sluice.scheduler.service import run_scheduler

    _dump_stacks_on_request()
    os._exit(run_scheduler(env, announce.put))


def _server_main(env: NodeEnv) -> None:
    from sluice.ps.server import run_server

    _dump_stacks_on_request()
    os._exit(run_server(env))


def _aggregator_main(env: NodeEnv) -> None:
    from sluice.ps.aggregator import run_aggregator

    _dump_stacks_on_request()
    os._exit(run_aggregator(env))


def _worker_main(env: NodeEnv, fn: Callable[..., Any], args: tuple[Any, ...], tempdir: str, results: Any) -> None:
    _dump_stacks_on_request()
    os.environ.update(env.to_environ())
    os.environ[ENV_SECRET_FD] = str(secret_pipe(env.secret))  # as the launcher hands it over
    torch = sys.modules.get("torch")
    if torch is not None:  # an OpenMP pool the parent started does not survive fork: stay single-threaded
        torch.set_num_threads(1)
    code = 0
    try:
        use_tempdir(tempdir)
        value = fn(*args)
        close_at_exit()
        results.put((env.rank, "ok", value))
    except BaseException as exc:  # report every failure to the test, then exit non-zero
        results.put((env.rank, "error", f"{type(exc).__name__}: {exc}"))
        code = 1
    results.close()
    results.join_thread()
    os._exit(code)


class LocalCluster:
    """Scheduler and servers start in the constructor; `run` forks workers running `fn(*args)`."""

    def __init__(self, workers: int, servers: int, config: dict[str, Any] | None = None, aggregators: int = 0) -> None:
        self.workers, self.servers, self.aggregators = workers, servers, aggregators
        self.config = config or {}
        self.secret = new_secret()
        self.processes: list[Any] = []
        self._tempdirs: list[str] = []  # the workers' (the servers' and scheduler's use none)
        #: the worker processes started with each results queue (by its id), by rank
        self._runs: dict[int, list[Any]] = {}
        announce = _ctx.Queue()
        base = NodeEnv("", "scheduler", 0, workers, servers, self.config, self.secret, aggregators)
        self._start(_scheduler_main, base, announce)
        try:
            self.endpoint = str(announce.get(timeout=30))
        except queue.Empty:
            self.close()
            raise RuntimeError("the scheduler did not report its endpoint within 30 s") from None
        for rank in range(servers):
            self._start(_server_main, self.env("server", rank))
        #: aggregator processes by rank (a test may kill one)
        self.aggregator_processes = [self._start(_aggregator_main, self.env("aggregator", rank))
                                     for rank in range(aggregators)]

    def env(self, role: str, rank: int) -> NodeEnv:
        return NodeEnv(self.endpoint, role, rank, self.workers, self.servers, self.config, self.secret,
                       self.aggregators)

    def _start(self, target: Callable[..., None], *args: Any) -> Any:
        process = _ctx.Process(target=target, args=args, daemon=True)
        process.start()
        self.processes.append(process)
        return process

    def start_workers(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Fork every worker running fn(*args); the queue their (rank, status, value) reports arrive on."""
        results = _ctx.Queue()
        started = []
        for rank in range(self.workers):
            self._tempdirs.append(child_tempdir())
            started.append(self._start(_worker_main, self.env("worker", rank), fn, args, self._tempdirs[-1], results))
        self._runs[id(results)] = started
        return results

    def collect(self, results: Any, count: int, timeout: float) -> dict[int, tuple[str, Any]]:
        """The first `count` worker reports, by rank. RuntimeError at once when every worker yet to report has
        exited without a report (a worker puts its report in the queue before it exits: one that died in native code,
        or was killed, never will), naming each with its exit code; queue.Empty, after every live process of the job
        printed its stacks, if they are late."""
        out: dict[int, tuple[str, Any]] = {}
        workers = self._runs.get(id(results), [])
        deadline = time.monotonic() + timeout
        while len(out) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                self.dump_stacks()
                raise queue.Empty
            try:
                rank, status, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                unreported = [(r, p) for r, p in enumerate(workers) if r not in out]
                if unreported and all(p.exitcode is not None for _, p in unreported):
                    try:  # a report put just before its worker exited is in the queue by now
                        rank, status, value = results.get(timeout=1.0)
                    except queue.Empty:
                        raise RuntimeError("workers exited without a report: " + ", ".join(
                            f"worker {r} (exit code {p.exitcode})" for r, p in unreported)) from None
                else:
                    continue
            out[rank] = (status, value)
        return out

    def dump_stacks(self) -> None:
        """Every live process of the job prints its threads' stacks, so a late report says where it waits."""
        for process in self.processes:
            if process.is_alive():
                os.kill(process.pid, signal.SIGUSR1)
        time.sleep(1.0)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 90.0) -> list[Any]:
        """Run fn(*args) in every worker; its return values by rank. Raises if any worker fails."""
        reports = self.collect(self.start_workers(fn, *args), self.workers, timeout)
        for rank, (status, value) in sorted(reports.items()):
            if status != "ok":
                raise RuntimeError(f"worker {rank} failed: {value}")
        return [reports[r][1] for r in range(self.workers)]

    def wait(self, timeout: float = 20.0) -> list[int | None]:
        """Exit codes of every process once the job has ended by itself."""
        for process in self.processes:
            process.join(timeout)
        return [p.exitcode for p in self.processes]

    def close(self) -> None:
        for process in self.processes:
            if process.is_alive():
                os.kill(process.pid, signal.SIGKILL)
            process.join(5)
            remove_segments_of(process.pid)
        remove_tempdirs(self._tempdirs)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
