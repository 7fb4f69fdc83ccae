"""The culprit line and the launcher's rule for which process a failure report names first."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from sluice.launch.blame import Watched, judge
from sluice.scheduler.culprit import Culprit, parse


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("SLUICE_CULPRIT server 0 pid 12: sent no heartbeat", Culprit("server", 0, 12, "sent no heartbeat")),
        ("SLUICE_CULPRIT scheduler 0: silent: for 3 s", Culprit("scheduler", 0, None, "silent: for 3 s")),
        ("SLUICE_CULPRIT launcher 0: no such role", None),
        ("SLUICE_CULPRIT worker x: no rank", None),
        ("[worker 1] SLUICE_CULPRIT worker 1: not at the start of the line", None),
        ("INFO sluice.server: anything else", None),
    ],
)
def test_parse(line: str, expected: Culprit | None) -> None:
    assert parse(line) == expected


def test_line_round_trips_on_one_line() -> None:
    named = Culprit("worker", 3, None, "left\nthe   job")
    assert named.line() == "SLUICE_CULPRIT worker 3: left the job"
    assert parse(named.line()) == Culprit("worker", 3, None, "left the job")


@dataclass
class Child:
    role: str
    rank: int
    pid: int
    returncode: int | None
    ended_at: float | None = None
    culprit: tuple[float, Culprit] | None = None

    @property
    def label(self) -> str:
        return self.role if self.role == "scheduler" else f"{self.role} {self.rank}"

    @property
    def name(self) -> str:
        return f"{self.label} (pid {self.pid})"


def _context(child: Watched) -> str:
    return " while workers were still running" if child.role != "worker" else ""


def test_a_signal_death_comes_first_earliest_first() -> None:
    sched = Child("scheduler", 0, 10, 1, ended_at=5.0, culprit=(4.0, Culprit("worker", 0, None, "left")))
    server = Child("server", 1, 11, -9, ended_at=3.0)
    worker = Child("worker", 0, 12, -15, ended_at=2.0)
    verdict = judge(sched, [sched, server, worker], _context)
    assert verdict.headline == "worker 0 (pid 12) was killed by SIGTERM"
    assert verdict.cause is worker


def test_the_first_culprit_reported_comes_next() -> None:
    sched = Child("scheduler", 0, 10, 1, ended_at=5.0, culprit=(2.0, Culprit("server", 1, 11, "no heartbeat")))
    server = Child("server", 1, 11, 0, ended_at=1.0)
    worker = Child("worker", 0, 12, 1, ended_at=4.0, culprit=(3.0, Culprit("scheduler", 0, None, "silent")))
    verdict = judge(worker, [sched, server, worker], _context)
    assert verdict.headline == "server 1 (pid 11) exited with code 0; scheduler (pid 10) reported: no heartbeat"
    assert verdict.cause is server


def test_a_culprit_is_found_by_role_and_rank_when_its_pid_is_not_a_child() -> None:
    wrapper = Child("worker", 1, 20, 0, ended_at=1.0)
    server = Child("server", 0, 21, None, culprit=(2.0, Culprit("worker", 1, 99, "left the job")))
    failed = Child("worker", 0, 22, 1, ended_at=3.0)
    verdict = judge(failed, [wrapper, server, failed], _context)
    assert verdict.headline == "worker 1 (pid 20) exited with code 0; server 0 (pid 21) reported: left the job"


def test_an_unknown_culprit_is_named_as_reported() -> None:
    failed = Child("worker", 0, 22, 1, ended_at=3.0, culprit=(2.0, Culprit("server", 7, None, "gone")))
    verdict = judge(failed, [failed], _context)
    assert verdict.headline == "server 7; worker 0 (pid 22) reported: gone"
    assert verdict.cause is None


def test_otherwise_the_first_failed_child() -> None:
    server = Child("server", 0, 21, 1, ended_at=3.0)
    verdict = judge(server, [server], _context)
    assert verdict.headline == "server 0 (pid 21) exited with code 1 while workers were still running"
