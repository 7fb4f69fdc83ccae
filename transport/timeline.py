"""A Chrome trace (Perfetto, chrome://tracing) of one process: slices per tensor track, written by a background thread.

Each process writes its own file in the JSON array format, one event a line. Under `sluice launch
--timeline PATH` that file is a part, `PATH.parts/<role><rank>-<pid>.part` on the process's own host (or
in its temp directory when PATH's directory does not exist there); at its end the process streams the
part to the scheduler over its own connection (scheduler/timeline_parts.py), which writes it as
`PATH.parts/<role><rank>-<pid>.json` on the launcher's host, and the launcher merges them into PATH
(`merge`; a part that was never sent, such as a killed process's, is merged from where it was
written when the launcher's host can see it). Events are formatted on the caller's thread into a
list (a few microseconds; nothing when the timeline is off: callers hold None) and written every half
second, so the I/O threads never wait on the disk. Past MAX_PENDING unwritten events, new ones are
dropped and counted. Timestamps are wall-clock microseconds, so the processes of one host line up.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_PENDING = 1 << 20
FLUSH_S = 0.5


@dataclass(frozen=True)
class TimelineConfig:
    #: write a Chrome trace of every process to PATH ('' = off); `sluice launch --timeline PATH` sets it
    path: str = ""
    #: the most MiB of timeline parts the scheduler takes from the job's processes at the end; a part
    #: beyond it stays where its process wrote it, and that process's log says where
    gather_mib: int = 1024

    def __post_init__(self) -> None:
        if self.gather_mib < 0:
            raise ValueError(f"timeline.gather_mib must be 0 or more, got {self.gather_mib}")


def part_path(path: str, role: str, rank: int, pid: int | None = None) -> Path:
    """Where process `pid` (this one by default) of `role` and `rank` writes its part of the job's
    timeline PATH: PATH.parts/ when that directory can be made on this host, else the temp directory."""
    name = f"{role}{rank}-{os.getpid() if pid is None else pid}.part"
    directory = Path(path + ".parts")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:  # PATH is the launcher's; this host may not have its directory
        return Path(tempfile.gettempdir()) / f"sluice-timeline-{name}"
    return directory / name


def gathered_path(path: str, role: str, rank: int, pid: int) -> Path:
    """Where the scheduler writes the part it received from process `pid` of `role` and `rank`."""
    return Path(path + ".parts") / f"{role}{rank}-{pid}.json"


def now_us() -> float:
    return time.time() * 1e6


class Timeline:
    """One process's trace: `span` and `instant` on named tracks (a tensor, a fused group)."""

    def __init__(self, path: Path | str, process: str, pid: int) -> None:
        self.path, self.pid = Path(path), pid
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("w")
        self._file.write("[\n")
        self._pending: list[str] = []
        self._tracks: dict[str, int] = {}
        self._lock = threading.Lock()
        self._writing = threading.Lock()
        self.dropped = 0
        self._closed = threading.Event()
        self._meta("process_name", 0, process)
        self._writer = threading.Thread(target=self._write_loop, name="sluice-timeline", daemon=True)
        self._writer.start()

    def _meta(self, kind: str, tid: int, name: str) -> None:
        self._pending.append(f'{{"name":"{kind}","ph":"M","pid":{self.pid},"tid":{tid},'
                             f'"args":{{"name":{json.dumps(name)}}}}}')

    def _track(self, track: str) -> int:
        tid = self._tracks.get(track)
        if tid is None:
            with self._lock:
                tid = self._tracks.get(track)
                if tid is None:
                    tid = self._tracks[track] = len(self._tracks) + 1
                    self._meta("thread_name", tid, track)
        return tid

    def span(self, name: str, track: str, start_us: float, end_us: float, args: dict[str, Any]) -> None:
        """A slice `name` on `track` from start to end (microseconds since the epoch)."""
        self._add(f'{{"name":"{name}","ph":"X","pid":{self.pid},"tid":{self._track(track)},"ts":{start_us:.1f},'
                  f'"dur":{max(end_us - start_us, 0.0):.1f},"args":{json.dumps(args)}}}')

    def instant(self, name: str, track: str, at_us: float, args: dict[str, Any]) -> None:
        self._add(f'{{"name":"{name}","ph":"i","s":"t","pid":{self.pid},"tid":{self._track(track)},'
                  f'"ts":{at_us:.1f},"args":{json.dumps(args)}}}')

    def _add(self, line: str) -> None:
        with self._lock:
            if len(self._pending) >= MAX_PENDING:
                self.dropped += 1
                return
            self._pending.append(line)

    def _write_loop(self) -> None:
        while not self._closed.wait(FLUSH_S):
            self._flush()

    def _flush(self) -> None:
        # one flush at a time: a writer thread slower than close()'s join must not lose its batch to the file closing
        with self._writing:
            with self._lock:
                batch, self._pending = self._pending, []
            if batch and not self._file.closed:
                self._file.write("".join(line + ",\n" for line in batch))
                self._file.flush()

    def close(self) -> None:
        """Write what is left and end the array, so the file is valid JSON."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._writer.join(5)
        self._flush()
        with self._writing:
            self._file.write(f'{{"name":"dropped_events","ph":"M","pid":{self.pid},"args":{{"count":{self.dropped}}}}}'
                             '\n]\n')
            self._file.close()


def read_events(path: Path) -> list[dict[str, Any]]:
    """The events of one part file, even one whose process died before closing it (no final ']')."""
    events = []
    for line in path.read_text().splitlines():
        line = line.strip().rstrip(",")
        if line in ("", "[", "]"):
            continue
        try:
            event = json.loads(line)
        except ValueError:
            continue  # a line cut short by a killed process
        if isinstance(event, dict):
            events.append(event)
    return events


def merge(path: str) -> int:
    """Merge every part of PATH.parts/ into PATH (one JSON array, sorted by time); remove the parts.
    A part the scheduler received (.json) is taken; one written here and never sent (.part: its process
    died or could not send) only when no received copy exists. Processes on different hosts may share
    a pid: a later part's is renumbered, so each process keeps its own row. Returns the number of events."""
    directory = Path(path + ".parts")
    received = sorted(directory.glob("*.json"))
    names = {part.stem for part in received}
    written = [part for part in sorted(directory.glob("*.part")) if part.stem not in names]
    events: list[dict[str, Any]] = []
    pids: set[int] = set()
    for part in received + written:
        taken = read_events(part)
        own = {e["pid"] for e in taken if isinstance(e.get("pid"), int)}
        if own & pids:
            renumber = {pid: max(pids | own) + 1 + i for i, pid in enumerate(sorted(own))}
            for event in taken:
                event["pid"] = renumber.get(event.get("pid"), event.get("pid"))
            own = set(renumber.values())
        pids |= own
        events += taken
    events.sort(key=lambda e: (e.get("ph") != "M", e.get("ts", 0.0)))
    tmp = Path(path + ".tmp")
    with tmp.open("w") as file:
        file.write("[\n" + ",\n".join(json.dumps(e) for e in events) + "\n]\n")
    os.replace(tmp, path)
    for part in [*received, *directory.glob("*.part"), *directory.glob("*.tmp")]:
        part.unlink(missing_ok=True)
    directory.rmdir()
    return len(events)
