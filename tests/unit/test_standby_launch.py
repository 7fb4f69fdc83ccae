"""The launcher's standby schedulers (launch/standby.py): how many, where, and which ending the job survives."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sluice.launch.cluster import plan_cluster
from sluice.launch.config import load_config
from sluice.launch.hosts import Host
from sluice.launch.reach import Reach
from sluice.launch.standby import Schedulers, standby_count, standby_hosts


def _plan(hosts: list[Host], sets: list[str]) -> tuple[Any, Any]:
    config = load_config(None, {}, ["transport.host=192.0.2.1", *sets])
    return config, plan_cluster(hosts, "-H", None, 1, 0, None, Reach(), config)


def test_standbys_go_one_a_host_on_the_hosts_beyond_the_launchers_then_round_again() -> None:
    three = [Host("127.0.0.1", 1), Host("192.0.2.10", 1), Host("192.0.2.11", 1)]
    config, plan = _plan(three, [])
    assert standby_count(config, plan) == 1  # -1: one, as the job spans hosts
    assert standby_count(_plan(three, ["scheduler.standby=3"])[0], plan) == 3
    assert standby_count(_plan([Host("127.0.0.1", 2)], [])[0], None) == 0
    assert standby_hosts(plan, 3) == ["192.0.2.10", "192.0.2.11", "192.0.2.10"]
    assert standby_hosts(plan, 2, lost={"192.0.2.10"}) == ["192.0.2.11", "192.0.2.11"]
    assert standby_hosts(None, 2) == [None, None]  # one machine: beside the scheduler


@dataclass
class _Done:
    finished: bool = False

    def done(self) -> bool:
        return self.finished


@dataclass
class _Child:
    name: str
    done: _Done
    returncode: int | None = None


def _child(name: str, ended: int | None = None) -> Any:
    return _Child(name, _Done(ended is not None), ended)


def test_the_job_survives_a_scheduler_while_another_runs_and_says_who_carries_it() -> None:
    primary, first, second = _child("scheduler (pid 1)"), _child("standby scheduler (pid 2)"), \
        _child("standby scheduler 2 (pid 3)")
    schedulers = Schedulers(primary, [first, second])  # type: ignore[list-item]
    primary.done.finished, primary.returncode = True, -9
    assert schedulers.survive(primary, -9) == ("scheduler (pid 1) was killed by SIGKILL; the nodes rejoin the standby "
                                               "scheduler (pid 2) once they find the scheduler silent "
                                               "(scheduler.heartbeat_timeout)")
    first.done.finished, first.returncode = True, -9
    assert schedulers.survive(first, -9) == ("standby scheduler (pid 2) was killed by SIGKILL; the job goes on with "
                                             "the standby scheduler 2 (pid 3)")
    assert schedulers.idle() == []  # no scheduler ended the job yet
    second.done.finished, second.returncode = True, 1
    assert schedulers.survive(second, 1) is None  # none left: the job fails
    assert schedulers.survived == [primary, first]


def test_standbys_that_never_took_over_are_idle_once_a_scheduler_ended_the_job() -> None:
    primary, first, second = _child("scheduler (pid 1)"), _child("standby scheduler (pid 2)"), \
        _child("standby scheduler 2 (pid 3)")
    schedulers = Schedulers(primary, [first, second])  # type: ignore[list-item]
    assert schedulers.idle() == []
    primary.done.finished, primary.returncode = True, 0
    assert schedulers.idle() == [first, second]
    one = Schedulers(_child("scheduler (pid 1)"), [_child("standby scheduler (pid 2)")])  # type: ignore[list-item]
    assert one.survive(one.standbys[0], 1) == ("standby scheduler (pid 2) exited with code 1; the job goes on without "
                                               "a standby scheduler")
