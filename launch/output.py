"""Where a child's output goes: the terminal with a [role rank] prefix and maybe the time, and per-rank log files.

The files take horovodrun's layout (`--output-filename DIR`, and torchrun's `--log-dir DIR`):
DIR/rank.N/stdout and DIR/rank.N/stderr for worker N, N zero-padded to the width of the highest
rank so that the folders sort; DIR/server.N, DIR/aggregator.N and DIR/scheduler likewise. A file
holds the process's lines as written (with the time in front when asked), without the prefix.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import BinaryIO, Protocol

from sluice.launch.run_options import STREAMS, OutputOptions


class Console(Protocol):
    def write(self, data: bytes) -> None: ...


def stamp() -> bytes:
    """The local time, ISO 8601 to the millisecond, and a space: what --prefix-output-with-timestamp puts first."""
    now = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(now)).encode() + b".%03d " % (int(now * 1000) % 1000)


def folder(role: str, rank: int, workers: int) -> str:
    """A process's folder under the log directory: rank.N for worker N (zero-padded), else role.N."""
    if role == "worker":
        return f"rank.{rank:0{len(str(max(workers - 1, 0)))}d}"
    if role == "scheduler":
        return "scheduler" if rank == 0 else "scheduler.standby" if rank == 1 else f"scheduler.standby.{rank}"
    return f"{role}.{rank}"


class ChildOutput:
    """One child's lines, by stream ("stdout", "stderr"; "stdout" carries both when they come as one)."""

    def __init__(self, console: Console, label: str, options: OutputOptions, path: str | None = None) -> None:
        self.console, self.options = console, options
        self.prefix = f"[{label}] ".encode()
        self.files: dict[str, BinaryIO] = {}
        if path is not None and options.directory is not None:
            self._open(os.path.join(options.directory, path))

    def relabel(self, label: str) -> None:
        """The prefix of the lines from now on (a survivor renumbered as its job shrank in place)."""
        self.prefix = f"[{label}] ".encode()

    def _open(self, where: str) -> None:
        os.makedirs(where, exist_ok=True)
        for stream in sorted(STREAMS):
            name = os.path.join(where, stream)
            mode = "ab" if name in self.options.opened else "wb"  # a later generation or restart goes on after
            self.options.opened.add(name)
            self.files[stream] = open(name, "ab" if mode == "ab" else "wb")  # noqa: SIM115 - closed at the end
            if stream not in self.options.files:
                self.files.pop(stream).close()  # made (empty), so that the layout is what horovodrun's is

    def write(self, stream: str, lines: list[bytes]) -> None:
        marked = stamp() if self.options.timestamps else b""
        if stream in self.options.console:
            self.console.write(b"".join(marked + self.prefix + raw + b"\n" for raw in lines))
        if (file := self.files.get(stream)) is not None:
            try:
                file.write(b"".join(marked + raw + b"\n" for raw in lines))
                file.flush()  # a job killed midway leaves its last lines in the file
            except (OSError, ValueError) as exc:  # a full disk must not end the job: the terminal goes on
                self.files.pop(stream, None)
                self.console.write(f"[launch] cannot write {file.name}: {exc}; its output goes on here only\n"
                                   .encode())

    def close(self, stream: str) -> None:
        if (file := self.files.pop(stream, None)) is not None:
            with contextlib.suppress(OSError):
                file.close()


def launcher_lines(text: str, timestamps: bool) -> bytes:
    """The launcher's own lines for the terminal, `[launch]` first (and the time, when asked)."""
    marked = stamp().decode() if timestamps else ""
    return "".join(f"{marked}[launch] {line}\n" for line in text.splitlines()).encode()
