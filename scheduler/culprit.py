"""The `SLUICE_CULPRIT` line: a process that detects the first cause of a job's failure names it for the launcher."""

from __future__ import annotations

import contextlib
import re
import sys
from dataclasses import dataclass

PREFIX = "SLUICE_CULPRIT"
_LINE = re.compile(rf"^{PREFIX} (scheduler|server|worker) (\d+)(?: pid (\d+))?: (.*)$")


@dataclass(frozen=True)
class Culprit:
    role: str
    rank: int
    #: the culprit's pid where the reporter knows it (the scheduler does; a node does not know the scheduler's)
    pid: int | None
    reason: str

    def line(self) -> str:
        pid = f" pid {self.pid}" if self.pid is not None else ""
        # one line whatever the reason holds: the launcher reads its children's output line by line
        reason = " ".join(self.reason.split())
        return f"{PREFIX} {self.role} {self.rank}{pid}: {reason}"


def parse(text: str) -> Culprit | None:
    """The culprit a line of a child's output names; None for any other line."""
    if not text.startswith(PREFIX):
        return None
    match = _LINE.match(text)
    if match is None:
        return None
    role, rank, pid, reason = match.groups()
    return Culprit(role, int(rank), int(pid) if pid else None, reason)


def report(role: str, rank: int, reason: str, pid: int | None = None) -> None:
    """Print the culprit line on stderr, before the failure it explains spreads (the launcher takes the first)."""
    with contextlib.suppress(OSError, ValueError):  # no stderr left: the failure is reported by other means
        print(Culprit(role, rank, pid, reason).line(), file=sys.stderr, flush=True)
