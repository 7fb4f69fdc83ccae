"""A `sluice launch` process under test (`Launch`) and what /proc says about the processes it starts."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def children(pid: int) -> set[int]:
    """The processes `pid` started (its threads' /proc children lists)."""
    found: set[int] = set()
    for path in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            found |= {int(p) for p in path.read_text().split()}
    return found


def _descendants(pid: int) -> set[int]:
    seen: set[int] = set()
    todo = [pid]
    while todo:
        for child in children(todo.pop()) - seen:
            seen.add(child)
            todo.append(child)
    return seen


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


class Launch:
    """One `sluice launch` process; its output is collected by threads so reads have deadlines."""

    def __init__(self, args: list[str], cwd: Path = ROOT) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sluice.launch.cli", "launch", *args], cwd=cwd, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self.seen: set[int] = set()  # every descendant observed, checked dead at the end
        self._cond = threading.Condition()
        self._threads = [
            threading.Thread(target=self._read, args=(stream, lines), daemon=True)
            for stream, lines in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))
        ]
        for thread in self._threads:
            thread.start()

    def _read(self, stream: object, lines: list[str]) -> None:
        for line in stream:  # type: ignore[attr-defined]
            with self._cond:
                lines.append(line.rstrip("\n"))
                self._cond.notify_all()

    def wait_line(self, pattern: str, timeout: float = 30.0) -> re.Match[str]:
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.out:
                    if match := regex.search(line):
                        return match
                left = deadline - time.monotonic()
                ended = not any(thread.is_alive() for thread in self._threads)
                if left <= 0 or ended:
                    raise AssertionError(f"no line matching {pattern!r}; stdout: {self.out}; stderr: {self.err}")
                self._cond.wait(min(left, 0.5))

    def worker_pids(self, workers: int) -> dict[int, tuple[int, int]]:
        """rank -> (worker pid, grandchild pid), once every worker has printed them."""
        pids = {}
        for rank in range(workers):
            match = self.wait_line(rf"^\[worker {rank}\] pids (\d+) (\d+)$")
            pids[rank] = (int(match.group(1)), int(match.group(2)))
        self.seen |= {pid for pair in pids.values() for pid in pair}
        return pids

    def snapshot(self) -> set[int]:
        self.seen |= _descendants(self.proc.pid)
        return self.seen

    def finish(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"the launcher still runs after {timeout} s; stdout:\n{self.stdout()}\nstderr:\n{self.stderr()}"
            ) from None
        for thread in self._threads:
            thread.join(5)
        return code

    def stdout(self) -> str:
        return "\n".join(self.out)

    def stderr(self) -> str:
        return "\n".join(self.err)

    def assert_none_left(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while (alive := sorted(p for p in self.seen if _alive(p))) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive, f"still running: {[(p, _cmdline(p)) for p in alive]}"

    def close(self) -> None:
        with_descendants = self.seen | _descendants(self.proc.pid)
        with contextlib.suppress(OSError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in with_descendants:
            if _alive(pid):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        self.proc.wait(5)


def _worker_rank(pid: int) -> int:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return -1
    ranks = [e.split(b"=", 1)[1] for e in environ if e.startswith(b"SLUICE_RANK=")]
    return int(ranks[0]) if ranks else -1
