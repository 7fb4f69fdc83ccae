"""Run a Sluice job or a torch.distributed gloo job across netbed hosts, every process reaped."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sluice.launch.config import SluiceConfig
from sluice.scheduler.bootstrap import ENV_SECRET_FD, NodeEnv, new_secret, secret_pipe
from sluice.transport.shm import remove_segments_of
from testbed.netbed import Netbed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT_PREFIX = "NETBED_RESULT "
READY_PREFIX = "SLUICE_SCHEDULER_READY "
TAIL_LINES = 15
_ROLE_ARGV = [sys.executable, "-m", "sluice.launch.cli"]
_PORT_PROBE = "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])"


class JobError(RuntimeError):
    """A process of a job failed, hung or never reported; the message names it and shows its last lines."""


def emit_result(value: Any) -> None:
    """Called by a worker program: hand `value` (JSON) back to run_sluice_job / run_gloo_job."""
    print(RESULT_PREFIX + json.dumps(value), flush=True)


def _die_with_parent() -> Callable[[], None]:
    """A preexec_fn: SIGKILL the child when this process dies, so a killed benchmark leaves no orphans
    (children run in their own sessions, out of reach of a kill sent to our process group)."""
    libc = ctypes.CDLL(None, use_errno=True)  # loaded here: the forked child should not dlopen
    parent = os.getpid()

    def hook() -> None:
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG; kept across `ip netns exec`'s exec
        if os.getppid() != parent:
            os._exit(1)

    return hook


@dataclass
class _Proc:
    label: str
    process: subprocess.Popen[bytes]
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    partial: bytes = b""
    results: list[Any] = field(default_factory=list)
    ready: str | None = None
    eof: bool = False
    exited_at: float | None = None

    def describe(self, what: str) -> str:
        lines = "\n".join(f"    {line}" for line in self.tail) or "    (no output)"
        return f"{self.label} (pid {self.process.pid}) {what}; its last lines:\n{lines}"


def _exit_text(code: int) -> str:
    return f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"


class _Group:
    """The processes of one job: output relayed with a `[label]` prefix; stop() ends and reaps them all."""

    def __init__(self, bed: Netbed, echo: bool, on_line: Callable[[str, str], None] | None = None) -> None:
        self.bed, self.echo, self.on_line = bed, echo, on_line
        self.procs: list[_Proc] = []
        self.selector = selectors.DefaultSelector()
        self.hook = _die_with_parent()

    def start(self, label: str, host: str, argv: Sequence[str], env: Mapping[str, str], secret: bytes = b"") -> _Proc:
        """Start `argv` in `host`; a Sluice process gets the job `secret` as the launcher hands it over."""
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
        full_env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
        fds: tuple[int, ...] = (secret_pipe(secret),) if secret else ()
        if fds:
            full_env[ENV_SECRET_FD] = str(fds[0])
        try:
            process = self.bed.run(host, argv, cwd=ROOT, env=full_env, stdin=subprocess.DEVNULL, pass_fds=fds,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=self.hook)
        finally:
            for fd in fds:
                os.close(fd)
        assert process.stdout is not None
        proc = _Proc(label, process)
        os.set_blocking(process.stdout.fileno(), False)
        self.selector.register(process.stdout, selectors.EVENT_READ, proc)
        self.procs.append(proc)
        return proc

    def pump(self, timeout: float) -> None:
        """Read whatever output arrives within `timeout` seconds."""
        for key, _ in self.selector.select(max(timeout, 0.0)):
            proc: _Proc = key.data
            try:
                data = os.read(key.fd, 1 << 16)
            except BlockingIOError:
                continue
            if not data:
                self.selector.unregister(key.fileobj)
                proc.eof = True
                data = b"\n" if proc.partial else b""
            *lines, proc.partial = (proc.partial + data).split(b"\n")
            for raw in lines:
                self._line(proc, raw.decode(errors="replace").rstrip("\r"))

    def _line(self, proc: _Proc, text: str) -> None:
        if text.startswith(RESULT_PREFIX):
            try:
                proc.results.append(json.loads(text[len(RESULT_PREFIX):]))
            except ValueError:
                proc.tail.append(f"(unparsable result line) {text[:200]}")
            return
        if text.startswith(READY_PREFIX) and proc.ready is None:
            proc.ready = text[len(READY_PREFIX):].strip()
        proc.tail.append(text)
        if self.on_line is not None:
            self.on_line(proc.label, text)
        if self.echo:
            print(f"[{proc.label}] {text}", flush=True)

    def finished(self, proc: _Proc) -> int | None:
        """The exit code once the process has exited and its output has been read to the end."""
        code = proc.process.poll()
        if code is None:
            return None
        proc.exited_at = proc.exited_at or time.monotonic()
        # its last output may still sit in the pipe; a grandchild holding the pipe open gets 1 s
        while not proc.eof and time.monotonic() - proc.exited_at < 1.0:
            self.pump(0.05)
        return code

    def stop(self, grace: float = 3.0) -> None:
        """SIGTERM every process group, SIGKILL whatever is left after `grace` seconds, reap all."""
        alive = [p for p in self.procs if p.process.poll() is None]
        for proc in alive:
            with contextlib.suppress(OSError):
                os.killpg(proc.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while any(p.process.poll() is None for p in alive) and time.monotonic() < deadline:
            self.pump(0.05)
        for proc in self.procs:
            with contextlib.suppress(OSError):  # the group may outlive its leader
                os.killpg(proc.process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.process.wait(10)
            remove_segments_of(proc.process.pid)  # shared memory a killed process could not unlink
            if proc.process.stdout is not None:
                proc.process.stdout.close()
        self.selector.close()

    def wait_for(self, workers: Sequence[_Proc], roles: Sequence[_Proc], deadline: float, timeout: float) -> None:
        """Until every worker exited 0 with a result; raises JobError naming the first failure."""
        running = list(workers)
        while running:
            left = deadline - time.monotonic()
            if left <= 0:
                raise JobError("; ".join(p.describe(f"still ran after the {timeout:g} s deadline") for p in running))
            self.pump(min(left, 0.2))
            for proc in list(running):
                code = self.finished(proc)
                if code is None:
                    continue
                if code != 0:
                    raise JobError(proc.describe(_exit_text(code)))
                if not proc.results:
                    raise JobError(proc.describe(f"exited 0 without a {RESULT_PREFIX.strip()} line"))
                running.remove(proc)
            for proc in roles:
                code = self.finished(proc)
                if code is not None and code != 0:
                    raise JobError(proc.describe(f"{_exit_text(code)} while workers were running"))


def _results(workers: Sequence[_Proc]) -> list[Any]:
    return [proc.results[-1] for proc in workers]


def run_sluice_job(
    bed: Netbed, scheduler: str, servers: Sequence[str], workers: Sequence[str],
    config: Mapping[str, Mapping[str, Any]], worker_argv: Sequence[str], *, timeout: float = 300.0,
    ready_timeout: float = 60.0, env: Mapping[str, str] | None = None, echo: bool = False, grace: float = 10.0,
    aggregators: Sequence[str] = (), on_line: Callable[[str, str], None] | None = None,
) -> list[Any]:
    """Scheduler, servers, aggregators and workers on the named hosts; each worker's last emitted result, by rank.

    `config` holds sections as in SLUICE_CONFIG_JSON (missing keys keep their defaults); every process
    listens on its own host's address (transport.host). `on_line(label, line)` sees every output line
    (a result line excepted) as it is read. Raises JobError naming the failed process.
    """
    sections = SluiceConfig.from_sections(config).to_sections()  # validates, and fills in the defaults
    secret = new_secret()

    def node_env(role: str, rank: int, host: str, endpoint: str) -> dict[str, str]:
        mine = {**sections, "transport": {**sections["transport"], "host": bed.hosts[host].address}}
        node = NodeEnv(endpoint, role, rank, len(workers), len(servers), mine, aggregators=len(aggregators))
        return {**(env or {}), **node.to_environ()}

    group = _Group(bed, echo, on_line)
    deadline = time.monotonic() + timeout
    try:
        sched = group.start("scheduler", scheduler, [*_ROLE_ARGV, "scheduler"], node_env("scheduler", 0, scheduler, ""),
                            secret)
        ready_by = min(deadline, time.monotonic() + ready_timeout)
        while sched.ready is None:
            if group.finished(sched) is not None:
                raise JobError(sched.describe(f"{_exit_text(sched.process.returncode)} before announcing itself"))
            if time.monotonic() > ready_by:
                raise JobError(sched.describe(f"printed no {READY_PREFIX.strip()} line within {ready_timeout:g} s"))
            group.pump(0.1)
        roles = [sched] + [group.start(f"server {r}", h, [*_ROLE_ARGV, "server"],
                                       node_env("server", r, h, sched.ready), secret)
                           for r, h in enumerate(servers)]
        roles += [group.start(f"aggregator {r}", h, [*_ROLE_ARGV, "aggregator"],
                              node_env("aggregator", r, h, sched.ready), secret)
                  for r, h in enumerate(aggregators)]
        procs = [group.start(f"worker {r}", h, worker_argv, node_env("worker", r, h, sched.ready), secret)
                 for r, h in enumerate(workers)]
        group.wait_for(procs, roles, deadline, timeout)
        # the scheduler and servers leave by themselves once every worker said goodbye
        wound_down = time.monotonic() + grace
        while any(group.finished(p) is None for p in roles) and time.monotonic() < wound_down:
            group.pump(0.1)
        for proc in roles:  # the results stand, but a role that failed on the way out is worth a line
            if proc.process.returncode not in (None, 0):
                print(f"warning: {proc.describe(_exit_text(proc.process.returncode))}", flush=True)
        return _results(procs)
    finally:
        group.stop()


def free_port(bed: Netbed, host: str) -> int:
    """A TCP port the OS just handed out inside `host` (its namespace has its own port space)."""
    argv = ["ip", "netns", "exec", bed.hosts[host].netns, sys.executable, "-c", _PORT_PROBE]
    return int(subprocess.run(argv, capture_output=True, text=True, check=True, timeout=30).stdout)


def run_gloo_job(
    bed: Netbed, hosts: Sequence[str], argv: Sequence[str], *, timeout: float = 300.0,
    env: Mapping[str, str] | None = None, echo: bool = False,
) -> list[Any]:
    """One process per host with torch.distributed's env:// variables (rank 0's host is the master);
    each process's last emitted result, by rank. Raises JobError naming the failed rank."""
    port = free_port(bed, hosts[0])
    group = _Group(bed, echo)
    deadline = time.monotonic() + timeout
    try:
        procs = []
        for rank, host in enumerate(hosts):
            rank_env = {
                **(env or {}), "MASTER_ADDR": bed.hosts[hosts[0]].address, "MASTER_PORT": str(port),
                "RANK": str(rank), "WORLD_SIZE": str(len(hosts)),
                "GLOO_SOCKET_IFNAME": "eth0",  # the hostname resolves to no address on the testbed
            }
            procs.append(group.start(f"rank {rank}", host, argv, rank_env))
        group.wait_for(procs, [], deadline, timeout)
        return _results(procs)
    finally:
        group.stop()
