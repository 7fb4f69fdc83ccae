"""Which process a failed job's report names first, and how a process's state is put in words.

The rule, in order: (a) a child that died of a signal the launcher did not send, earliest first
(nothing inside the job kills a process, so such a death comes from outside and starts the
failure); else (b) the first `SLUICE_CULPRIT` line a child printed (scheduler/culprit.py: the
process that detected the cause names it: a silent node, a worker that left early, a scheduler
that stopped answering); else (c) the first child that exited non-zero. Exits that follow from the
cause (the scheduler ending the job, workers whose rounds can never complete) are named after it.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from sluice.scheduler.culprit import Culprit


class Watched(Protocol):
    """What the rule needs to know of one child of the launcher."""

    role: str
    rank: int
    label: str
    #: the launcher's clock when it saw the child exit
    ended_at: float | None
    #: the first culprit line the child printed, with the launcher's clock when it read it
    culprit: tuple[float, Culprit] | None

    @property
    def name(self) -> str: ...

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...


@dataclass(frozen=True)
class Verdict:
    #: the first line of the report: the cause, in words
    headline: str
    #: the child the headline names, when it is one of the launcher's (its last lines are shown)
    cause: Watched | None


def exit_description(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with code {returncode}"


def state_description(child: Watched) -> str:
    """'exited with code N', 'was killed by SIG...', 'is stopped' (SIGSTOP, or a debugger) or 'is still running'."""
    if child.returncode is not None:
        return exit_description(child.returncode)
    try:
        stat = Path(f"/proc/{child.pid}/stat").read_text()
    except OSError:
        return "has exited"
    state = stat.rsplit(")", 1)[1].split()[0]
    if state in ("T", "t"):  # a stopped process is alive to the kernel yet silent to everyone else
        return "is stopped" + (" (traced)" if state == "t" else "")
    if state in ("Z", "X"):
        return "has exited"
    return "is still running"


def find(children: Sequence[Watched], named: Culprit) -> Watched | None:
    """The child a culprit line names: by pid where given, else (e.g. a worker command that wraps
    the real process) by role and rank."""
    if named.pid is not None:
        for child in children:
            if child.pid == named.pid:
                return child
    for child in children:
        if child.role == named.role and (child.role == "scheduler" or child.rank == named.rank):
            return child
    return None


def first_report(children: Sequence[Watched]) -> tuple[Watched, Culprit] | None:
    """The child that printed the first culprit line the launcher read, and what it said."""
    reports = [(c.culprit[0], i, c) for i, c in enumerate(children) if c.culprit is not None]
    if not reports:
        return None
    reporter = min(reports)[2]
    assert reporter.culprit is not None
    return reporter, reporter.culprit[1]


def judge(first: Watched, children: Sequence[Watched], context: Callable[[Watched], str]) -> Verdict:
    """The headline for a job whose first failed child is `first`; `context` adds a few words to an
    exit (e.g. ' while workers were still running')."""
    killed = [c for c in children if c.ended_at is not None and c.returncode is not None and c.returncode < 0]
    if killed:
        cause = min(killed, key=lambda c: c.ended_at or 0.0)
        assert cause.returncode is not None
        return Verdict(f"{cause.name} {exit_description(cause.returncode)}{context(cause)}", cause)
    report = first_report(children)
    if report is not None:
        reporter, named = report
        found = find(children, named)
        if found is not None:
            who = f"{found.name} {state_description(found)}"
        else:
            who = f"{named.role} {named.rank}" + (f" (pid {named.pid})" if named.pid is not None else "")
        return Verdict(f"{who}; {reporter.name} reported: {named.reason}", found)
    assert first.returncode is not None
    return Verdict(f"{first.name} {exit_description(first.returncode)}{context(first)}", first)
