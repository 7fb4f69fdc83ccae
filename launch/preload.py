"""`sluice launch --preload`: which worker commands can be forked from a process that imported the modules once.

The launcher starts launch/preloader.py beside the scheduler; each local worker whose command is this
Python running a script, `-m MODULE` or `-c CODE` (with `-u` at most) is then forked from it instead
of started afresh, and another command starts as before. `ForkedProcess` is what the launcher's
`Child` uses of asyncio's Process (pid, output streams, wait, kill); the exit status comes from the
preloader, the forked worker's parent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from sluice.launch.preloader import MAX_REQUEST

_PROJECT_ROOT = str(Path(__file__).resolve().parent.parent)
#: the preloader's command line: `python -c BOOT ROOT FD ROOM MODULE...`; ROOT first on sys.path, so that it runs
#: our module wherever the launcher was started (a worker forked from it gets its own sys.path[0]); ROOM, blanks
#: over which each forked worker writes its own command line (ps shows it as for a worker started afresh)
BOOT = ("import sys; sys.path[0:0 if sys.flags.safe_path else 1] = [sys.argv[1]]; "
        "from sluice.launch.preloader import main; main()")
#: how long a worker whose preloader died unexpectedly may take to die of it (PR_SET_PDEATHSIG) before SIGKILL
_ORPHAN_S = 5.0
_ROOM = " " * 4096


class PreloadError(Exception):
    """The preloader could not start or import the modules; the message says why."""


def forkable(argv: Sequence[str], executable: str, path: str | None) -> list[str] | None:
    """What the preloader runs for a worker command `argv` (["SCRIPT", ARGS...], ["-m", MODULE, ...] or
    ["-c", CODE, ...]), or None when the worker must start as before: another program than the `executable`
    Python (found on `path` as the worker's PATH would find it), an option other than -u, or no .py file."""
    if not argv:
        return None
    program = argv[0] if os.sep in argv[0] else shutil.which(argv[0], path=path)
    if program is None or not _same_python(os.path.abspath(program), os.path.abspath(executable)):
        return None
    words = list(argv[1:])
    while words and words[0] == "-u":  # unbuffered: every worker of `sluice launch` is already (PYTHONUNBUFFERED)
        words.pop(0)
    if len(words) >= 2 and words[0] in ("-m", "-c"):
        return words
    if words and words[0].endswith(".py") and not words[0].startswith("-") and os.path.isfile(words[0]):
        return words
    return None


def _same_python(program: str, executable: str) -> bool:
    """The same interpreter in the same environment: the same path, or python/python3 beside it in its bin."""
    if program == executable:
        return True
    try:
        return os.path.dirname(program) == os.path.dirname(executable) and os.path.samefile(program, executable)
    except OSError:
        return False


class ForkedProcess:
    """A worker forked by the preloader, as the launcher's Child sees an asyncio Process."""

    stdin = None  # a local worker's stdin is /dev/null

    def __init__(self, pid: int, stdout: asyncio.StreamReader, stderr: asyncio.StreamReader | None) -> None:
        self.pid, self.stdout, self.stderr = pid, stdout, stderr
        self.exited: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    @property
    def returncode(self) -> int | None:
        return self.exited.result() if self.exited.done() else None

    async def wait(self) -> int:
        return await asyncio.shield(self.exited)

    def send_signal(self, sig: int) -> None:
        if not self.exited.done():  # once reaped, the pid may be another process's
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


async def _reader(fd: int) -> asyncio.StreamReader:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", 0))
    return reader


class Preloader:
    """The launcher's side of one preloader process: start it, fork workers from it, close it."""

    def __init__(self, proc: asyncio.subprocess.Process, sock: socket.socket) -> None:
        self.proc, self.sock = proc, sock
        self.loop = asyncio.get_running_loop()
        self.ready: asyncio.Future[None] = self.loop.create_future()
        self.pending: dict[int, asyncio.Future[int]] = {}
        self.forked: dict[int, ForkedProcess] = {}
        self.exits: dict[int, int] = {}  # codes that came before the pid's answer was handled
        self.next_id = 0
        self.modules: list[str] = []
        self.orphans: set[asyncio.Future[None]] = set()
        self.loop.add_reader(sock.fileno(), self._readable)

    @classmethod
    async def launch(cls, modules: Sequence[str], env: Mapping[str, str],
                     preexec: Callable[[], None] | None) -> Preloader:
        """The preloader, started: it imports `modules` while the job's roles start (`imported` waits for it)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", BOOT, _PROJECT_ROOT, str(theirs.fileno()), _ROOM, *modules,
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                env=dict(env), start_new_session=True, preexec_fn=preexec, pass_fds=(theirs.fileno(),))
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        preloader = cls(proc, ours)
        preloader.modules = list(modules)
        return preloader

    async def imported(self, timeout: float) -> None:
        """Once the modules are imported; PreloadError saying why they were not."""
        try:
            await asyncio.wait_for(asyncio.shield(self.ready), timeout)
        except TimeoutError:
            raise PreloadError(f"it did not import {', '.join(self.modules)} within {timeout:g} s") from None

    def _readable(self) -> None:
        while True:
            try:
                raw = self.sock.recv(65536)
            except BlockingIOError:
                return
            except OSError:
                raw = b""
            if not raw:
                self._gone()
                return
            self._handle(raw)

    def _handle(self, raw: bytes) -> None:
        try:
            msg = json.loads(raw)
        except ValueError:
            return
        if type(msg) is not dict:
            return
        if "ready" in msg and not self.ready.done():
            self.ready.set_result(None)
        elif type(failed := msg.get("failed")) is str and not self.ready.done():
            self.ready.set_exception(PreloadError(f"it could not import the modules: {failed}"))
        elif type(ident := msg.get("id")) is int and type(pid := msg.get("pid")) is int:
            if (waiting := self.pending.pop(ident, None)) is not None and not waiting.done():
                waiting.set_result(pid)
        elif type(pid := msg.get("exit")) is int and type(code := msg.get("code")) is int:
            if (forked := self.forked.pop(pid, None)) is not None:
                forked.exited.set_result(code)
            else:
                self.exits[pid] = code

    def _gone(self) -> None:
        """The preloader ended: its workers die with it (PR_SET_PDEATHSIG), and their exit is taken as SIGKILL."""
        self.loop.remove_reader(self.sock.fileno())
        if not self.ready.done():
            self.ready.set_exception(PreloadError("it ended before it was ready (its output above says why)"))
        for waiting in self.pending.values():
            if not waiting.done():
                waiting.set_exception(OSError("the preloading process ended"))
        for forked in self.forked.values():
            self.orphans.add(task := asyncio.ensure_future(self._orphaned(forked)))
            task.add_done_callback(self.orphans.discard)
        self.forked.clear()

    @staticmethod
    async def _orphaned(forked: ForkedProcess) -> None:
        deadline = asyncio.get_running_loop().time() + _ORPHAN_S
        while asyncio.get_running_loop().time() < deadline:
            try:
                os.kill(forked.pid, 0)
            except ProcessLookupError:
                break
            await asyncio.sleep(0.05)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(forked.pid, signal.SIGKILL)
        forked.exited.set_result(-signal.SIGKILL)

    async def spawn(self, argv: list[str], command: list[str], env: Mapping[str, str], secret_fd: int,
                    split: bool) -> ForkedProcess:
        """Fork a worker running `command` (forkable(argv)) with `env` in this directory; its stdout and stderr
        are read here (one stream unless `split`); `secret_fd` is the job-secret pipe it reads."""
        payload = json.dumps({"id": self.next_id, "argv": argv, "command": command, "env": dict(env),
                              "cwd": os.getcwd()}).encode()
        if len(payload) > MAX_REQUEST:
            raise OSError(f"the worker's environment is too large to hand to the preloader ({len(payload)} bytes)")
        pipes = [os.pipe() for _ in range(2 if split else 1)]
        try:
            waiting = self.pending[self.next_id] = self.loop.create_future()
            self.next_id += 1
            out_w, err_w = pipes[0][1], pipes[-1][1]
            await self._send(payload, [out_w, err_w, secret_fd])
        except BaseException:
            for read_end, _ in pipes:
                os.close(read_end)
            raise
        finally:
            for _, write_end in pipes:
                os.close(write_end)
        stdout = await _reader(pipes[0][0])
        stderr = await _reader(pipes[1][0]) if split else None
        pid = await asyncio.wait_for(waiting, 30.0)
        forked = ForkedProcess(pid, stdout, stderr)
        if pid in self.exits:  # it ended before its pid was handled here
            forked.exited.set_result(self.exits.pop(pid))
        else:
            self.forked[pid] = forked
        return forked

    async def _send(self, payload: bytes, fds: list[int]) -> None:
        for _ in range(1000):
            try:
                socket.send_fds(self.sock, [payload], fds)
                return
            except BlockingIOError:  # its queue is full while it forks: a moment
                await asyncio.sleep(0.01)
        raise OSError("the preloading process stopped taking requests")

    async def close(self) -> None:
        """End the preloader (its workers were stopped before: any left die with it)."""
        with contextlib.suppress(OSError, ValueError):
            self.loop.remove_reader(self.sock.fileno())
        self.sock.close()
        try:
            await asyncio.wait_for(self.proc.wait(), 5.0)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            await self.proc.wait()
