"""`sluice node`'s standby schedulers: which pod stands by where, and the order the nodes rejoin them (pure)."""

from __future__ import annotations

import argparse

import pytest

from sluice.launch.node import NodeError, _add_arguments, plan
from sluice.scheduler.bootstrap import NodeEnv, from_environ

JOB = ["-w", "2", "-s", "1", "--scheduler", "sluice-scheduler-0-0.sluice:29400", "--standby",
       "sluice-standby-0-0.sluice:29400", "--standby", "sluice-standby-0-1.sluice:29400", "--set",
       "transport.curve=false", "--", "python", "train.py"]


def _plan(*extra: str, environ: dict[str, str] | None = None) -> tuple[NodeEnv, tuple[str, ...]]:
    parser = argparse.ArgumentParser()
    _add_arguments(parser)
    start = plan(parser.parse_args([*extra, *JOB]), environ or {})
    return from_environ(start.env), start.notes


@pytest.mark.parametrize(("index", "failures", "role", "rank", "listens"), [
    (0, "0", "scheduler", 0, 0),  # the scheduler's first pod: the scheduler, on --scheduler's port
    (0, "1", "scheduler", 3, 29400),  # started again: a standby after the two, at the scheduler's address
    (4, "0", "scheduler", 1, 29400),  # the indexes after the workers: the standbys, each on its own --standby
    (5, "2", "scheduler", 2, 29400),  # a standby started again is a standby still
    (1, "3", "server", 0, 0),
])
def test_each_pod_is_what_its_index_and_failures_make_it(index: int, failures: str, role: str, rank: int,
                                                        listens: int) -> None:
    env, _ = _plan("--index", str(index), environ={"SLUICE_INDEX_FAILURES": failures})
    assert (env.role, env.rank, env.section("scheduler").get("standby_port", 0)) == (role, rank, listens)
    assert env.ring and env.standbys() == ["tcp://sluice-standby-0-0.sluice:29400",
                                           "tcp://sluice-standby-0-1.sluice:29400"]
    # the nodes and the standbys name the scheduler's address; the scheduler's first pod listens there itself
    assert env.scheduler == ("" if (role, rank) == ("scheduler", 0) else "tcp://sluice-scheduler-0-0.sluice:29400")


def test_the_scheduler_started_again_says_it_stands_by_and_without_standbys_it_refuses() -> None:
    _, notes = _plan("--index", "0", "--index-failures", "1")
    assert ("the scheduler's pod failed 1 time(s) before this one: the job goes on under a standby scheduler, so "
            "this pod stands by at sluice-scheduler-0-0.sluice:29400 in turn") in notes
    parser = argparse.ArgumentParser()
    _add_arguments(parser)
    alone = parser.parse_args(["--index", "0", *[a for a in JOB if "standby" not in a and a != "--standby"]])
    with pytest.raises(NodeError, match="no standby scheduler that took over: a new scheduler cannot rejoin"):
        plan(alone, {"SLUICE_INDEX_FAILURES": "2"})
    with pytest.raises(NodeError, match="SLUICE_INDEX_FAILURES='x' is not a count"):
        plan(alone, {"SLUICE_INDEX_FAILURES": "x"})
    with pytest.raises(NodeError, match="--index-failures -1: a count of failed pods is 0 or more"):
        _plan("--index", "0", "--index-failures", "-1")


def _env(standbys: int, ring: bool) -> NodeEnv:
    return NodeEnv("tcp://s:1", "worker", 0, 2, 1, {}, standby=",".join(f"tcp://b{k}:1" for k in range(standbys)),
                   ring=ring)


@pytest.mark.parametrize(("standbys", "ring", "rejoins", "unanswered", "expected"), [
    (2, False, 0, 0, "tcp://b0:1"), (2, False, 1, 1, "tcp://b1:1"),
    (2, False, 2, 0, None),  # the ssh launcher's standbys: each taken once, and then none
    (0, True, 0, 0, None),
    (2, True, 2, 0, "tcp://s:1"),  # round the ring: the scheduler's address, where its pod stands by again
    (2, True, 3, 0, "tcp://b0:1"), (2, True, 7, 2, "tcp://b1:1"),
    (2, True, 5, 3, None),  # every one of the three tried since one last took over: the job is lost
])
def test_the_nodes_rejoin_the_standbys_in_order_and_round_the_ring(standbys: int, ring: bool, rejoins: int,
                                                                   unanswered: int, expected: str | None) -> None:
    assert _env(standbys, ring).next_scheduler(rejoins, unanswered) == expected
