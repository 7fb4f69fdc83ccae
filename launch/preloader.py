"""The process behind `sluice launch --preload`: imports the named modules once, then forks each local worker.

A worker forked from it starts with those modules already imported (torch's import is 2-3 CPU-s, a
fork 0.03), and then runs its command as `python` would: `SCRIPT ARGS`, `-m MODULE ARGS` or `-c CODE
ARGS`, with its own argv, environment, working directory, descriptors and session. The launcher (launch/preload.py)
asks for each worker over a SOCK_SEQPACKET socket: one JSON message `{"id", "argv", "command", "env", "cwd"}`
with the worker's stdout and stderr and its job-secret pipe as SCM_RIGHTS descriptors; this process
answers `{"id", "pid"}`, and `{"exit": PID, "code": C}` when a worker ends (C negative for a signal,
as asyncio reports it). Nothing here is pickled, and a message that is not one of these is refused.

This process must stay single-threaded apart from what the preloaded modules start (OpenBLAS's pool
survives fork through its own fork handlers), and must not initialise CUDA: a forked child could not.
It dies with the launcher (PR_SET_PDEATHSIG), and each worker dies with it, so nothing outlives a
launcher killed outright.
"""

from __future__ import annotations

import builtins
import ctypes
import gc
import importlib
import io
import json
import os
import runpy
import select
import signal
import socket
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from importlib.machinery import BuiltinImporter, SourceFileLoader
from pathlib import Path

from sluice.launch.children import death_signal_hook
from sluice.scheduler.bootstrap import ENV_SECRET_FD

#: the largest request (a worker's environment dominates it); the launcher starts a larger one as before
MAX_REQUEST = 192 * 1024


@dataclass(frozen=True)
class Request:
    id: int
    argv: list[str]  # the worker's command line as given, shown as this process's (ps, /proc/PID/cmdline)
    command: list[str]  # what runs: ["SCRIPT", ARGS...], ["-m", MODULE, ARGS...] or ["-c", CODE, ARGS...]
    env: dict[str, str]
    cwd: str


def parse_request(raw: bytes) -> Request:
    """A launcher's request, validated (ValueError)."""
    msg = json.loads(raw)
    if type(msg) is not dict or set(msg) != {"id", "argv", "command", "env", "cwd"}:
        raise ValueError("a request has exactly the fields id, argv, command, env and cwd")
    ident, argv, command, env, cwd = msg["id"], msg["argv"], msg["command"], msg["env"], msg["cwd"]
    if type(ident) is not int or type(cwd) is not str or not _words(argv) or not _words(command) \
            or type(env) is not dict or not all(type(k) is str and type(v) is str for k, v in env.items()):
        raise ValueError("a request's id is an int, argv and command lists of strings, env strings by string, "
                         "cwd a string")
    if command[0] in ("-m", "-c") and len(command) < 2:
        raise ValueError(f"{command[0]} needs an argument")
    return Request(ident, argv, command, env, cwd)


def _words(value: object) -> bool:
    return type(value) is list and bool(value) and all(type(word) is str for word in value)


def retitle(words: list[str]) -> None:
    """Show `words` as this process's command line (ps, /proc/PID/cmdline), written over the one it started
    with (as setproctitle does), cut to its length: the launcher leaves room in the preloader's."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # proc(5) fields 48 and 49: arg_start, arg_end
    except (OSError, IndexError, ValueError):
        return
    title = b"\0".join(word.encode(errors="replace") for word in words)[: end - start - 1]
    ctypes.memset(start, 0, end - start)  # Python keeps its own copies of argv: this memory is only shown
    ctypes.memmove(start, title, len(title))


def _send(sock: socket.socket, msg: dict[str, object]) -> None:
    sock.send(json.dumps(msg).encode())


def _reap(sock: socket.socket) -> None:
    """Tell the launcher of every worker that ended."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def serve(sock: socket.socket) -> tuple[Request, list[int]] | None:
    """Fork a worker for each request; returns in a forked worker only (its request and descriptors), None
    once the launcher closed the socket."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # set_wakeup_fd needs a handler to write the number
    while True:
        _reap(sock)
        ready = select.select([sock.fileno(), wake_r], [], [])[0]
        if wake_r in ready:
            os.read(wake_r, 512)
        if sock.fileno() not in ready:
            continue
        raw, fds, _, _ = socket.recv_fds(sock, MAX_REQUEST, 3)
        if not raw:
            return None
        try:
            request = parse_request(raw)
            if len(fds) != 3:
                raise ValueError(f"a request carries 3 descriptors (stdout, stderr, secret), not {len(fds)}")
        except (ValueError, RecursionError) as exc:  # the launcher's bug if ever: refused, said, and it goes on
            print(f"sluice preload: refused a request: {exc}", file=sys.stderr, flush=True)
            for fd in fds:
                os.close(fd)
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd in (wake_r, wake_w):
                os.close(fd)
            sock.close()
            return request, fds
        for fd in fds:
            os.close(fd)
        _send(sock, {"id": request.id, "pid": pid})


def become(request: Request, fds: list[int], die_with_preloader: Callable[[], None] | None) -> None:
    """In the forked child: the worker's session, descriptors, environment, directory and argv."""
    os.setsid()  # its own process group, as every child of the launcher: signalled as a group
    if die_with_preloader is not None:  # as the launcher's own children die with it
        die_with_preloader()
    stdout, stderr, secret = fds
    devnull = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((devnull, 0), (stdout, 1), (stderr, 2)):
        os.dup2(fd, target)
        os.close(fd)
    env = dict(request.env)
    if ENV_SECRET_FD in env:
        env[ENV_SECRET_FD] = str(secret)
    else:
        os.close(secret)
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:  # its global generator was seeded in the preloader (`random` reseeds at fork)
        numpy_random.seed()  # from the OS's entropy, as in a fresh process
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request.cwd)
    retitle(request.argv)


