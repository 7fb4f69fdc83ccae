"""An elastic job's next generation (pure): hosts after workers are dropped or hosts are discovered."""

from __future__ import annotations

import pytest

from sluice.launch.elastic import ElasticSettings, grown, slots, without
from sluice.launch.hosts import Host


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
