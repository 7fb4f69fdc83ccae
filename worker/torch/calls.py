"""How a Horovod-style call keeps the ranks in step: its name, the refusal of a call this rank cannot run, its handle.

Every collective call draws its name first (an unnamed call takes the next number of one sequence,
the same on every rank whatever fails later), and checks its arguments inside `refusing(name)`:
where this rank cannot run the call, the same call fails on every other rank too (the engine's
`refuse`), so every rank raises at that call and the next collectives run. The exception types are
Horovod's: InvalidCallError (a ValueError) for arguments no rank could run, CollectiveError (Horovod's
HorovodInternalError) where the ranks disagreed or another rank refused.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Protocol

from sluice.errors import InvalidCallError
from sluice.worker.collective.engine import CollectiveEngine
from sluice.worker.collective.process_set import set_id, sets_of
from sluice.worker.collective.refusal import mark_handled
from sluice.worker.collective.refusal import refusing as collective_refusing
from sluice.worker.torch.state import NAMES, STATE, require


def engine(process_set: Any = None) -> CollectiveEngine:
    """The engine of `process_set` (None: every worker); CollectiveError (HorovodInternalError) for a set
    not registered or one this worker is not in, raised here only, as Horovod does at the call."""
    return sets_of(require()).engine(set_id(process_set), "collective")


def member_engine(process_set: Any) -> CollectiveEngine | None:
    """The engine of `process_set`, or None where this worker is not in the set (Horovod then leaves it out:
    a DistributedOptimizer steps on local gradients); CollectiveError for a set not registered."""
    return sets_of(require()).member_engine(process_set)


def op_name(name: str | None, kind: str, on: CollectiveEngine | None = None) -> str:
    """The engine's name of a call: the user's, or `<kind>.noname.<n>` from one sequence for every kind, per
    process set (`on`'s): only a set's members call on it, so the others' numbers must not move."""
    if name is not None:
        return name
    if on is None or not on.label:
        return f"{kind}.noname.{next(NAMES)}"
    with _handles_lock:
        counter = _SET_NAMES.setdefault(on.label, itertools.count())
        return f"{kind}.noname.{next(counter)}"


def refusing(name: str, on: CollectiveEngine | None = None) -> AbstractContextManager[None]:
    """Run a call's checks: where they fail here, the call `name` fails on every rank of `on` (the process
    set's engine; None: the job's) too (then re-raise)."""
    return collective_refusing(name, _running_engine if on is None else lambda: on)


def _running_engine() -> CollectiveEngine | None:
    return STATE.node.collectives if STATE.node is not None else None


# ---------------------------------------------------------------------------- handles
class Pending(Protocol):
    """What a handle stands for: one engine operation, or several (AllOf)."""

    def done(self) -> bool: ...

    def wait(self) -> None: ...


class AllOf:
    """Several operations as one handle (a grouped call made of one operation per tensor)."""

    def __init__(self, handles: list[Pending]) -> None:
        self._handles = handles

    def done(self) -> bool:
        return all(h.done() for h in self._handles)

    def wait(self) -> None:
        for handle in self._handles:
            handle.wait()


_handles: dict[int, tuple[Pending, Callable[[], Any]]] = {}
#: numbers for unnamed calls on each process set, by the set engine's label
_SET_NAMES: dict[str, Iterator[int]] = {}
_handle_ids = itertools.count(1)
_handles_lock = threading.Lock()


def register(handle: Pending, finish: Callable[[], Any]) -> int:
    """An int handle for `poll` and `synchronize`; `finish()` makes the call's output once it is done."""
    with _handles_lock:
        number = next(_handle_ids)
        _handles[number] = (handle, finish)
    return number


def unregister(number: int) -> tuple[Pending, Callable[[], Any]]:
    """Take a handle out of the table (to put it under another, e.g. several under one)."""
    with _handles_lock:
        return _handles.pop(number)


def rewrap(number: int, result: Callable[[Any], Any]) -> None:
    """Make `synchronize(number)` return `result(what it returned)`."""
    with _handles_lock:
        handle, finish = _handles[number]
        _handles[number] = (handle, lambda: result(finish()))


def poll(handle: int) -> bool:
    """True when the operation of `handle` has finished (synchronize then returns at once)."""
    with _handles_lock:
        entry = _handles.get(handle)
    if entry is None:
        raise InvalidCallError(f"Handle {handle} was not created or has been cleared.")
    return entry[0].done()


def synchronize(handle: int) -> Any:
    """Wait for the operation of `handle` and return its output (None for an unknown handle, as Horovod)."""
    with _handles_lock:
        entry = _handles.pop(handle, None)
    if entry is None:
        return None
    try:
        entry[0].wait()
        return entry[1]()
    except Exception as exc:  # the call reached every rank: no refusal of it now
        mark_handled(exc)
        raise