def run(request: Request) -> None:
    """Run the worker's command as `python` would; an exception it does not catch is printed from the
    command's own frames down (not this module's) and exits 1, as with `python`."""
    try:
        _execute(request.command)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__):
            tb = tb.tb_next
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)  # the hook prints the exception's own traceback
        sys.exit(1)


def _execute(command: list[str]) -> None:
    """`python -m MODULE ARGS`, `python -c CODE ARGS` or `python SCRIPT.py ARGS`, with their sys.argv, sys.path[0]
    and a fresh __main__ module (as `python` makes it)."""
    if command[0] == "-m":
        sys.argv = ["-m", *command[2:]]
        _path0(os.getcwd())
        runpy.run_module(command[1], run_name="__main__", alter_sys=True)
    elif command[0] == "-c":
        sys.argv = ["-c", *command[2:]]
        _path0("")
        main_module = sys.modules["__main__"] = types.ModuleType("__main__")  # a fresh one, as `python -c` has
        main_module.__loader__ = BuiltinImporter
        exec(compile(command[1], "<string>", "exec"), main_module.__dict__)
    else:
        sys.argv, path = list(command), os.path.abspath(command[0])
        _path0(os.path.dirname(os.path.realpath(path)))
        with io.open_code(path) as source:  # not runpy.run_path, which would make sys.argv[0] absolute too
            code = compile(source.read(), path, "exec", dont_inherit=True)
        main_module = sys.modules["__main__"] = types.ModuleType("__main__")
        vars(main_module).update(__file__=path, __cached__=None, __package__=None, __spec__=None,
                                 __loader__=SourceFileLoader("__main__", path), __builtins__=builtins)
        exec(code, vars(main_module))


def _path0(entry: str) -> None:
    """sys.path[0] as `python` sets it for the command, in place of our ROOT; with PYTHONSAFEPATH, nothing."""
    if sys.flags.safe_path:  # BOOT inserted ROOT before the path python made
        del sys.path[0]
    else:
        sys.path[0] = entry


def main() -> None:
    """`python -c BOOT ROOT FD ROOM MODULE...` (launch/preload.py; ROOM: blanks that leave the workers room for their
    command lines): import the modules, say ready, serve."""
    fd, modules = int(sys.argv[2]), sys.argv[4:]
    retitle([sys.executable, "-m", "sluice.launch.preloader", *modules])
    sock = socket.socket(fileno=fd)
    try:
        for name in modules:
            importlib.import_module(name)
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            raise RuntimeError("importing them initialised CUDA, which a forked worker cannot use")
    except Exception as exc:  # every failure to import is the user's to see, in one line
        _send(sock, {"failed": f"{type(exc).__name__}: {exc}"})
        sys.exit(2)
    # what the imports made stays out of every later collection: a forked worker's collector then does not touch
    # (and so copy) those pages, which at its exit cost 0.95 CPU-s for torch's objects, 0.31 frozen (gc's docs)
    gc.freeze()
    _send(sock, {"ready": os.getpid()})
    die_with_preloader = death_signal_hook()  # made here: a forked child should not load libc
    forked = serve(sock)
    if forked is None:
        return
    request, fds = forked
    become(request, fds, die_with_preloader)
    del sock, forked, fds
    run(request)
