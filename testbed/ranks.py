"""Forked ranks, each with a bare transport and a collective DataPlane connected to the others: `Ranks`."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
from collections.abc import Callable
from typing import Any

import numpy as np

from sluice.errors import SluiceError
from sluice.scheduler.bootstrap import new_secret
from sluice.transport.auth import JobKeys
from sluice.transport.base import open_transport
from sluice.transport.config import TransportConfig
from sluice.transport.shm import remove_segments_of
from sluice.worker.collective.config import CollectiveConfig
from sluice.worker.collective.data import DataPlane
from testbed.children import Children

_fork = mp.get_context("fork")

RankFn = Callable[..., Any]


def _rank_main(rank: int, size: int, config: TransportConfig, secret: bytes | None, timeout: float,
               announce: Any, book: Any, end: Any, last: Any, fn: RankFn, args: tuple[Any, ...]) -> Any:
    """One rank: a bare transport and a data plane, connected to the others through the parent."""
    names = [f"worker-{r}" for r in range(size)]
    keys = JobKeys(secret, names) if secret is not None else None
    planes: list[DataPlane] = []
    transport = open_transport(names[rank], config, lambda peer, _ch, msg: planes[0].on_message(peer, msg), keys,
                               members=names)
    try:
        plane = DataPlane(transport, rank, names, list(range(size)), config.chunk_limit, CollectiveConfig(), timeout,
                          lambda priority: config.channel_for(priority, 1))
        planes.append(plane)
        announce.put((rank, transport.listen()))
        plane.connect(book.get(timeout=60), timeout=60)
        result = fn(plane, transport, rank, size, *args)
        with last.get_lock():
            last.value = max(last.value, plane.last_seq)
        end.wait(60)
        # a last op on channel 0, after any shared-memory announcement: nobody closes (unlinking its
        # segments, lingering on unsent replies) while a peer still has one of those to handle
        with contextlib.suppress(SluiceError):
            plane.allreduce(last.value + 1, np.zeros(1, np.int32), "int32", "sum", 0).wait(10)
        return result
    finally:
        transport.close(flush_seconds=2.0)


class Ranks:
    """`size` forked processes, each with a transport and a DataPlane, running fn(plane, transport,
    rank, size, *args); every process is reaped and its shared memory removed on exit."""

    def __init__(self, size: int, config: TransportConfig, curve: bool = False, timeout: float = 60.0) -> None:
        self.size, self.config, self.timeout = size, config, timeout
        self.secret = new_secret() if curve else None
        self._children = Children()
        self.pids: list[int] = []

    def run(self, fn: RankFn, *args: Any, limit: float = 120.0) -> list[Any]:
        """Every rank's return value, by rank; raises if any rank fails or is late."""
        children = self._children
        announce = children.queue()
        books = [children.queue() for _ in range(self.size)]
        end, last = children.barrier(self.size), _fork.Value("q", -1)  # the highest seq any rank started
        for rank in range(self.size):
            children.start(f"rank {rank}", _rank_main, rank, self.size, self.config, self.secret, self.timeout,
                           announce, books[rank], end, last, fn, args)
        self.pids = [p.pid for p in children._processes.values()]
        endpoints: dict[int, list[str]] = dict(announce.get(timeout=60) for _ in range(self.size))
        for book in books:
            book.put([endpoints[r] for r in range(self.size)])
        results = children.collect([f"rank {r}" for r in range(self.size)], limit)
        return [results[f"rank {r}"] for r in range(self.size)]

    def event(self) -> Any:
        """An event the ranks share (pass it in `run`'s args)."""
        return _fork.Event()

    def barrier(self) -> Any:
        """A barrier of all ranks (pass it in `run`'s args)."""
        return self._children.barrier(self.size)

    def close(self) -> None:
        self._children.close()
        for pid in self.pids:
            remove_segments_of(pid)

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
