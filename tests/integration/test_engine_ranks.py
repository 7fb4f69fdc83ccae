"""64 light ranks (no torch) run the whole collective engine: the coordinator tree (over direct lanes, the ranks
sharing a host) and small allreduces, which from their second step on carry their data up the tree with their
requests (worker/collective/carry.py)."""

from __future__ import annotations

import multiprocessing as mp
import random
import time
from typing import Any

import numpy as np
import pytest

from sluice.transport.base import open_transport
from sluice.transport.config import TransportConfig
from sluice.transport.wire import Message
from sluice.worker.collective.config import CollectiveConfig
from sluice.worker.collective.engine import CollectiveEngine
from testbed.children import Children

RANKS, ARITY, STEPS, OPS = 64, 4, 4, 20
_ctx = mp.get_context("fork")


def _rank_main(rank: int, endpoints: Any, book: Any, reports: Any, done: Any) -> None:
    names = [f"worker-{r}" for r in range(RANKS)]
    engine: CollectiveEngine | None = None

    def handler(peer: str, channel: int, msg: Message) -> None:
        assert engine is not None  # made before the address book lets anyone dial us
        engine.on_message(peer, msg)

    config = TransportConfig(channels=1, curve=False, shm=False, marks=False, chunk_bytes=64 << 10,
                             inflight_bytes=1 << 20)
    transport = open_transport(names[rank], config, handler, members=names)
    settings = CollectiveConfig(arity=ARITY, cycle_ms=2.0)
    engine = CollectiveEngine(transport, rank, names, ["host-0"] * RANKS, settings, 64 << 10, 60.0, lambda _: 0)
    try:
        endpoints.put((rank, transport.listen()))
        engine.connect(book.get(timeout=60))
        rng = random.Random(rank)
        order, sums_ok = [], True
        for step in range(STEPS):
            names_now = [f"op{i}" for i in range(OPS)]
            rng.shuffle(names_now)  # every rank submits in its own order
            arrays = {name: np.full(16, rank + int(name[2:]) + step, np.float32) for name in names_now}
            handles = {name: engine.allreduce(name, [arrays[name]], "float32", "sum") for name in names_now}
            for name, handle in handles.items():
                handle.wait(60)
                want = sum(range(RANKS)) + RANKS * (int(name[2:]) + step)
                sums_ok &= bool((arrays[name] == want).all())
        assert engine.coordinator is not None
        order = engine.coordinator.stats()
        reports.put((rank, sums_ok, engine._seq, order))
        done.wait(120)  # inner ranks forward to the others until everyone has finished
    finally:
        engine.close()
        transport.close(0.5)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_64_ranks_allreduce_through_the_tree() -> None:
    keys = [f"rank {r}" for r in range(RANKS)]
    with Children() as children:
        endpoints, reports, done = children.queue(), children.queue(), _ctx.Event()
        books = [children.queue() for _ in range(RANKS)]
        for rank in range(RANKS):
            children.start(keys[rank], _rank_main, rank, endpoints, books[rank], reports, done)
        addresses: dict[int, list[str]] = {}
        while len(addresses) < RANKS:
            rank, listening = endpoints.get(timeout=120)
            addresses[rank] = listening
        for queue in books:
            queue.put([addresses[r] for r in range(RANKS)])
        started = time.monotonic()
        got = {}
        while len(got) < RANKS:
            rank, sums_ok, seqs, stats = reports.get(timeout=max(1.0, 180 - (time.monotonic() - started)))
            got[rank] = (sums_ok, seqs, stats)
        done.set()
        children.collect(keys, timeout=60)
    assert all(ok for ok, _, _ in got.values()), "a sum was wrong on some rank"
    # the first step's ops take the slow path and the data plane (numbered alike on every rank); every later
    # one is in the table, and its sum came down with its decision
    assert {seqs for _, seqs, _ in got.values()} == {OPS}
    assert {stats["carried"] for _, _, stats in got.values()} == {(STEPS - 1) * OPS}
    root = got[0][2]
    assert 0 < root["max_received_per_tick"] <= ARITY, root
    # every rank is on "host-0": from the lanes' set-up on, the tree's messages come over direct lanes
    assert all(stats["received_on_lanes"] > 0 for _, _, stats in got.values())
