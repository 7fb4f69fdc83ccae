"""A call one rank cannot run fails on every rank: the framework shims' guard around a collective call's checks.

Every call of a framework's Horovod API draws its name first (unnamed calls are numbered alike on
every rank, whatever fails), then runs its checks inside `refusing(name, engine)`: where they fail
here, the engine submits a refused request under that name (engine.refuse), so the others' same call
fails too, naming this rank and why, and the exception is raised here. Exceptions that mean the call
reached every rank already (a CollectiveError), or that the job failed (any other SluiceError), are
passed on untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING

from sluice.errors import CollectiveError, InvalidCallError, SluiceError

if TYPE_CHECKING:
    from sluice.worker.collective.engine import CollectiveEngine

#: set on an exception handled here (refused, or raised after the call reached every rank)
_HANDLED = "_sluice_refusal_handled"

EngineOrNone = Callable[[], "CollectiveEngine | None"]


@contextmanager
def refusing(name: str, engine: EngineOrNone) -> Iterator[None]:
    """Run a call's checks: where they fail here, the call `name` fails on every rank (then re-raise)."""
    try:
        yield
    except Exception as exc:
        refuse(name, exc, engine)
        raise


def refuse(name: str, exc: Exception, engine: EngineOrNone) -> None:
    """This rank cannot run the call `name` because of `exc`: fail it on every rank (once)."""
    if getattr(exc, _HANDLED, False) or isinstance(exc, CollectiveError) or (
            isinstance(exc, SluiceError) and not isinstance(exc, InvalidCallError)):
        return  # the call reached every rank already, or the job failed: nothing to keep in step
    mark_handled(exc)
    running = engine()
    if running is not None:
        running.refuse(name, f"{type(exc).__name__}: {exc}")


def mark_handled(exc: BaseException) -> None:
    """`exc` needs no refusal (raised after the call reached every rank, or refused already)."""
    with suppress(AttributeError):  # an exception type without a __dict__: it is raised all the same
        setattr(exc, _HANDLED, True)
