"""Horovod's local and cross ranks, and the hierarchy's sets, from the workers' hosts (worker/topology.py)."""

from __future__ import annotations

import pytest

from sluice.worker.topology import HostGroups, Placement, host_groups, placement

A, B, C = "10.0.0.1", "10.0.0.2", "10.0.0.3"


@pytest.mark.parametrize(
    ("hosts", "rank", "want"),
    [
        ([A], 0, Placement(0, 1, 0, 1, True)),
        ([A, A, A, A], 2, Placement(2, 4, 0, 1, True)),  # one host: every worker local, one node
        ([A, A, B, B], 0, Placement(0, 2, 0, 2, True)),
        ([A, A, B, B], 3, Placement(1, 2, 1, 2, True)),
        ([A, B, A, B], 1, Placement(0, 2, 1, 2, True)),  # ranks interleaved over the hosts
        ([A, B, A, B], 2, Placement(1, 2, 0, 2, True)),
        ([B, A, A, B], 1, Placement(0, 2, 1, 2, True)),  # hosts numbered in the order they first appear
        ([A, A, A, B, C], 2, Placement(2, 3, 0, 1, False)),  # uneven: only host A has a third worker
        ([A, A, A, B, C], 4, Placement(0, 1, 2, 3, False)),
        ([A, A, A, B, C], 1, Placement(1, 3, 0, 1, False)),
    ],
)
def test_placement(hosts: list[str], rank: int, want: Placement) -> None:
    assert placement(hosts, rank) == want


def test_placement_rejects_a_rank_outside_the_job() -> None:
    with pytest.raises(ValueError, match="rank 2"):
        placement([A, A], 2)


@pytest.mark.parametrize(
    ("hosts", "rank", "want"),
    [
        ([A, A, B, B], 0, HostGroups((0, 1), (0, 2), 0)),
        ([A, A, B, B], 3, HostGroups((2, 3), (1, 3), 1)),
        ([A, B, A, B], 1, HostGroups((1, 3), (0, 1), 1)),  # interleaved: rank 1 is host B's local rank 0
        ([B, A, A, B], 3, HostGroups((0, 3), (2, 3), 0)),  # B first appears first; sets in rank order
        ([A, A, A, B, B, B], 4, HostGroups((3, 4, 5), (1, 4), 1)),
        ([A, A, A, A], 1, None),  # one host: nothing crosses
        ([A, B, C], 0, None),  # a worker a host: nothing to sum inside one
        ([A, A, B], 0, None),  # uneven: the shares would not line up
    ],
)
def test_host_groups(hosts: list[str], rank: int, want: HostGroups | None) -> None:
    assert host_groups(hosts, rank) == want
