"""Why a worker leaves: the uncaught exception ending its process, said in its goodbye and passed on to the others.

A worker whose script raises ends its process; its goodbye (BYE) used to look like any other, so the scheduler
logged "job done" and the other workers' collectives failed saying the worker "has left the job" with a hint
about uneven batches. sys.excepthook sees the exception before the interpreter runs its exit handlers (where
the worker closes and says goodbye), so `note_uncaught` keeps it and the goodbye carries it (`error`, at most
MAX_ERROR characters of one line); the scheduler checks it (`parse_error`) and hands it on with the BYE it
sends the others, whose errors then name it.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from types import TracebackType
from typing import Any

from sluice.transport.wire import WireError

MAX_ERROR = 240
_UNCAUGHT: list[str] = []  # the exception sys.excepthook saw, at most one
_HOOKED: list[bool] = []


def one_line(kind: str, text: str) -> str:
    """`kind: text` on one line, of at most MAX_ERROR printable characters."""
    line = f"{kind}: {text}" if text else kind
    line = " / ".join(part.strip() for part in line.splitlines() if part.strip())
    return _printable(line)[:MAX_ERROR]


def note_uncaught() -> None:
    """From now on, keep the exception that reaches sys.excepthook (once a process; the hook before is called
    after, so its output is unchanged)."""
    if _HOOKED:
        return
    _HOOKED.append(True)
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        _UNCAUGHT[:] = [one_line(kind.__name__, str(value))]
        previous(kind, value, tb)

    sys.excepthook = hook


def uncaught() -> str:
    """The exception ending this process ("" if none reached sys.excepthook)."""
    return _UNCAUGHT[0] if _UNCAUGHT else ""


def parse_error(meta: Mapping[str, Any] | None) -> str:
    """A BYE's `error` ("" when it has none); WireError unless it is a string of at most MAX_ERROR characters."""
    error = (meta or {}).get("error", "")
    if type(error) is not str or len(error) > MAX_ERROR:
        raise WireError(f"a goodbye's error must be a string of at most {MAX_ERROR} characters")
    return _printable(error)


def _printable(text: str) -> str:
    """`text` with each character a terminal would act on (control, escape) shown as "?"."""
    return "".join(c if c.isprintable() else "?" for c in text)


def left(who: str, error: str) -> str:
    """`who` has left the job, with its error when it said one."""
    return f"{who} has left the job with an error ({error})" if error else f"{who} has left the job"
