"""What ssh starts on a remote host: `python -m sluice.launch.remote`, which runs one role and ends it with the session.

The launcher writes one JSON line to the session's stdin, `{"argv": [...], "env": {...}, "cwd":
"...", "secret": "<hex>"}` (and `"split": true` for the role's stderr apart), so nothing secret is
in a command line (which `ps` shows to every user of the host), an environment, or a log. The stub
starts `argv` in a process group of its own, hands it the job secret through an inherited pipe (as
the local launcher does), and lets its output flow back through the session. Then it watches stdin:
a line `USR1` is passed on to the role as SIGUSR1 (an elastic job's new hosts); end of file means
the launcher is gone or has ended the job (the session closed: Ctrl-C, a lost link, the launcher
killed), and the stub stops the role's whole group, SIGTERM then SIGKILL after a grace period, and
removes the shared memory the role could not (killed by a signal), so nothing outlives the job on
any host; so does a SIGTERM, SIGHUP or SIGINT to the stub itself (SLURM cancelling the step), and a
line `STOP`. With `"outlive": true` (a job with a standby scheduler, on another host than the
launcher) only `STOP` and those signals stop the role: the end of the session alone means the
launcher's host may be lost, and the job goes on under the standby; each role still ends by itself
(its work done, or the schedulers silent), and its output is relayed through a buffer
(launch/relay.py) so that a session nobody reads never makes it wait. The
stub exits with the role's status (128 + N for a signal). A header it cannot use ends it with status
2 and a line on stderr that says what is wrong.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any

from sluice.launch.relay import relayed_pipe
from sluice.scheduler.bootstrap import ENV_ELASTIC_DIR, ENV_SECRET_FD, secret_pipe
from sluice.scheduler.new_place import WORD, parse_place, write_place

MAX_HEADER_BYTES = 1 << 20
GRACE_S = 5.0
BAD_HEADER = 2
PLACE_WORD = WORD.encode() + b" "
_HEADER_KEYS = frozenset({"argv", "env", "cwd", "secret", "split", "outlive"})


@dataclass(frozen=True)
class Header:
    argv: tuple[str, ...]
    env: dict[str, str]
    cwd: str
    secret: bytes
    #: the role's stderr goes to the session's stderr, apart from its stdout (per-rank log files)
    split: bool = False
    #: the role outlives the session's end (only STOP or a signal stops it): a job with a standby scheduler
    outlive: bool = False


def parse_header(line: bytes) -> Header:
    """The launcher's header line; ValueError saying what is wrong."""
    if len(line) > MAX_HEADER_BYTES:
        raise ValueError(f"the header is over {MAX_HEADER_BYTES} bytes")
    try:
        data: Any = json.loads(line)
    except ValueError as exc:
        raise ValueError(f"the header is not JSON: {exc}") from None
    if not isinstance(data, dict) or not {"argv", "env", "cwd", "secret"} <= set(data) <= _HEADER_KEYS:
        raise ValueError("the header must be an object with argv, env, cwd and secret (and maybe split)")
    if not isinstance(data.get("split", False), bool) or not isinstance(data.get("outlive", False), bool):
        raise ValueError("split and outlive must be true or false")
    argv, env, cwd, secret = data["argv"], data["env"], data["cwd"], data["secret"]
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) and a for a in argv):
        raise ValueError("argv must be a non-empty list of non-empty strings")
    if not isinstance(env, dict) or not all(isinstance(k, str) and k and "=" not in k and isinstance(v, str)
                                            for k, v in env.items()):
        raise ValueError("env must map variable names to strings")
    if not isinstance(cwd, str) or not cwd:
        raise ValueError("cwd must be a directory")
    if not isinstance(secret, str) or len(secret) > 8192:
        raise ValueError("secret must be a hex string")
    try:
        return Header(tuple(argv), dict(env), cwd, bytes.fromhex(secret), data.get("split", False),
                      data.get("outlive", False))
    except ValueError:
        raise ValueError("secret must be a hex string") from None


def _write_place(env: dict[str, str], pid: int, line: bytes) -> None:
    """A survivor's new place (scheduler/new_place.py), for it to read at its USR2; a bad line is said and dropped
    (the survivor then keeps its place, and the job's scheduler refuses it: the launcher sees that end)."""
    try:
        write_place(env.get(ENV_ELASTIC_DIR, ""), pid, parse_place(line.decode("ascii", "replace")))
    except (ValueError, OSError) as exc:
        print(f"sluice remote: the launcher's new place for the worker was not written: {exc}", file=sys.stderr,
              flush=True)


