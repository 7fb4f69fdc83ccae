"""Where each worker runs (pure): Horovod's local and cross ranks from the host of every worker rank."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    """One worker's place in the job, with Horovod's meanings.

    local: the workers on this worker's host, numbered by global rank. cross: the workers that have
    this worker's local rank, one per host that has that many workers, numbered in the order the
    hosts first appear among the ranks (on a homogeneous job: the host's index and the host count).
    """

    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    #: every host runs as many workers
    homogeneous: bool


def placement(hosts: Sequence[str], rank: int) -> Placement:
    """The placement of worker `rank`, given the host of every worker by rank."""
    if not 0 <= rank < len(hosts):
        raise ValueError(f"rank {rank} is not one of the {len(hosts)} workers")
    local_of = [sum(1 for h in hosts[:r] if h == hosts[r]) for r in range(len(hosts))]
    local_rank = local_of[rank]
    # the cross group: one worker per host, the one with this local rank (hosts in order of first rank)
    group = [r for r in range(len(hosts)) if local_of[r] == local_rank]
    homogeneous = len({hosts.count(h) for h in hosts}) == 1
    return Placement(local_rank, hosts.count(hosts[rank]), group.index(rank), len(group), homogeneous)
