"""What an elastic worker shares with the launcher on its host: the variables, the commit files, SIGUSR1, REFORM.

`SLUICE_ELASTIC_DIR` (private to the job and host, on /dev/shm) holds `worker-<rank><suffix>`, each
one worker's last commit with its key (generation, commit counter), in its framework's format
(`CommitFormat`: torch.save for sluice.torch, msgpack for sluice.tensorflow and sluice.keras).
Generations run one after the other and, within one, counters only grow, so the highest key is the
latest commit in time, even against the file of a host that left and came back with a counter from
an older lineage. A host keeps files of ranks it no longer runs until a worker's first commit there
removes the older ones. SIGUSR1 from the launcher means "more slots": it is noted, and the next
commit raises HostsUpdatedInterrupt. `reform` leaves with status REFORM, which asks the launcher for
a new generation. With `SLUICE_ELASTIC_IN_PLACE=1` (sluice launch --in-place) a failure does not end
the process: `reform_in_place` closes Sluice, waits for SIGUSR2 (the launcher has replaced the lost
worker and started the job's scheduler again), takes the next generation and joins again.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, NoReturn

from sluice.errors import SluiceError
from sluice.scheduler.bootstrap import (
    ENV_ELASTIC_DIR,
    ENV_ELASTIC_GENERATION,
    ENV_ELASTIC_IN_PLACE,
    ENV_RANK,
    ENV_WORKERS,
    REFORM_EXIT,
)
from sluice.scheduler.new_place import take_place
from sluice.transport.shm_space import SHM_FIX
from sluice.worker.collective import process_set
from sluice.worker.elastic.wakeup import on_signal

log = logging.getLogger("sluice.worker")

#: what the launcher sets: the directory for committed state (unset: not an elastic job), the generation;
#: and the exit status that asks it to re-form the job (not a failure)
ENV_DIR = ENV_ELASTIC_DIR
ENV_GENERATION = ENV_ELASTIC_GENERATION
REFORM = REFORM_EXIT

Key = tuple[int, int]
#: the key of "nothing committed yet"
NO_COMMIT: Key = (-1, 0)
#: seconds the exit on a failure gives Sluice to close: a peer is gone, so do not wait for it
CLOSE_SECONDS = 5.0
_hosts_updated = threading.Event()
#: set by the launcher (--in-place): survivors of a lost worker re-form the job in this process
ENV_IN_PLACE = ENV_ELASTIC_IN_PLACE
#: how long a worker whose job failed waits for the launcher's SIGUSR2 to re-form in place
REFORM_WAIT_S = 120.0
_reform_go = threading.Event()
#: each returns, in the signal handler, what fails the current connection (a shim's: its node's fail)
_reform_victims: list[Callable[[], Callable[[], None] | None]] = []


@dataclass(frozen=True)
class ElasticEnv:
    directory: Path
    generation: int


def elastic_env() -> ElasticEnv | None:
    """The launcher's elastic settings; None when this process is not part of an elastic job."""
    directory = os.environ.get(ENV_DIR, "")
    if not directory:
        return None
    raw = os.environ.get(ENV_GENERATION, "0")
    try:
        generation = int(raw)
    except ValueError:
        generation = -1
    if generation < 0:
        raise ValueError(f"{ENV_GENERATION}={raw!r} is not a generation (0, 1, 2, ...): sluice launch --elastic "
                         f"sets it; unset {ENV_DIR} to run without elastic")
    return ElasticEnv(Path(directory), generation)


@dataclass(frozen=True)
class Commit:
    key: Key
    path: Path
    payload: dict[str, Any]


@dataclass(frozen=True)
class CommitFormat:
    """How a framework's shim writes and reads its commit files."""

    #: the files' suffix (".pt"): `worker-<rank><suffix>`
    suffix: str
    #: write the payload (a dict with "generation" and "commit") to an open file
    save: Callable[[dict[str, Any], BinaryIO], None]
    #: (path, key_only) -> the payload; with key_only, enough of it to read the key (any exception: unreadable)
    load: Callable[[Path, bool], Any]
    #: what `save` raises for a failed write, besides OSError
    write_errors: tuple[type[BaseException], ...] = ()
    #: who writes these files, for the warning about one that is not a commit ("sluice.torch.elastic")
    writer: str = "sluice elastic"


