"""Process sets' messages: tagged with the set on the way out, checked and routed by set on the way in."""

from __future__ import annotations

from typing import Any

import pytest

from sluice.transport.wire import Kind, Message
from sluice.worker.collective.process_set import ProcessSet, set_id
from sluice.worker.collective.sets import ProcessSets, SetTransport


class Wire:
    """What the transport was asked to send and refuse (a fake: unit test of the routing logic only)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, int, Message]] = []
        self.refused: list[str] = []
        self.name, self.config = "worker-0", None

    def send(self, peer: str, channel: int, msg: Message) -> None:
        self.sent.append((peer, channel, msg))

    def refuse(self, peer: str, text: str) -> None:
        self.refused.append(text)


class Job:
    size, rank = 3, 0


def sets_of(wire: Wire) -> ProcessSets:
    return ProcessSets(Job(), wire, ["worker-0", "worker-1", "worker-2"], ["h"] * 3, lambda *a: None)  # type: ignore[arg-type, return-value]


def test_a_sets_messages_travel_as_set_kinds_with_its_id() -> None:
    wire = Wire()
    SetTransport(wire, 4).send("worker-1", 2, Message(Kind.COLL_DATA, sender=1, key=3, round=7, meta=None))  # type: ignore[arg-type]
    SetTransport(wire, 4).send("worker-1", 0, Message(Kind.COORD_UP, sender=1, meta={"hello": True}))  # type: ignore[arg-type]
    assert [(m.kind, m.meta, m.key, m.round) for _, _, m in wire.sent] == [
        (Kind.SET_DATA, {"set": 4}, 3, 7), (Kind.SET_UP, {"hello": True, "set": 4}, 0, 0)]


@pytest.mark.parametrize(("meta", "why"), [
    (None, "meta has no process set id"), ({"set": "1"}, "meta has no process set id"),
    ({"set": 0}, "meta has no process set id"), ({"set": 99}, "no such set here"),
])
def test_a_message_for_no_set_of_ours_is_refused(meta: Any, why: str) -> None:
    wire = Wire()
    sets_of(wire).on_message("worker-1", Message(Kind.SET_DATA, sender=1, meta=meta))
    assert len(wire.refused) == 1 and why in wire.refused[0]


def test_a_message_for_a_set_about_to_be_added_is_kept() -> None:
    wire = Wire()
    sets = sets_of(wire)
    sets.on_message("worker-1", Message(Kind.SET_DONE, sender=1, meta={"set": 1}))
    assert wire.refused == []


def test_process_set_objects_as_horovods() -> None:
    ranks = ProcessSet([2, 0])
    assert ranks.ranks == [0, 2] and ranks.process_set_id is None and ranks.size() is None
    assert ProcessSet(ranks_or_comm=[1, 0]).ranks == [0, 1]  # Horovod's keyword
    with pytest.raises(ValueError, match="list of process ranks"):
        ProcessSet([0, "1"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="list of process ranks"):
        ProcessSet(3)  # type: ignore[arg-type]
    assert set_id(None) == 0 and set_id(ranks) is None
    with pytest.raises(ValueError, match="process_set must be a ProcessSet"):
        set_id(0)


class _Table:
    """What register_sets needs of a node's sets: the job's size, and `add` numbering sets as the engine does."""

    def __init__(self, size: int) -> None:
        self.job = type("Job", (), {"size": size})()
        self.added: list[list[int]] = []

    def add(self, ranks: list[int]) -> int | None:
        if ranks in self.added:
            return None
        self.added.append(list(ranks))
        return len(self.added)


def test_a_job_reformed_in_place_registers_its_sets_again_in_order_unless_it_shrank() -> None:
    from sluice.worker.collective import process_set

    first, second, removed = ProcessSet([0, 2]), ProcessSet([1, 2]), ProcessSet([0, 1])
    table = _Table(3)
    process_set.register_sets(table, 0, [first, removed])  # type: ignore[arg-type]
    second._own_rank, second.process_set_id = 0, table.add([1, 2])
    process_set._REGISTERED.append(second)  # as add_process_set does
    removed._invalidate()
    process_set._REGISTERED.remove(removed)  # as remove_process_set does
    process_set.reform(shrank=False)  # a worker replaced: the same ranks are the same workers
    again = _Table(3)
    process_set.register_sets(again, 0, None)  # type: ignore[arg-type]
    assert again.added == [[0, 2], [1, 2]] and (first.process_set_id, second.process_set_id) == (1, 2)
    process_set.reform(shrank=True)  # ranks renumbered: the old sets name other workers
    assert first.process_set_id is None and second.process_set_id is None
    smaller = _Table(2)
    process_set.register_sets(smaller, 0, None)  # type: ignore[arg-type]
    assert smaller.added == [] and process_set._REGISTERED == []


def test_a_set_added_inside_the_elastic_training_function_is_dropped_at_a_reforming_for_it_to_add_again() -> None:
    """Horovod's reset drops every set and hvd.elastic.run's function, called again, adds its sets again: one
    added inside the function is not registered again in place (the newcomer adds it in that function too)."""
    from sluice.worker.collective import process_set

    before, inside = ProcessSet([0, 2]), ProcessSet([1, 2])
    table = _Table(3)
    process_set.register_sets(table, 0, [before])  # type: ignore[arg-type]
    node = type("Node", (), {"rank": 0, "process_sets": table})()
    with process_set.in_elastic_run():
        process_set.add_process_set(node, inside)
    outside = process_set.add_process_set(node, [0, 1])  # after the function returned: kept
    process_set.reform(shrank=False)
    again = _Table(3)
    process_set.register_sets(again, 0, None)  # type: ignore[arg-type]
    assert again.added == [[0, 2], [0, 1]] and inside.process_set_id is None
    assert (before.process_set_id, outside.process_set_id) == (1, 2)
    process_set.reform(shrank=True)
    process_set.register_sets(_Table(2), 0, None)  # type: ignore[arg-type]
