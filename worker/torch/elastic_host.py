"""sluice.torch's elastic commit files (torch.save) and its exit to re-form; the rest is worker/elastic/host.py's.

`SLUICE_ELASTIC_DIR` holds `worker-<rank>.pt`, each a torch.save of one worker's last commit with
its key (generation, commit counter), loaded weights_only (a file never runs code) and, to read only
the key, memory-mapped. What the files mean, SIGUSR1 and REFORM are worker/elastic/host.py's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, BinaryIO, NoReturn

import torch

from sluice import close_at_exit
from sluice.worker.elastic import host
from sluice.worker.elastic.host import (
    CLOSE_SECONDS,
    ENV_DIR,
    ENV_GENERATION,
    NO_COMMIT,
    REFORM,
    Commit,
    CommitFiles,
    CommitFormat,
    ElasticEnv,
    HostsUpdatedInterrupt,
    Key,
    _hosts_updated,
    elastic_env,
    hosts_updated,
    watch_host_updates,
)
from sluice.worker.torch.state import PENDING
from sluice.worker.torch.updates import READY

__all__ = ["CLOSE_SECONDS", "ENV_DIR", "ENV_GENERATION", "FILES", "NO_COMMIT", "REFORM", "Commit", "ElasticEnv",
           "HostsUpdatedInterrupt", "Key", "_hosts_updated", "commit_files", "commit_path", "elastic_env",
           "hosts_updated", "newest_commit", "read_commit", "reform", "remove_older", "watch_host_updates",
           "write_commit"]


def _save(payload: dict[str, Any], out: BinaryIO) -> None:
    torch.save(payload, out)


def _load(path: Path, key_only: bool) -> Any:
    # only the key is needed with key_only: the tensors stay in the file (mmap)
    return torch.load(path, map_location="cpu", weights_only=True, mmap=key_only)


#: torch's writer reports a failed write as a RuntimeError
FILES = CommitFiles(CommitFormat(".pt", _save, _load, (RuntimeError,), "sluice.torch.elastic"))


def commit_path(directory: Path, rank: int) -> Path:
    return FILES.path(directory, rank)


def write_commit(directory: Path, rank: int, payload: dict[str, Any]) -> Path:
    """Save `payload` as worker `rank`'s commit, atomically (CommitFiles.write)."""
    return FILES.write(directory, rank, payload)


def read_commit(path: Path, mmap: bool = False) -> Commit | None:
    """A commit file's content (mmap: the key, the tensors left in the file); None for what is not a commit."""
    return FILES.read(path, key_only=mmap)


def commit_files(directory: Path) -> list[Path]:
    return FILES.files(directory)


def newest_commit(directory: Path) -> Commit | None:
    """The latest commit among this host's files (the highest key), loaded in full; None if none."""
    return FILES.newest(directory)


def remove_older(directory: Path, key: Key, keep: Path) -> int:
    """Remove this host's commit files older than `key`, keeping `keep`; how many were removed."""
    return FILES.remove_older(directory, key, keep)


def reform(reason: BaseException, commits: int) -> NoReturn:
    """Leave with status REFORM: say why, drop the updates in flight, close Sluice without waiting long."""
    PENDING.clear()  # the committed state is what counts; the next generation redoes the rest
    READY.clear()
    host.reform(reason, commits, close_at_exit)
