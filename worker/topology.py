"""Where each worker runs (pure): Horovod's local and cross ranks, and the hierarchy's sets and shares."""

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
    local_of = _local_ranks(hosts)
    local_rank = local_of[rank]
    # the cross group: one worker per host, the one with this local rank (hosts in order of first rank)
    group = [r for r in range(len(hosts)) if local_of[r] == local_rank]
    homogeneous = len({hosts.count(h) for h in hosts}) == 1
    return Placement(local_rank, hosts.count(hosts[rank]), group.index(rank), len(group), homogeneous)


@dataclass(frozen=True)
class HostGroups:
    """The two sets a hierarchical reduction runs on, for one worker (job ranks, ascending)."""

    #: the workers of this worker's host
    local: tuple[int, ...]
    #: the workers with this worker's local rank, one per host
    cross: tuple[int, ...]
    #: this host's index among the worker hosts (in the order of their first rank)
    host: int


def host_groups(hosts: Sequence[str], rank: int) -> HostGroups | None:
    """Worker `rank`'s local and cross sets, or None where a hierarchy has nothing to gain or cannot be
    built: one host, one worker per host, or hosts that run different numbers of workers."""
    where = placement(hosts, rank)
    if not where.homogeneous or where.local_size < 2 or where.cross_size < 2:
        return None
    local_of = _local_ranks(hosts)
    local = tuple(r for r in range(len(hosts)) if hosts[r] == hosts[rank])
    cross = tuple(r for r in range(len(hosts)) if local_of[r] == where.local_rank)
    return HostGroups(local, cross, list(dict.fromkeys(hosts)).index(hosts[rank]))


def _local_ranks(hosts: Sequence[str]) -> list[int]:
    """Each worker's index among the workers of its host, by rank."""
    seen: dict[str, int] = {}
    local_of = []
    for host in hosts:
        local_of.append(seen.get(host, 0))
        seen[host] = local_of[-1] + 1
    return local_of


def share_bounds(length: int, parts: int) -> tuple[int, list[tuple[int, int]]]:
    """A flat tensor of `length` elements cut in `parts` equal shares: the padded length (a multiple of `parts`)
    and each share's [start, end) within the unpadded `length` (the last ones shorter, or empty)."""
    if parts < 1 or length < 0:
        raise ValueError(f"cannot cut {length} elements in {parts} shares")
    share = -(-length // parts)
    return share * parts, [(min(r * share, length), min((r + 1) * share, length)) for r in range(parts)]
