"""Horovod's ProcessSet object and its registration (init, add, remove), for every framework's shim."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from sluice.errors import InvalidCallError, SluiceError

if TYPE_CHECKING:
    from sluice.worker.collective.sets import ProcessSets


class ProcessSet:
    """A sorted list of global ranks; `process_set_id` is set once the set is registered (hvd.init(process_sets=)
    or add_process_set) and cleared when it is removed. The global set has id 0 and every rank."""

    process_set_id: int | None = None
    ranks: list[int] | None = None
    mpi_comm: Any = None

    def __init__(self, ranks_or_comm: Sequence[int]) -> None:
        try:
            listed = sorted(ranks_or_comm)  # Horovod's name: a list of ranks, or an mpi4py Comm (none here)
        except TypeError:
            raise ValueError("ProcessSet should be initialized with a list of process ranks or an mpi4py Comm "
                             "object (Sluice has no MPI: give the ranks)") from None
        if any(type(rank) is not int for rank in listed):
            raise ValueError("ProcessSet should be initialized with a list of process ranks or an mpi4py Comm object")
        self.ranks = listed
        #: this process's global rank, set when the set is registered (size/rank/included answer from it)
        self._own_rank: int | None = None
        #: added while hvd.elastic.run's training function ran: that function adds it again after a re-forming
        self._in_run = False

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


def set_id(process_set: Any) -> int | None:
    """The id a collective's `process_set=` names (0 for None: every worker); None for a set not registered."""
    if process_set is None:
        return 0
    if not isinstance(process_set, ProcessSet):
        raise InvalidCallError(f"process_set must be a ProcessSet (hvd.ProcessSet, hvd.global_process_set), "
                               f"got {type(process_set).__name__}")
    return process_set.process_set_id


def sets_of(node: Any) -> ProcessSets:
    """A worker node's process sets (the job's engine among them); SluiceError before they run."""
    if node.process_sets is None:
        raise SluiceError("the collective engine is not running (init() did not finish)")
    sets: ProcessSets = node.process_sets
    return sets


#: the sets this process registered (init's list, add_process_set) and has not removed, in that order
_REGISTERED: list[ProcessSet] = []
#: those to register again at the next init(): the job re-forms in place in this process (`reform`)
_AGAIN: list[ProcessSet] = []
#: how deep this process is in hvd.elastic.run's training function (`in_elastic_run`)
_RUNNING = [0]


@contextmanager
def in_elastic_run() -> Iterator[None]:
    """hvd.elastic.run's training function runs: the sets it adds are its own (`reform`)."""
    _RUNNING[0] += 1
    try:
        yield
    finally:
        _RUNNING[0] -= 1


def reform(shrank: bool) -> None:
    """The job re-forms in this process (--in-place): its sets are registered again at the next init(), in the
    same order, as the newcomer, which runs the script from the top, registers them before hvd.elastic.run
    (adding a set is collective: every worker must). Sets added inside the training function are dropped, as
    Horovod's reset drops every set: the function, called again, adds them again, on the newcomer too. Where
    the job shrank their ranks name other workers now: all are dropped, and a call with one fails as with any
    set not registered (add it again). Horovod registers none again (an elastic job with process sets hangs
    there: its issue #4021)."""
    kept = [] if shrank else [listed for listed in _REGISTERED if not listed._in_run]
    for listed in _REGISTERED:
        if listed not in kept:
            listed._invalidate()
    _AGAIN[:] = kept
    _REGISTERED.clear()


def _register(sets: ProcessSets, rank: int, listed: ProcessSet) -> None:
    listed._own_rank = rank
    assert listed.ranks is not None
    listed.process_set_id = sets.add(listed.ranks)
    if listed.process_set_id is not None:
        _REGISTERED.append(listed)


def register_sets(sets: ProcessSets, rank: int, process_sets: Sequence[ProcessSet] | str | None) -> None:
    """hvd.init(process_sets=...): the global set's ranks, then each listed set added in order (every worker
    lists the same); a set listed twice, or the global set's ranks, leaves the later object unregistered, as in
    Horovod. "dynamic" (Horovod's switch for add/remove later) needs nothing: they always work here. After
    a re-forming in place (`reform`), the sets registered before come first."""
    global_process_set.ranks, global_process_set._own_rank = list(range(sets.job.size)), rank
    again = list(_AGAIN)
    _AGAIN.clear()
    _REGISTERED.clear()  # a new node: a new table of sets
    for listed in again:
        _register(sets, rank, listed)
    if process_sets is None or process_sets == "dynamic":
        return
    if isinstance(process_sets, str) or not all(isinstance(p, ProcessSet) for p in process_sets):
        raise ValueError(f"process_sets must be a list of hvd.ProcessSet or 'dynamic', got {process_sets!r:.80}")
    for listed in process_sets:
        _register(sets, rank, listed)


def add_process_set(node: Any, process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Horovod's add_process_set on a worker `node`: every worker calls it alike, in the same order;
    ValueError for a set that exists already."""
    listed = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    assert listed.ranks is not None
    listed._own_rank = node.rank
    added = sets_of(node).add(listed.ranks)
    if added is None:
        raise ValueError(f"Attempted to add a duplicate process set: {listed}")
    listed.process_set_id, listed._in_run = added, _RUNNING[0] > 0
    _REGISTERED.append(listed)
    return listed


def remove_process_set(node: Any, process_set: ProcessSet) -> bool:
    """Horovod's remove_process_set on a worker `node`: every worker calls it alike; False for the global set
    or one not registered."""
    registered = process_set.process_set_id
    if registered is None or registered == 0:
        return False
    process_set._invalidate()
    if process_set in _REGISTERED:
        _REGISTERED.remove(process_set)
    return sets_of(node).remove(registered)


def barrier_set(process_set: Any) -> Any:
    """barrier's first argument, checked: a name given there (the order of Sluice's barrier before it took Horovod's)
    fails saying where a name goes."""
    if isinstance(process_set, str):
        raise InvalidCallError(f"barrier({process_set!r}): the first argument is the process set, as in Horovod's "
                               f"barrier(process_set); name a barrier with barrier(name={process_set!r})")
    return process_set