class CommitFiles:
    """A host's commit files in one format: write one atomically, read one, find the newest, drop older ones."""

    def __init__(self, fmt: CommitFormat) -> None:
        self.fmt = fmt

    def path(self, directory: Path, rank: int) -> Path:
        return directory / f"worker-{rank}{self.fmt.suffix}"

    def write(self, directory: Path, rank: int, payload: dict[str, Any]) -> Path:
        """Save `payload` as worker `rank`'s commit: a temporary file in the same directory, then a rename,
        so a reader (or a worker killed half-way) never sees a partial file."""
        final = self.path(directory, rank)
        temp = directory / f".worker-{rank}.{os.getpid()}.tmp"
        failures: tuple[type[BaseException], ...] = (OSError, *self.fmt.write_errors)
        try:
            directory.mkdir(mode=0o700, exist_ok=True)  # the launcher makes it on its host; the first commit elsewhere
            with open(temp, "wb") as out:
                self.fmt.save(payload, out)
            os.replace(temp, final)
        except failures as exc:
            temp.unlink(missing_ok=True)
            full = isinstance(exc, OSError) and exc.errno == errno.ENOSPC
            raise OSError(f"could not commit the elastic state to {final}: {exc}; free space there (df -h "
                          f"{directory}){', ' + SHM_FIX if full else ''} or commit less state") from exc
        return final

    def read(self, path: Path, key_only: bool = False) -> Commit | None:
        """A commit file's content (with key_only, at least its key); None (with a warning) for a file
        this module did not write. Only plain values, arrays and tensors are loaded: a file here never
        runs code."""
        try:
            payload = self.fmt.load(path, key_only)
        except FileNotFoundError:
            return None  # replaced or removed since the directory was listed
        except Exception as exc:  # any unreadable file is skipped the same way
            log.warning("elastic: ignoring %s, which is not a readable commit: %s", path, exc)
            return None
        if not (isinstance(payload, dict) and isinstance(payload.get("generation"), int)
                and isinstance(payload.get("commit"), int)):
            log.warning("elastic: ignoring %s, which is not a commit of %s", path, self.fmt.writer)
            return None
        return Commit((payload["generation"], payload["commit"]), path, payload)

    def files(self, directory: Path) -> list[Path]:
        try:
            return sorted(p for p in directory.glob(f"worker-*{self.fmt.suffix}") if p.is_file())
        except OSError:
            return []

    def newest(self, directory: Path) -> Commit | None:
        """The latest commit among this host's files (the highest key), loaded in full; None if none."""
        for _ in range(3):  # a file replaced or removed between the scan and the load: scan again
            best: tuple[Key, Path] | None = None
            for path in self.files(directory):
                found = self.read(path, key_only=True)  # only the key is needed: the state stays in the file
                if found is not None and (best is None or found.key > best[0]):
                    best = (found.key, path)
            if best is None:
                return None
            loaded = self.read(best[1])
            if loaded is not None and loaded.key >= best[0]:
                return loaded
        return None

    def remove_older(self, directory: Path, key: Key, keep: Path) -> int:
        """Remove this host's commit files older than `key` (ranks that moved or left), keeping `keep`,
        which holds `key`: the newest state on this host survives. Returns how many were removed."""
        removed = 0
        for path in self.files(directory):
            if path == keep:
                continue
            found = self.read(path, key_only=True)
            if found is not None and found.key < key:
                path.unlink(missing_ok=True)
                removed += 1
        return removed


class HostsUpdatedInterrupt(RuntimeError):  # Horovod's name
    """The launcher found more slots (SIGUSR1): this process leaves at its next commit, with status
    REFORM, and the launcher starts a bigger generation from that commit."""


def _on_hosts_updated(signum: int, frame: object) -> None:
    _hosts_updated.set()


def hosts_updated() -> bool:
    """Whether SIGUSR1 came since the last call."""
    if not _hosts_updated.is_set():
        return False
    _hosts_updated.clear()
    return True