def _stop(process: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM the role's group, and SIGKILL it if it is still there after `grace` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, None)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            process.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue
    with contextlib.suppress(ProcessLookupError):  # whatever the role started and left behind
        os.killpg(process.pid, signal.SIGKILL)


def read_header(fd: int) -> tuple[bytes, bytes]:
    """The header line from descriptor `fd`, and what came after it (a STOP or USR1 the launcher sent at once).
    Read raw: a buffered reader would keep those bytes from the thread that watches `fd` for commands."""
    data = b""
    while b"\n" not in data and len(data) <= MAX_HEADER_BYTES:
        try:
            chunk = os.read(fd, 1 << 16)
        except OSError:
            break
        if not chunk:
            break
        data += chunk
    line, _, rest = data.partition(b"\n")
    return line, rest


def run(stdin: Any, grace: float = GRACE_S) -> int:
    """Read the header from `stdin` (binary), run the role, stop it when `stdin` ends; its exit status."""
    line, early = read_header(stdin.fileno())
    try:
        header = parse_header(line)
    except ValueError as exc:
        print(f"sluice remote: {exc}; this runs what `sluice launch -H ...` sends it, not by hand", file=sys.stderr)
        return BAD_HEADER
    env = {**os.environ, **header.env}
    started: list[subprocess.Popen[bytes]] = []  # the role, once it runs
    signalled: list[int] = []

    def stop_soon(number: int, _frame: object) -> None:
        # not in the handler itself: it runs inside process.wait() below, whose lock reaping the role
        # needs; it would spin out the grace, then hang, and never remove the role's shared memory
        # (a cancelled SLURM step's stub gets SIGTERM, and SIGKILL KillWait seconds later)
        if not started:  # before the role runs (a slow start): it is stopped as soon as it does
            signalled.append(number)
            return
        threading.Thread(target=_stop, args=(started[0], grace), name="sluice-remote-stop", daemon=True).start()

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):  # before the role starts: no signal is missed
        signal.signal(sig, stop_soon)
    fd = secret_pipe(header.secret)
    env[ENV_SECRET_FD] = str(fd)
    outputs = [relayed_pipe(1), *([relayed_pipe(2)] if header.split else [])] if header.outlive else []
    try:
        # one stream, as the local launcher reads it: ssh and srun carry stdout and stderr apart, and
        # lines of the two would interleave mid-line where the launcher reads them as one; with `split`
        # it reads them apart (per-rank log files), so stderr keeps to the session's stderr
        stdout = outputs[0][0] if outputs else None
        stderr = outputs[1][0] if len(outputs) > 1 else None if header.split else subprocess.STDOUT
        process = subprocess.Popen(header.argv, cwd=header.cwd, env=env, stdin=subprocess.DEVNULL, stdout=stdout,
                                   stderr=stderr, start_new_session=True, pass_fds=(fd,))
    except OSError as exc:
        print(f"sluice remote: cannot start {header.argv[0]!r} in {header.cwd!r}: {exc}", file=sys.stderr)
        return BAD_HEADER
    finally:
        os.close(fd)
        for write_end, _ in outputs:  # the role holds them now; the relays end with its output
            os.close(write_end)
    ended = threading.Event()

    def watch() -> None:  # the session's end is the job's end on this host
        # the raw descriptor, not the buffered file: a daemon thread blocked holding its lock would
        # abort the interpreter's exit
        pending, stopped, data = b"", False, early
        with contextlib.suppress(OSError):
            while data or (data := os.read(stdin.fileno(), 4096)):
                *lines, pending = (pending + data).split(b"\n")
                pending = pending[-400:]  # only short commands come (a PLACE line the longest): nothing grows here
                for line in lines:  # a survivor's new place, before its USR2 (a job shrunk in place)
                    if line.startswith(PLACE_WORD):
                        _write_place(env, process.pid, line)
                for word, sig in ((b"USR1", signal.SIGUSR1), (b"USR2", signal.SIGUSR2)):
                    if word in lines:  # an elastic job's new hosts, or its re-forming in place (launch/elastic.py)
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(process.pid, sig)
                if b"STOP" in lines:
                    stopped = True
                    break
                data = b""
        if header.outlive and not stopped:  # the launcher (or its host) is gone: the standby carries the job
            return
        if not ended.is_set():
            _stop(process, grace)

    threading.Thread(target=watch, name="sluice-remote-stdin", daemon=True).start()
    started.append(process)
    if signalled:
        stop_soon(signalled[0], None)
    # imported while the role runs (numpy comes with it): once the role is gone, a SIGKILL may be near
    from sluice.transport.shm import remove_segments_of

    code = process.wait()
    ended.set()
    for _, relay in outputs:
        relay.join(GRACE_S)
    with contextlib.suppress(ProcessLookupError):  # the role's leftovers do not outlive it
        os.killpg(process.pid, signal.SIGKILL)
    # nor its shared memory: a role killed by a signal could not unlink it (the local launcher does the
    # same for its own children, launch/children.py)
    remove_segments_of(process.pid)
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    raise SystemExit(run(sys.stdin.buffer))
