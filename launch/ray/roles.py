"""The scheduler and servers of a Ray Train run: subprocesses of the process that calls the backend, output relayed.

They are started as `sluice launch` starts them (`python -m sluice.launch.cli scheduler|server`, the
job's SLUICE_* variables, the secret through an inherited pipe), each in its own session with the
kernel's parent-death signal, and watched by the launcher's janitor: if the process holding them is
killed outright, neither they nor their /dev/shm segments outlive it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from typing import IO

from sluice.errors import SluiceError
from sluice.launch.children import READY_PREFIX, TAIL_LINES, death_signal_hook
from sluice.launch.janitor import Janitor
from sluice.scheduler.bootstrap import ENV_SECRET_FD, NodeEnv, secret_pipe
from sluice.transport.shm import remove_segments_of

#: seconds between SIGTERM and SIGKILL when stopping a role
STOP_TIMEOUT = 3.0


def _pythonpath() -> str:
    """The folder this `sluice` package lies in first: the roles run this very package, installed or a checkout."""
    import sluice

    home = os.path.dirname(os.path.dirname(os.path.abspath(sluice.__file__)))
    return os.pathsep.join(p for p in (home, os.environ.get("PYTHONPATH")) if p)


class Role:
    """One scheduler or server process: its output relayed line by line with a `[label]` prefix."""

    def __init__(self, label: str, proc: subprocess.Popen[bytes], out: IO[str]) -> None:
        self.label, self.proc, self.out = label, proc, out
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.endpoint = ""
        self.ready = threading.Event()
        self.pump = threading.Thread(target=self._relay, name=f"sluice-{label}-output", daemon=True)
        self.pump.start()

    def _relay(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            text = raw.decode(errors="replace").rstrip("\r\n")
            self.tail.append(text)
            if text.startswith(READY_PREFIX) and not self.ready.is_set():
                self.endpoint = text[len(READY_PREFIX):].strip()
                self.ready.set()
            with contextlib.suppress(OSError, ValueError):
                print(f"[{self.label}] {text}", file=self.out, flush=True)
        self.ready.set()  # ended without announcing: the waiter looks at the exit status

    def last_lines(self) -> str:
        return "\n".join(f"    {line}" for line in self.tail) or "    (no output)"


class RoleGroup:
    """The job's scheduler and servers, started in that order; `stop()` ends them and removes what they left."""

    def __init__(self, out: IO[str] | None = None) -> None:
        self.out = out if out is not None else sys.stdout
        self.roles: list[Role] = []
        self.janitor: Janitor | None = None

    def _start(self, role: str, node: NodeEnv) -> Role:
        if self.janitor is None:  # first, so that nothing started after it can outlive this process
            self.janitor = Janitor()
        env = {**os.environ, **node.to_environ(), "PYTHONUNBUFFERED": "1", "PYTHONPATH": _pythonpath()}
        secret_fd = secret_pipe(node.secret)  # never in argv, the environment or a log
        env[ENV_SECRET_FD] = str(secret_fd)
        try:
            # the parent-death signal follows the thread that starts the child: Ray Train calls on_start and
            # on_shutdown from the controller's one event-loop thread (v1: the trainable's training thread)
            proc = subprocess.Popen(
                [sys.executable, "-m", "sluice.launch.cli", role], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, env=env, start_new_session=True, preexec_fn=death_signal_hook(),
                pass_fds=(secret_fd,),
            )
        except OSError as exc:
            raise SluiceError(f"cannot start the Sluice {role} ({sys.executable} -m sluice.launch.cli {role}): "
                              f"{exc}") from None
        finally:
            os.close(secret_fd)
        self.janitor.spawned(proc.pid)
        started = Role(node.name.replace("-", " "), proc, self.out)
        self.roles.append(started)
        return started

    def start_scheduler(self, node: NodeEnv, timeout: float) -> str:
        """Starts the scheduler; its endpoint once it listens. SluiceError if it does not within `timeout` s."""
        scheduler = self._start("scheduler", node)
        if not scheduler.ready.wait(timeout) or not scheduler.endpoint:
            code = scheduler.proc.poll()
            if code is None:
                raise SluiceError(f"the Sluice scheduler (pid {scheduler.proc.pid}) did not announce its endpoint "
                                  f"within {timeout:g} s (SluiceConfig.ready_timeout_s); its last lines:\n"
                                  f"{scheduler.last_lines()}")
            raise SluiceError(f"the Sluice scheduler exited with status {code} before it listened; its last lines:"
                              f"\n{scheduler.last_lines()}")
        return scheduler.endpoint

    def start_servers(self, nodes: list[NodeEnv]) -> None:
        for node in nodes:
            self._start("server", node)

    def stop(self, grace: float) -> list[str]:
        """Gives the roles `grace` s to leave by themselves (they do once every worker said goodbye), then
        SIGTERM, then SIGKILL; removes their /dev/shm segments. A line per role that did not end cleanly."""
        deadline = time.monotonic() + grace
        for role in self.roles:
            with contextlib.suppress(subprocess.TimeoutExpired):
                role.proc.wait(max(0.0, deadline - time.monotonic()))
        notes = []
        for role in self.roles:
            if role.proc.poll() is None:
                notes.append(f"stopping the Sluice {role.label}, still running {grace:g} s after the workers left")
                self._signal(role, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT
        for role in self.roles:
            try:
                role.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._signal(role, signal.SIGKILL)
                role.proc.wait()
            remove_segments_of(role.proc.pid)  # shared memory a killed process could not unlink itself
            role.pump.join(1.0)
            if self.janitor is not None:
                self.janitor.reaped(role.proc.pid)
            code = role.proc.returncode
            if code not in (0, -signal.SIGTERM, 128 + signal.SIGTERM):
                notes.append(f"the Sluice {role.label} ended with status {code}; its last lines:\n{role.last_lines()}")
        if self.janitor is not None:
            self.janitor.close()
            self.janitor = None
        self.roles = []
        return notes

    @staticmethod
    def _signal(role: Role, sig: signal.Signals) -> None:
        with contextlib.suppress(OSError):  # its own session: the group id is its pid
            os.killpg(role.proc.pid, sig)