def watch_host_updates() -> None:
    """In an elastic job, note SIGUSR1 ("hosts were updated") instead of dying of it, and with --in-place
    SIGUSR2 ("re-form now") (from the main thread only, where Python runs handlers; idempotent)."""
    if os.environ.get(ENV_DIR) and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR1, _on_hosts_updated)
        if in_place():  # acted on at once, even while the main thread runs a TF graph (wakeup.py)
            on_signal(signal.SIGUSR2, _reform_now)


def in_place() -> bool:
    """Whether a failure re-forms the job in this process (sluice launch --in-place)."""
    return os.environ.get(ENV_IN_PLACE) == "1"


def on_reform(victim: Callable[[], Callable[[], None] | None]) -> None:
    """Register what SIGUSR2 fails: `victim()`, called as the signal comes, returns the connection's fail now."""
    _reform_victims.append(victim)


def fail_on_reform(current_node: Callable[[], Any]) -> None:
    """Register a shim's connection as what SIGUSR2 fails: `current_node()` is its node as it is then (None
    when there is none), whose control channel fails so that whatever still waits on it stops waiting."""
    def victim() -> Callable[[], None] | None:
        node = current_node()
        if node is None:
            return None
        return lambda: node.control.fail("the launcher replaced a lost worker: the job re-forms in place")

    on_reform(victim)


def _reform_now() -> None:
    """SIGUSR2: the launcher replaced the lost worker: fail what this process still waits on (the old
    connection, chosen now), then let `reform_in_place` go on."""
    victims = [fail for get in _reform_victims if (fail := get()) is not None]

    def go() -> None:
        for fail in victims:
            _close_quietly(fail)
        _reform_go.set()

    threading.Thread(target=go, name="sluice-elastic-reform", daemon=True).start()


def reform_in_place(reason: BaseException, commits: int, close: Callable[[], None], init: Callable[[], None]) -> None:
    """Close Sluice (`close`, the shim's), wait for the launcher's SIGUSR2, take the next generation and
    join the re-formed job (`init`); SluiceError if the word does not come within REFORM_WAIT_S."""
    print(f"sluice elastic: {reason}; re-forming the job in this process from commit {commits} (--in-place)",
          file=sys.stderr, flush=True)
    closer = threading.Thread(target=_close_quietly, args=(close,), name="sluice-elastic-close", daemon=True)
    closer.start()
    closer.join(CLOSE_SECONDS)
    if not _reform_go.wait(REFORM_WAIT_S):
        raise SluiceError(f"the launcher did not re-form the job within {REFORM_WAIT_S:g} s after: {reason}")
    _reform_go.clear()
    try:
        place = take_place(os.environ.get(ENV_DIR, ""), os.getpid())
    except ValueError as exc:
        raise SluiceError(f"the launcher's new place for this worker is unreadable: {exc}") from None
    shrank = place is not None and str(place.workers) != os.environ.get(ENV_WORKERS)
    if place is not None:  # its rank and the job's size (changed when the job shrank), the new standby's endpoint
        if (str(place.rank), str(place.workers)) != (os.environ.get(ENV_RANK), os.environ.get(ENV_WORKERS)):
            print(f"sluice elastic: the job goes on with {place.workers} workers; this one is rank {place.rank} now",
                  file=sys.stderr, flush=True)
        os.environ.update(place.environ())
    process_set.reform(shrank)  # registered again at init(), unless the job shrank
    os.environ[ENV_GENERATION] = str(int(os.environ.get(ENV_GENERATION, "0")) + 1)
    init()


def reform(reason: BaseException, commits: int, close: Callable[[], None]) -> NoReturn:
    """Leave with status REFORM: say why, close Sluice (`close`, the shim's) without waiting long."""
    print(f"sluice elastic: {reason}; leaving with status {REFORM} so the launcher re-forms the job from commit "
          f"{commits}", file=sys.stderr)
    closer = threading.Thread(target=_close_quietly, args=(close,), name="sluice-elastic-close", daemon=True)
    closer.start()
    closer.join(CLOSE_SECONDS)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or broken stream must not stop the exit
            stream.flush()
    os._exit(REFORM)


def _close_quietly(close: Callable[[], None]) -> None:
    try:
        close()
    except Exception as exc:  # a peer is gone: closing may fail, and the exit follows regardless
        log.debug("elastic: closing Sluice after a failure: %s", exc)
