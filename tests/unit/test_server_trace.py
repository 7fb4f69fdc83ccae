"""A server's SUM spans: one a round of a tensor, from its first push to the last of its chunks here summed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sluice.ps.store import ShardStore
from sluice.ps.trace import ServerTrace
from sluice.transport.timeline import read_events
from sluice.transport.wire import Flag, Kind, Message


def push(sender: int, chunk: int, round_: int, flags: int) -> Message:
    return Message(Kind.PUSH, sender=sender, key=3, chunk=chunk, round=round_, dtype="float32", shape=(2,),
                   flags=flags, payload=memoryview(np.ones(2, np.float32)))


def traced(tmp_path: Path, chunks: int) -> tuple[ShardStore, ServerTrace]:
    shard = ShardStore(node_id=1, workers=2, sync=True)
    shard.worker_ids = {10: ("w0", 0), 11: ("w1", 1)}
    shard.add_plan([[3, "fc.weight", "float32", None, [[i, 2] for i in range(chunks)]]])
    return shard, ServerTrace(str(tmp_path / "server0.part"), "server", 0, shard.chunks)


def take(shard: ShardStore, trace: ServerTrace, peer: str, msg: Message) -> None:
    shard.handle(peer, 1, msg)
    trace.pushed(msg, 1)


def sums(tmp_path: Path, trace: ServerTrace) -> list[tuple[int, int]]:
    trace.close()
    return [(e["args"]["step"], e["args"]["chunks"]) for e in read_events(tmp_path / "server0.part")
            if e.get("name") == "SUM"]


@pytest.mark.parametrize("flags", [Flag.WANT_REPLY, Flag.NONE])
def test_a_round_is_one_span_whether_its_results_go_back_with_the_pushes_or_to_a_later_pull(
        tmp_path: Path, flags: int) -> None:
    shard, trace = traced(tmp_path, chunks=1)
    for round_ in (1, 2, 3):
        take(shard, trace, "w0", push(10, 0, round_, flags))
        take(shard, trace, "w1", push(11, 0, round_, flags))
    assert sums(tmp_path, trace) == [(1, 1), (2, 1), (3, 1)]


def test_a_round_of_two_chunks_ends_when_both_are_summed(tmp_path: Path) -> None:
    shard, trace = traced(tmp_path, chunks=2)
    take(shard, trace, "w0", push(10, 0, 1, Flag.NONE))
    take(shard, trace, "w0", push(10, 1, 1, Flag.NONE))
    take(shard, trace, "w1", push(11, 0, 1, Flag.NONE))
    take(shard, trace, "w1", push(11, 1, 1, Flag.NONE))
    trace.pushed(push(11, 1, 1, Flag.NONE), 1)  # the same push seen again: its round is traced already
    assert sums(tmp_path, trace) == [(1, 2)]
