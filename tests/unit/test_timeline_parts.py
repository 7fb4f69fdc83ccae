"""Timeline parts gathered by the scheduler: chunks checked before they are kept (order, size, event lines, the
job's cap), written as received parts; the merge prefers them to parts written here and keeps one row per process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sluice.scheduler.members import Node
from sluice.scheduler.timeline_parts import CHUNK_BYTES, Gatherer
from sluice.transport.timeline import Timeline, gathered_path, merge, part_path
from sluice.transport.wire import Kind, Message, WireError

pytestmark = pytest.mark.timeout(10)


def _node(role: str, rank: int, pid: int) -> Node:
    return Node(f"{role}-{rank}", role, rank, [], pid, 0, node_id=rank + 1, rank=rank)


def _chunk(seq: int, data: bytes, last: bool) -> Message:
    return Message(Kind.TIMELINE, sender=1, meta={"seq": seq, "data": data, "last": last})


def _part(tmp: Path, pid: int, name: str) -> bytes:
    timeline = Timeline(tmp / f"written-{pid}.json", name, pid)
    timeline.span("PUSH", "layer.weight", 1.0, 2.0, {"step": 0})
    timeline.close()
    return (tmp / f"written-{pid}.json").read_bytes()


def _send(gatherer: Gatherer, node: Node, data: bytes, size: int) -> list[Message]:
    pieces = [data[i:i + size] for i in range(0, len(data), size)] or [b""]
    acks = []
    for seq, piece in enumerate(pieces):
        acks += [msg for _, msg in gatherer.take(node, _chunk(seq, piece, seq == len(pieces) - 1))]
    return acks


def test_a_part_in_chunks_is_kept_and_merged_with_one_row_per_process(tmp_path: Path) -> None:
    path = str(tmp_path / "trace.json")
    gatherer = Gatherer(path, limit_mib=1)
    worker, server = _node("worker", 0, 500), _node("server", 0, 500)  # two hosts, one pid
    acks = _send(gatherer, worker, _part(tmp_path, 500, "worker 0"), size=37)  # lines cut across chunks
    assert [a.meta for a in acks] == [{"seq": n} for n in range(len(acks))] and len(acks) > 3
    _send(gatherer, server, _part(tmp_path, 500, "server 0"), size=CHUNK_BYTES)
    assert gatherer.finished == {"worker-0", "server-0"}
    assert gathered_path(path, "worker", 0, 500).exists()
    with pytest.raises(WireError, match="already finished"):
        gatherer.take(worker, _chunk(0, b"", True))
    assert merge(path) == 8  # of each part: the process's name, the track's name, the slice, the dropped count
    events = json.loads(Path(path).read_text())
    rows = {e["args"]["name"]: e["pid"] for e in events if e["name"] == "process_name"}
    assert set(rows) == {"worker 0", "server 0"} and len(set(rows.values())) == 2  # renumbered apart
    assert not Path(path + ".parts").exists()


@pytest.mark.parametrize(("chunks", "why"), [
    ([(1, b"[\n", False)], "chunk 1 came where chunk 0 was due"),
    ([(0, b"x" * (CHUNK_BYTES + 1), False)], "over the"),
    ([(0, b"[\n{not json}\n", False)], "not JSON"),
    ([(0, b'[\n{"ph": "X"},\n', False)], "not a trace event"),
    ([(0, b'[\n[1, 2]\n]\n', True)], "not a trace event"),
    ([(0, b"[\n" + b"y" * (70 << 10), False)], "longer than"),
    ([(0, b"[\n", False), (1, b"z" * 200 + b"\n", True)], "not JSON"),
])
def test_a_bad_chunk_refuses_the_part_and_keeps_nothing(tmp_path: Path, chunks: list[tuple[int, bytes, bool]],
                                                        why: str) -> None:
    path = str(tmp_path / "trace.json")
    gatherer, node = Gatherer(path, limit_mib=1), _node("worker", 1, 7)
    acks = [msg for seq, data, last in chunks for _, msg in gatherer.take(node, _chunk(seq, data, last))]
    assert acks[-1].kind == Kind.TIMELINE_ACK and why in acks[-1].meta["refused"]
    assert node.name in gatherer.finished
    assert not list(Path(path + ".parts").glob("*"))  # the refused part's file is gone


def test_the_jobs_cap_and_strangers_are_refused(tmp_path: Path) -> None:
    gatherer = Gatherer(str(tmp_path / "trace.json"), limit_mib=0)
    (_, ack), = gatherer.take(_node("worker", 0, 1), _chunk(0, b"[\n", False))
    assert "timeline.gather_mib = 0 MiB; raise it" in ack.meta["refused"]
    with pytest.raises(WireError, match="not registered"):
        gatherer.take(None, _chunk(0, b"[\n", True))
    with pytest.raises(WireError, match="lacks meta field 'data'"):
        gatherer.take(_node("worker", 1, 2), Message(Kind.TIMELINE, meta={"seq": 0, "last": True}))


def test_merge_takes_a_received_part_over_the_written_one_and_a_written_one_never_sent(tmp_path: Path) -> None:
    path = str(tmp_path / "trace.json")
    sent, died = part_path(path, "worker", 0, pid=11), part_path(path, "worker", 1, pid=12)
    for part, pid, name in ((sent, 11, "worker 0"), (died, 12, "worker 1")):
        part.write_bytes(_part(tmp_path, pid, name)[:-3])  # as a killed process leaves it: no closing ']'
    gathered_path(path, "worker", 0, 11).write_bytes(_part(tmp_path, 11, "worker 0"))
    merge(path)
    names = [e["args"]["name"] for e in json.loads(Path(path).read_text()) if e["name"] == "process_name"]
    assert sorted(names) == ["worker 0", "worker 1"]  # worker 0 once: its received part
