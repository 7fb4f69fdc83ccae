"""Horovod's ProcessSet object: the ranks of a group of workers that run collectives among themselves."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class ProcessSet:
    """A sorted list of global ranks; `process_set_id` is set once the set is registered (hvd.init(process_sets=)
    or add_process_set) and cleared when it is removed. The global set has id 0 and every rank."""

    process_set_id: int | None = None
    ranks: list[int] | None = None
    mpi_comm: Any = None

    def __init__(self, ranks: Sequence[int]) -> None:
        try:
            listed = sorted(ranks)
        except TypeError:
            raise ValueError("ProcessSet should be initialized with a list of process ranks or an mpi4py Comm "
                             "object (Sluice has no MPI: give the ranks)") from None
        if any(type(rank) is not int for rank in listed):
            raise ValueError("ProcessSet should be initialized with a list of process ranks or an mpi4py Comm object")
        self.ranks = listed
        #: this process's global rank, set when the set is registered (size/rank/included answer from it)
        self._own_rank: int | None = None

    def _invalidate(self) -> None:
        self.process_set_id = None

    def size(self) -> int | None:
        """How many ranks the set has, or None before it is registered."""
        if self.process_set_id is None or self.ranks is None:
            return None
        return len(self.ranks)

    def rank(self) -> int | None:
        """This process's rank within the set (the order of allgather's rows), or None before it is registered
        or where this process is not in the set. Broadcast roots stay global ranks, as in Horovod."""
        if self.process_set_id is None or self.ranks is None or self._own_rank not in self.ranks:
            return None
        return self.ranks.index(self._own_rank)

    def included(self) -> bool | None:
        """Whether this process is in the set, or None before the ranks are known."""
        if self.ranks is None or self._own_rank is None:
            return None
        return self._own_rank in self.ranks

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm=None)"

    __repr__ = __str__


#: every worker of the job; its ranks are filled in at init()
global_process_set = ProcessSet([])
global_process_set.process_set_id = 0
