"""One child process of a local job: its output relayed with a [role rank] prefix, its process group signalled.

Its output is relayed line by line (to the terminal, and to per-rank log files: launch/output.py),
its last lines kept for the failure report, and its readiness and culprit lines noticed.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import select
import signal
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, BinaryIO

from sluice.launch.output import ChildOutput
from sluice.launch.run_options import OutputOptions
from sluice.scheduler import culprit
from sluice.scheduler.new_place import Place, write_place
from sluice.scheduler.recovery import parse_silent
from sluice.transport.shm import remove_segments_of

if TYPE_CHECKING:  # the preloader imports this module for its death signal: no cycle at run time
    from sluice.launch.preload import ForkedProcess

READY_PREFIX = "SLUICE_SCHEDULER_READY "
TAIL_LINES = 20
_PR_SET_PDEATHSIG = 1
_MAX_LINE = 1 << 20
#: ssh's status when the session failed (refused, unreachable, or the link lost mid-run)
SSH_FAILED = 255


def death_signal_hook() -> Callable[[], None] | None:
    """A preexec_fn asking Linux to SIGKILL the child when the launcher dies, so no role outlives it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # loaded here: the forked child should not dlopen
    except OSError:
        return None
    parent = os.getpid()

    def hook() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os._exit(1)

    return hook


class Sink:
    """The launcher's stdout; if it goes away (a closed pipe) the job keeps running without it.

    Whole lines reach it in one piece even when the descriptor is non-blocking (ssh, a child sharing
    the terminal's file description, sets O_NONBLOCK on it): a full pipe is waited out, up to a
    deadline, instead of losing the rest of a line or taking the reader for gone."""

    def __init__(self, stream: BinaryIO, stall_s: float = 60.0) -> None:
        self.stream: BinaryIO | None = stream
        self.stall_s = stall_s

    def write(self, data: bytes) -> None:
        if self.stream is None:
            return
        try:
            self.stream.flush()  # what an earlier writer left buffered goes first
            fd = self.stream.fileno()
        except (OSError, ValueError):  # closed, or no descriptor (a test's BytesIO): write as a stream
            self._write_stream(data)
            return
        view, deadline = memoryview(data), time.monotonic() + self.stall_s
        try:
            while view:
                try:
                    view = view[os.write(fd, view):]
                except BlockingIOError:
                    left = deadline - time.monotonic()
                    if left <= 0 or not select.select([], [fd], [], left)[1]:
                        raise TimeoutError(f"nothing read the output for {self.stall_s:g} s") from None
        except (OSError, ValueError):
            self.stream = None

    def _write_stream(self, data: bytes) -> None:
        assert self.stream is not None
        try:
            self.stream.write(data)
            self.stream.flush()
        except (OSError, ValueError):
            self.stream = None


