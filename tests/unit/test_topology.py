"""Horovod's local and cross ranks from the workers' hosts (worker/topology.py)."""

from __future__ import annotations

import pytest

from sluice.worker.topology import Placement, placement

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
