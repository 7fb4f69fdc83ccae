"""The workers of one host as a torch.distributed process group (gloo for CPU tensors, NCCL for CUDA ones).

An existing engine, not written again: torch's own ProcessGroupGloo or ProcessGroupNCCL, made without
torch's default group (a script may well have one of its own: DDP's), whose members meet through a
FileStore in this host's /dev/shm. The store's name comes from the job's state tag (a secret's HMAC:
other jobs and users cannot guess it), the host's index among the job's worker hosts and the elastic
generation; it is created 0600. A gloo group removes it as soon as every member has connected (gloo needs
the store only to connect), so a member killed later leaves nothing behind; an NCCL group, which meets
through the store at each lane's first collective, leaves that to torch, whose last member to close removes
it. Gloo listens on the loopback only: nothing of a local group reaches the network.

A reduce-scatter gives each local rank an equal share of a flat tensor whose length the caller
padded to a multiple of the local size (worker/topology.py `share_bounds`); an allgather puts the shares back.
A group may run several lanes, each a process group of its own over the same store: collectives of one
lane must be issued in the same order by every member, those of different lanes need not be (a caller
issues reduce-scatters from one thread and allgathers from another).
"""

from __future__ import annotations

import contextlib
import os
import re
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend, FileStore, PrefixStore, Store, Work

from sluice.errors import SluiceError
from sluice.transport.shm_peers import SHM_DIR

#: how long the members of a local group wait for each other, forming it or in one collective
TIMEOUT_S = 60.0
#: where the store lives: the host's shared memory, as the servers' state files (ps/snapshot.py, which removes a
#: store a killed worker left with the job's other files: the same `sluice-state-<tag>-` prefix)
STATE_DIR = SHM_DIR
_TAG = re.compile(r"[0-9a-f]{16}")


def store_path(tag: str, host: int, generation: int, directory: str = STATE_DIR) -> str:
    """Where the local group of the job's `host`-th worker host meets in `generation` (checks the tag)."""
    if not _TAG.fullmatch(tag):  # nothing else reaches a file name
        raise ValueError(f"a state tag is 16 hex digits, got {tag[:40]!r}")
    return os.path.join(directory, f"sluice-state-{tag}-local-{host}-{generation}")


class LocalGroup:
    """This worker's place in its host's group of workers: `local_rank` of `local_size`."""

    def __init__(self, tag: str, host: int, generation: int, local_rank: int, local_size: int,
                 backend: str = "gloo", timeout: float = TIMEOUT_S, directory: str = STATE_DIR, lanes: int = 1) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"a local group runs on gloo or nccl, not {backend!r}")
        if not 0 <= local_rank < local_size:
            raise ValueError(f"local rank {local_rank} is not one of {local_size}")
        if backend == "nccl" and not torch.cuda.is_available():
            raise SluiceError("a local group on NCCL needs a CUDA device; this process has none")
        self.local_rank, self.local_size, self.backend = local_rank, local_size, backend
        self.path = store_path(tag, host, generation, directory)
        # made 0600 before torch opens it: the store tells where each member's gloo pairs listen
        os.close(os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
        self._store: FileStore | None = FileStore(self.path, local_size)
        try:
            self.lanes: list[Backend] = [_make(backend, PrefixStore(f"lane{lane}", self._store), local_rank, local_size,
                                               timeout) for lane in range(lanes)]
            if backend == "gloo":
                self._remove_store()
        except RuntimeError as exc:
            self._store = None
            with contextlib.suppress(FileNotFoundError):  # the group failed: no one meets here any more
                os.unlink(self.path)
            raise SluiceError(f"the workers of host {host} did not form their local group ({backend}, {local_size} "
                              f"workers) within {timeout:g} s: is one of them gone? ({str(exc)[:200]})") from None

    def _remove_store(self) -> None:
        # Torch's own removal counts the members' stores as they are destroyed: one that is not (a killed
        # member, or one whose group outlived its interpreter) leaves the file in /dev/shm. Here: once every
        # member is past a first barrier on every lane (each lane connected, also under TORCH_GLOO_LAZY_INIT,
        # which connects a lane at its first collective), none reads the store again; local rank 0 removes it;
        # the second barrier keeps each member's store from being destroyed before that (a store destroyed
        # while the file is still there adds to it, and one adding just after the removal would create it again).
        for lane in range(len(self.lanes)):
            self._lane(lane).barrier().wait()
        if self.local_rank == 0:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        self._lane(0).barrier().wait()

    def reduce_scatter(self, flat: torch.Tensor, share: torch.Tensor, lane: int = 0) -> Work:
        """Start summing `flat` (padded: local_size x share.numel() elements, contiguous) over the group into
        this rank's `share`; wait() on what it returns (on CUDA: the current stream waits, not the host)."""
        work: Work = self._lane(lane)._reduce_scatter_base(share, flat)
        return work

    def allgather(self, share: torch.Tensor, flat: torch.Tensor, lane: int = 0) -> Work:
        """Start filling `flat` (padded, contiguous) with every rank's share, in local rank order."""
        work: Work = self._lane(lane)._allgather_base(flat, share)
        return work

    def close(self) -> None:
        """Leave the group; the store's file goes with its last member."""
        self.lanes = []
        self._store = None

    def _lane(self, lane: int) -> Any:  # torch's stubs lack Backend's collectives
        if not self.lanes:
            raise SluiceError("this local group was closed")
        return self.lanes[lane]


def _make(backend: str, store: Store, rank: int, size: int, timeout: float) -> Backend:
    # the options' constructors and fields differ from torch's stubs: reached untyped
    if backend == "nccl":
        nccl: Any = dist.ProcessGroupNCCL
        options = nccl.Options()
        options._timeout = timedelta(seconds=timeout)
        made: Backend = nccl(store, rank, size, options)
        return made
    gloo: Any = dist.ProcessGroupGloo
    options = gloo._Options()
    options._devices = [gloo.create_device(hostname="127.0.0.1")]
    options._timeout = timedelta(seconds=timeout)
    made = gloo(store, rank, size, options)
    return made