class Child:
    """`host`: set for a role started on another host through `via` ("ssh" or "srun", running
    launch/remote.py there); `proc` is then the local ssh or srun, whose stdin keeps the role alive."""

    def __init__(self, role: str, rank: int, proc: asyncio.subprocess.Process | ForkedProcess, sink: Sink,
                 host: str | None = None, via: str = "", options: OutputOptions | None = None,
                 log_folder: str | None = None) -> None:
        self.role, self.rank, self.proc = role, rank, proc
        self.host, self.via = host, via
        self._returncode: int | None = None
        #: scheduler rank k >= 1 is the k-th standby (scheduler.standby)
        self.label = (("scheduler" if rank == 0 else "standby scheduler" if rank == 1 else f"standby scheduler {rank}")
                      if role == "scheduler" else role if role == "preload" else f"{role} {rank}")
        self.output = ChildOutput(sink, self.label, options or OutputOptions(), log_folder)
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.ended_at: float | None = None
        self.culprit: tuple[float, culprit.Culprit] | None = None
        self.ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        #: a scheduler's: told the role and rank of each node it says fell silent (SLUICE_NODE_SILENT)
        self.on_silent: Callable[[str, int], None] | None = None
        #: its host was found lost (launch/takeover.py): its session, killed, counts as failed
        self.host_lost = False
        streams = [(proc.stdout, "stdout"), (proc.stderr, "stderr")]
        self.pump = asyncio.gather(*(self._pump(pipe, name) for pipe, name in streams if pipe is not None))
        self.done = asyncio.create_task(self._wait())

    @property
    def name(self) -> str:
        if self.host is None:
            return f"{self.label} (pid {self.proc.pid})"
        if self.via == "ssh" and self._returncode == SSH_FAILED:
            return (f"{self.label} on {self.host}, whose ssh session failed (exit {SSH_FAILED}: the host is down or "
                    f"unreachable, or refused the login; check that `ssh {self.host} true` works without a password),")
        return f"{self.label} on {self.host}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        """The role's exit status: negative for a signal, also when the remote stub reported 128 + N."""
        return self._returncode

    async def _pump(self, pipe: asyncio.StreamReader, stream: str) -> None:
        partial = b""
        try:
            while data := await pipe.read(65536):
                *lines, partial = (partial + data).split(b"\n")
                if len(partial) > _MAX_LINE:
                    lines.append(partial)
                    partial = b""
                self._emit(stream, lines)
            if partial:
                self._emit(stream, [partial])
        finally:
            self.output.close(stream)

    def _emit(self, stream: str, lines: list[bytes]) -> None:
        if not lines:
            return
        for raw in lines:
            text = raw.decode(errors="replace").rstrip("\r")
            self.tail.append(text)
            if text.startswith(READY_PREFIX) and not self.ready.done():
                self.ready.set_result(text[len(READY_PREFIX) :].strip())
            if self.culprit is None and (named := culprit.parse(text)) is not None:
                self.culprit = (time.monotonic(), named)
            if self.on_silent is not None and (silent := parse_silent(text)) is not None:
                self.on_silent(*silent)
        self.output.write(stream, lines)

    async def _wait(self) -> int:
        code = await self.proc.wait()
        if self.host_lost:
            code = SSH_FAILED
        if self.host is not None and 128 < code <= 128 + 64 and not (self.via == "ssh" and code == SSH_FAILED):
            code = 128 - code  # launch/remote.py reports a role killed by signal N as 128 + N
        self._returncode = code
        self.ended_at = time.monotonic()
        remove_segments_of(self.proc.pid)  # shared memory a killed process could not unlink itself
        # a grandchild may hold the pipe open after the child exits: do not wait for it forever
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.pump), 1.0)
        return code

    def last_lines(self) -> str:
        """Its last lines of output, indented, for a report of its end."""
        return "\n".join(f"    {line}" for line in self.tail) or "    (no output)"

    def signal_group(self, sig: signal.Signals) -> None:
        # the group outlives its leader when the child left processes behind: signal it regardless
        with contextlib.suppress(OSError):
            if self.via == "srun":  # srun alone: its helper process, in its group, then cancels the step;
                os.kill(self.proc.pid, sig)  # killed with it, the step would run on until scancel
            else:
                os.killpg(self.proc.pid, sig)

    def notify_hosts_updated(self) -> None:
        """SIGUSR1 to the worker (an elastic job's new hosts; worker/torch/elastic.py): here directly, on
        another host through the remote stub, which reads it from the session (launch/remote.py)."""
        if self.host is None:
            with contextlib.suppress(OSError):
                os.kill(self.proc.pid, signal.SIGUSR1)
        elif self.proc.stdin is not None and not self.proc.stdin.is_closing():
            self.proc.stdin.write(b"USR1\n")

    def notify_reform(self, place: Place | None = None, directory: str = "") -> None:
        """SIGUSR2 to the worker (--in-place: the job re-forms now; worker/elastic/host.py), as notify_hosts_updated;
        first its new `place` when the job shrank (scheduler/new_place.py), in the elastic `directory` of its host."""
        if self.host is None:
            if place is not None:
                write_place(directory, self.proc.pid, place)
            with contextlib.suppress(OSError):
                os.kill(self.proc.pid, signal.SIGUSR2)
        elif self.proc.stdin is not None and not self.proc.stdin.is_closing():
            self.proc.stdin.write((f"{place.line()}\n" if place is not None else "").encode() + b"USR2\n")

    def renumber(self, rank: int) -> None:
        """A survivor of a job that shrank in place: its new rank, in the launcher's words and its output prefix."""
        self.rank, self.label = rank, f"{self.role} {rank}"
        self.output.relabel(self.label)

    def stop(self) -> None:
        """Ask the role to end: SIGTERM to its group here; on another host, a line STOP and the end of the
        session's stdin, on which the remote stub SIGTERMs the role's group there (and SIGKILLs it later)."""
        if self.host is None:
            self.signal_group(signal.SIGTERM)
            self.signal_group(signal.SIGCONT)  # a stopped process takes its SIGTERM only once continued
        elif self.proc.stdin is not None and not self.proc.stdin.is_closing():
            with contextlib.suppress(ConnectionError, RuntimeError):  # a role that outlives the session's end
                self.proc.stdin.write(b"STOP\n")                     # stops on this word (launch/remote.py)
            self.proc.stdin.close()
