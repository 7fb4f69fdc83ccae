"""The host's job registry: each job's scheduler publishes its state as a file; other jobs and `sluice jobs` read it.

Jobs launched separately on the same hosts find each other here, with no service to run: one small
JSON file per job in a directory only this user can write (jobs.registry_dir, or the variable
SLUICE_JOBS_REGISTRY_DIR; default /tmp/sluice-jobs-<uid>), replaced atomically about once a second,
removed when the job ends. What a file says is checked like a network message (size, schema, ranges)
before use; a file that fails is skipped and counted, and one whose scheduler is gone (or that has not
been refreshed for a minute) is removed; a directory others could write into is neither written nor read. On
several hosts, jobs.registry = "HOST:PORT" also sends the entry to the cluster's registry, served by
a scheduler on HOST (scheduler/registry_service.py, registry_client.py); the file is written all the same.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported when used: the registry's modules import this one
    from sluice.scheduler.registry_client import RegistryLink

log = logging.getLogger("sluice.scheduler")

MAX_ENTRY_BYTES = 4096
#: an entry not refreshed for this long is stale (its scheduler hung, or its pid now names another
#: process): removed on read; a live scheduler writes it again at its next tick
STALE_S = 60.0
ENV_JOBS_DIR = "SLUICE_JOBS_REGISTRY_DIR"  # also jobs.registry_dir, as every config key has its variable


@dataclass(frozen=True)
class JobState:
    job: str  # the scheduler's endpoint: unique while the job runs
    pid: int  # the scheduler's process
    started: float  # wall clock
    workers: int
    servers: int
    priorities: bool  # [jobs] priorities on
    level: int  # the deepest level its workers report (0: the top)
    attained_mib: float  # bytes pushed by its busiest worker, MiB
    rounds: int
    updated: float  # wall clock


def registry_dir(configured: str = "") -> Path:
    return Path(configured or os.environ.get(ENV_JOBS_DIR) or f"{tempfile.gettempdir()}/sluice-jobs-{os.getuid()}")


def _entry(directory: Path, job: str) -> Path:
    return directory / ("job-" + "".join(c if c.isalnum() else "_" for c in job)[:120] + ".json")


def _private(directory: Path, create: bool = True) -> None:
    """Create the directory for this user only; refuse one that someone else could write into."""
    if create:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = directory.stat()
    if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(f"{directory} is not private to this user: remove it, or set {ENV_JOBS_DIR}")


def publish(state: JobState, directory: Path | None = None) -> None:
    directory = directory or registry_dir()
    _private(directory)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    with os.fdopen(fd, "w") as file:
        json.dump(asdict(state), file)
    os.replace(tmp, _entry(directory, state.job))


def withdraw(job: str, directory: Path | None = None) -> None:
    with contextlib.suppress(OSError):
        _entry(directory or registry_dir(), job).unlink()


def parse_state(raw: object) -> JobState | None:
    """A registry entry, or None unless every field has its type and a sane range."""
    fields = JobState.__dataclass_fields__
    if type(raw) is not dict or set(raw) != set(fields):
        return None
    ints = ("pid", "workers", "servers", "level", "rounds")
    floats = ("started", "attained_mib", "updated")
    if (type(raw["job"]) is not str or not 0 < len(raw["job"]) <= 200 or type(raw["priorities"]) is not bool
            or not all(type(raw[k]) is int and 0 <= raw[k] < 1 << 40 for k in ints)
            or not all(type(raw[k]) in (int, float) and 0 <= raw[k] < 1e13 for k in floats)):
        return None
    return JobState(**{**raw, **{k: float(raw[k]) for k in floats}})


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_entry(path: Path) -> JobState | None:
    """One entry file, or None: only a regular file (not a link, nor a FIFO that would block) of sane size."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as file:
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            data = file.read(MAX_ENTRY_BYTES + 1)
            return parse_state(json.loads(data)) if len(data) <= MAX_ENTRY_BYTES else None
        except (OSError, ValueError):
            return None


