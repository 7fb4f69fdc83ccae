"""Cleans up after a launcher that was killed outright: its children's process groups and shared memory.

A launcher stopped by a signal it can catch stops and reaps its children itself. One killed by
SIGKILL cannot: the kernel's parent-death signal (PR_SET_PDEATHSIG) still kills its direct
children, but not what they started (a worker's own subprocesses share its process group), and a
child killed that way cannot unlink its /dev/shm/sluice-PID-* segments. So the launcher starts this
process first, in its own session and without a death signal, with stdin a pipe from the launcher,
and tells it `spawn PID` for every child and `reaped PID` for every child it has reaped. The
launcher's last word is `done`, after which the janitor exits doing nothing. If the pipe reaches
EOF without it, the launcher died: the janitor SIGKILLs the group of every child not reported
reaped (children are session leaders, so their group id is their pid), waits a few seconds at most
until no process of those groups is left, removes the segments of every process it saw in them and
the job's state it was told of (`state TAG|DIR`: servers' state files, an elastic job's directory, the
folder of a `sluice.run` job, which holds its caller's pickled function),
and exits.

Pid reuse: a reaped child's pid may already belong to another process, so reaped children are left
alone (the launcher removed their segments when it reaped them). For the others the janitor records
the start time /proc gives when it learns of them; if that pid later shows another start time, the
pid was reused, which the kernel allows only once no process of the child's group is left, and that
group is skipped. While any process of a group lives, its id cannot be reused, so killpg is safe.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

#: how long the janitor waits for the killed groups to be gone before removing their segments anyway
SETTLE_SECONDS = 5.0
#: how long srun's helper process gets to cancel its step once srun itself was killed
SRUN_CANCEL_SECONDS = 1.0
_PROJECT_ROOT = str(Path(__file__).resolve().parent.parent)


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat fields from the state on (field 3 of proc(5) is index 0); None if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def _start_time(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[19]) if fields else None  # field 22: start time in clock ticks after boot


def _members(groups: set[int]) -> dict[int, int]:
    """pid -> group of the processes of these groups that still run (a zombie can create nothing)."""
    found = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields and fields[0] != "Z" and int(fields[2]) in groups:
                found[int(entry.name)] = int(fields[2])
    return found


def _kill_groups(groups: set[int]) -> None:
    for group in groups:
        with contextlib.suppress(OSError):
            os.killpg(group, signal.SIGKILL)


def clean_up(children: dict[int, int | None], settle: float = SETTLE_SECONDS) -> tuple[int, int]:
    """Kill the groups of `children` (pid -> start time) and remove their segments: (groups, segments)."""
    groups = set()
    for pid, started in children.items():
        now = _start_time(pid)
        if now is None or now == started:  # gone (its group may live on), or still the same process
            groups.add(pid)
    seen = groups | set(_members(groups))  # their segments too, should the signal leave no trace of them
    _kill_groups(groups)
    deadline = time.monotonic() + settle
    while (alive := _members(groups)) and time.monotonic() < deadline:
        seen |= set(alive)
        # again, for a process forked as the first signal went out; only groups seen with members
        # now, since the id of a group found empty may already be another's
        _kill_groups(set(alive.values()))
        time.sleep(0.05)
    from sluice.transport.shm import remove_segments_of  # numpy with it: only a janitor with work to do pays

    return len(groups), sum(remove_segments_of(pid) for pid in seen)


def remove_job_state(items: list[str]) -> None:
    """The job's state on this host: servers' state files in /dev/shm (ps.recover; a tag), an elastic job's
    committed-state directory and a `sluice.run` job's folder (paths)."""
    from sluice.launch.elastic_io import remove_state_dir
    from sluice.launch.run_task import FOLDER_PREFIX
    from sluice.ps.snapshot import remove_state_files

    for item in items:
        with contextlib.suppress(OSError, ValueError):
            if Path(item).name.startswith(FOLDER_PREFIX) and Path(item).is_absolute():
                shutil.rmtree(item, ignore_errors=True)  # the function and arguments of a caller killed outright
            elif item.startswith("/"):
                remove_state_dir(item)
            else:
                remove_state_files(item)


def serve(commands: IO[bytes], launcher: int) -> int:
    """Follow the launcher's commands until `done` (exit quietly) or EOF (clean up after it)."""
    children: dict[int, int | None] = {}
    state: list[str] = []
    srun = False
    for raw in commands:
        verb, _, arg = raw.decode(errors="replace").strip().partition(" ")
        if verb == "done":
            return 0
        if verb == "spawn" and arg.isdigit():
            children[int(arg)] = _start_time(int(arg))
        elif verb == "reaped" and arg.isdigit():
            children.pop(int(arg), None)
        elif verb == "state" and arg:
            state.append(arg)
        elif verb == "srun":
            srun = True
    if not children and not state:
        return 0
    if srun:  # the launcher's death killed each srun (PR_SET_PDEATHSIG): its helper process, which the
        time.sleep(SRUN_CANCEL_SECONDS)  # group kill below would take too, is cancelling the step now
    groups, segments = clean_up(children)
    remove_job_state(state)
    with contextlib.suppress(OSError, ValueError):
        print(f"sluice launch: the launcher (pid {launcher}) died; its janitor killed {groups} process "
              f"group(s) and removed {segments} shared-memory segment(s)", file=sys.stderr, flush=True)
    return 0


class Janitor:
    """The launcher's end of the pipe; a janitor that cannot be started or has gone is simply not told."""

    def __init__(self) -> None:
        path = os.pathsep.join(p for p in (_PROJECT_ROOT, os.environ.get("PYTHONPATH")) if p)
        self.proc: subprocess.Popen[bytes] | None = None
        #: why there is no janitor, if there is none
        self.error = ""
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "sluice.launch.janitor", str(os.getpid())], stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": path}, start_new_session=True,
            )
        except OSError as exc:
            self.error = str(exc)

    def _tell(self, line: str) -> None:
        if self.proc is None or self.proc.stdin is None:
            return
        try:
            self.proc.stdin.write(line.encode() + b"\n")
            self.proc.stdin.flush()
        except (OSError, ValueError):  # it has gone: the job runs on without it
            self.proc.stdin = None

    def spawned(self, pid: int) -> None:
        self._tell(f"spawn {pid}")

    def reaped(self, pid: int) -> None:
        self._tell(f"reaped {pid}")

    def srun(self) -> None:
        """Children are srun steps: give SLURM a moment to cancel them before killing their groups."""
        self._tell("srun")

    def state(self, item: str) -> None:
        """Job state on this host to remove if the launcher dies: a state-file tag or a directory."""
        self._tell(f"state {item}")

    def close(self) -> None:
        """Every child is reaped: dismiss the janitor and reap it in turn."""
        if self.proc is None:
            return
        self._tell("done")
        with contextlib.suppress(OSError, ValueError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


def main() -> int:
    if sys.argv[1:2] == ["--remove"]:  # the end of a job on another host (Spawner.sweep): its state there
        remove_job_state(sys.argv[2:])
        return 0
    launcher = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else os.getppid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the launcher is its to handle
    return serve(sys.stdin.buffer, launcher)


if __name__ == "__main__":
    sys.exit(main())
