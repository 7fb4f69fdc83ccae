"""An elastic job's next generation (pure): hosts after workers are dropped or hosts are discovered, and the
places of the survivors of a job that shrank in place."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.launch.cluster import plan_cluster
from sluice.launch.config import load_config
from sluice.launch.elastic import ElasticSettings, grown, shrunk, slots, without
from sluice.launch.hosts import Host
from sluice.launch.reach import Reach
from sluice.scheduler.new_place import Place, parse_place, take_place, write_place


def test_a_dropped_worker_takes_its_slot_and_an_empty_host_leaves() -> None:
    hosts = [Host("a", 2, "r1"), Host("b", 1), Host("c", 2)]
    placed = ["a", "a", "b", "c", "c"]
    assert without(hosts, placed, (1,)) == [Host("a", 1, "r1"), Host("b", 1), Host("c", 2)]
    assert without(hosts, placed, (2,)) == [Host("a", 2, "r1"), Host("c", 2)]
    assert without(hosts, placed, ()) == hosts


@pytest.mark.parametrize(("found", "cap", "expected"), [
    ([Host("a", 4)], 8, [Host("a", 4), Host("b", 1)]),                      # more slots on a known host
    ([Host("c", 2)], 8, [Host("a", 2), Host("b", 1), Host("c", 2)]),        # a new host, appended
    ([Host("c", 2), Host("d", 2)], 4, [Host("a", 2), Host("b", 1), Host("c", 1)]),  # capped at --max-workers
    ([], 8, [Host("a", 2), Host("b", 1)]),                                   # a discovery never shrinks the job
])
def test_discovered_hosts_grow_the_job_up_to_the_cap(found: list[Host], cap: int, expected: list[Host]) -> None:
    assert grown([Host("a", 2), Host("b", 1)], found, cap) == expected
    assert slots(expected) <= cap


def test_bad_elastic_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="1 <= min <= max"):
        ElasticSettings(3, 2)
    with pytest.raises(ValueError, match="1 <= min <= max"):
        ElasticSettings(0, 2)


def test_survivors_of_a_shrink_are_numbered_again_in_their_old_order_by_host() -> None:
    places = shrunk(["b", "a", "b", "c"], "tcp://10.0.0.1:4000")  # the survivors' hosts, in old rank order
    assert [(p.rank, p.workers, p.local_rank, p.local_size) for p in places] == [
        (0, 4, 0, 2), (1, 4, 0, 1), (2, 4, 1, 2), (3, 4, 0, 1)]
    assert places[2].line() == "PLACE 2 4 1 2 tcp://10.0.0.1:4000"
    assert places[2].environ() == {
        "SLUICE_RANK": "2", "SLUICE_NUM_WORKERS": "4", "SLUICE_SCHEDULER": "tcp://10.0.0.1:4000", "RANK": "2",
        "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "SLUICE_SCHEDULER_STANDBY": ""}
    with_standby = shrunk(["a", "b"], "tcp://10.0.0.1:4000", "tcp://10.0.0.2:4001")[1]
    assert with_standby.line() == "PLACE 1 2 0 1 tcp://10.0.0.1:4000 tcp://10.0.0.2:4001"
    assert parse_place(with_standby.line()) == with_standby
    assert with_standby.environ()["SLUICE_SCHEDULER_STANDBY"] == "tcp://10.0.0.2:4001"
    two = shrunk(["a"], "tcp://10.0.0.1:4000", "tcp://10.0.0.2:4001,tcp://10.0.0.3:4001")[0]
    assert parse_place(two.line()) == two
    with pytest.raises(ValueError, match="not a scheduler endpoint"):
        parse_place("PLACE 0 1 0 1 tcp://10.0.0.1:4000 tcp://10.0.0.2:4001,10.0.0.3:4001")


@pytest.mark.parametrize("line", [
    "PLACE 1 2 0 1", "PLACE 1 2 0 1 tcp://h:1 extra", "PLACE 1 2 0 1 tcp://h:1 tcp://h:2 tcp://h:3",
    "PLACE -1 2 0 1 tcp://h:1", "PLACE 2 2 0 1 tcp://h:1",
    "PLACE 0 2 1 1 tcp://h:1", "PLACE 0 2 0 3 tcp://h:1", "PLACE 0 99999999 0 1 tcp://h:1", "PLACE 0 2 0 1 h:1",
    "PLACE 0 2 0 1 tcp://" + "h" * 400, "PLACE 0x1 2 0 1 tcp://h:1", "USR2", ""])
def test_a_bad_place_line_is_refused(line: str) -> None:
    with pytest.raises(ValueError):
        parse_place(line)


def test_a_place_is_written_whole_and_taken_once(tmp_path: Path) -> None:
    place = Place(1, 3, 0, 2, "tcp://127.0.0.1:5")
    assert take_place(str(tmp_path), 42) is None  # none written: the place is unchanged
    write_place(str(tmp_path), 42, place)
    assert parse_place(place.line()) == place
    assert take_place(str(tmp_path), 42) == place
    assert take_place(str(tmp_path), 42) is None and not list(tmp_path.iterdir())


def test_a_shrunk_plan_keeps_its_servers_and_places_the_workers_anew() -> None:
    config = load_config(None, {}, ["transport.host=192.0.2.1"])
    plan = plan_cluster([Host("127.0.0.1", 1), Host("192.0.2.10", 2)], "-H", None, 1, 0, None, Reach(), config)
    smaller = plan.with_workers(["192.0.2.10", "192.0.2.10"])
    assert [(p.role, p.rank, p.host, p.local_rank) for p in smaller.layout.processes] == [
        ("worker", 0, "192.0.2.10", 0), ("worker", 1, "192.0.2.10", 1), ("server", 0, "127.0.0.1", 0)]


def test_a_discovered_slot_takes_a_lost_hosts_worker_when_the_plan_has_none() -> None:
    config = load_config(None, {}, ["transport.host=192.0.2.1"])
    plan = plan_cluster([Host("192.0.2.30", 1), Host("192.0.2.10", 1)], "-H", None, 0, 0, None, Reach(), config)
    busy, lost = ["192.0.2.10"], {"192.0.2.30"}  # worker 1 runs; worker 0's host is lost
    assert plan.spare_host(busy, lost) is None
    found = plan.with_hosts([Host("192.0.2.10", 2), Host("192.0.2.40", 1)])
    assert found.spare_host(busy, lost) == "192.0.2.10"
    assert (found.address("192.0.2.40"), found.address("192.0.2.30")) == ("192.0.2.40", "192.0.2.30")
    assert found.with_hosts([Host("192.0.2.40", 1)]).spare_host(busy, lost) == "192.0.2.40"