def read_all(directory: Path | None = None, now: float | None = None) -> tuple[list[JobState], int]:
    """The jobs running on this host, oldest first, and how many entries were malformed (skipped).

    Raises PermissionError when the directory is not private to this user: what others could write
    there is not read at all.
    """
    directory = directory or registry_dir()
    now = time.time() if now is None else now
    jobs, bad = [], 0
    try:
        _private(directory, create=False)
        paths = sorted(directory.glob("job-*.json"))
    except FileNotFoundError:
        return [], 0
    for path in paths:
        state = _read_entry(path)
        if state is None:
            bad += 1
        elif not _alive(state.pid) or now - state.updated > STALE_S:
            withdraw(state.job, directory)  # its scheduler died (or hung) without removing it
        else:
            jobs.append(state)
    return sorted(jobs, key=lambda s: s.started), bad


def describe(jobs: list[JobState], now: float | None = None) -> str:
    """`sluice jobs`' table."""
    now = time.time() if now is None else now
    lines = [f"{'job (scheduler)':32} {'pid':>7} {'age s':>7} {'workers':>7} {'priorities':>10} {'level':>5} "
             f"{'rounds':>7} {'sent MiB':>9}"]
    for s in jobs:
        lines.append(f"{s.job[:32]:32} {s.pid:7d} {now - s.started:7.0f} {s.workers:7d} "
                     f"{'on' if s.priorities else 'off':>10} {s.level:5d} {s.rounds:7d} {s.attained_mib:9.1f}")
    return "\n".join(lines)


class Registry:
    """A scheduler's entry: published about once a second while the job runs, removed at the end."""

    PERIOD = 1.0

    def __init__(self, job: str, env: Any, started: float, directory: Path | None = None) -> None:
        self.job, self.env, self.started = job, env, started
        jobs = env.section("jobs")
        self.directory = directory or registry_dir(str(jobs.get("registry_dir", "")))
        self.priorities = bool(jobs.get("priorities", False))
        self._next = 0.0
        self._published = False
        self._broken = False
        self.link: RegistryLink | None = None
        self._told_cluster = False
        if jobs.get("registry"):  # the cluster's registry, beside this host's files
            from sluice.scheduler.registry_client import open_link

            self.link = open_link(jobs, env.transport_config().curve)

    def tick(self, now: float, reports: dict[str, tuple[int, int, int]]) -> None:
        if self.link is not None:
            self._take(self.link.receive(now))
        if now < self._next or (self._broken and self.link is None):
            return
        self._next = now + self.PERIOD
        reports_ = list(reports.values()) or [(0, 0, 0)]
        state = JobState(self.job, os.getpid(), self.started, self.env.workers, self.env.servers, self.priorities,
                         max(r[0] for r in reports_), max(r[1] for r in reports_) / (1 << 20),
                         max(r[2] for r in reports_), time.time())
        if self.link is not None:
            self.link.report(state, now)
        if self._broken:
            return
        try:
            if not self._published:  # say who else runs here, once
                others, bad = read_all(self.directory)
                if others:
                    log.info("other Sluice jobs on this host: %s", ", ".join(
                        f"{o.job} ({o.workers} workers, level {o.level}, {o.rounds} rounds)" for o in others))
                if bad:
                    log.warning("skipped %d malformed entries in the job registry %s", bad, self.directory)
            publish(state, self.directory)
            self._published = True
        except OSError as exc:  # the job runs on; only the registry is missing
            log.warning("cannot publish this job in the job registry (%s); `sluice jobs` will not list it", exc)
            self._broken = True

    def _take(self, cluster: list[JobState] | None) -> None:
        """The registry's first table: say who else runs in the cluster, once."""
        if cluster is None or self._told_cluster:
            return
        self._told_cluster = True
        others = [o for o in cluster if o.job != self.job]
        if others:
            log.info("other Sluice jobs in the cluster: %s", ", ".join(
                f"{o.job} ({o.workers} workers, level {o.level}, {o.rounds} rounds)" for o in others))

    def close(self) -> None:
        if self._published:
            withdraw(self.job, self.directory)
        if self.link is not None:
            self.link.withdraw(self.job)
            self.link.close()
