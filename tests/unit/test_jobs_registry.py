"""The host's job registry: entries round-trip, hostile or stale ones are skipped, the directory must be private."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from sluice.scheduler import jobs_registry
from sluice.scheduler.jobs_registry import MAX_ENTRY_BYTES, JobState, describe, parse_state, publish, read_all, withdraw
from sluice.scheduler.rendezvous import parse_job_report
from sluice.transport.wire import WireError

STATE = JobState("tcp://10.0.0.1:5555", os.getpid(), 1000.0, 4, 2, True, 1, 12.5, 40, 1010.0)
NOW = 1020.0  # 10 s after the entry was written


def test_a_published_job_is_read_back_and_withdrawn(tmp_path: Path) -> None:
    publish(STATE, tmp_path)
    publish(replace(STATE, rounds=41), tmp_path)  # replaced, not added
    assert read_all(tmp_path, now=NOW) == ([replace(STATE, rounds=41)], 0)
    assert "tcp://10.0.0.1:5555" in describe([STATE], now=1100.0) and " 100 " in describe([STATE], now=1100.0)
    withdraw(STATE.job, tmp_path)
    assert read_all(tmp_path, now=NOW) == ([], 0)
    assert read_all(tmp_path / "missing", now=NOW) == ([], 0)


@pytest.mark.parametrize(
    "content",
    [
        b"not json",
        b"[]",
        json.dumps({**asdict(STATE), "extra": 1}).encode(),
        json.dumps({k: v for k, v in asdict(STATE).items() if k != "pid"}).encode(),
        json.dumps({**asdict(STATE), "pid": "1"}).encode(),
        json.dumps({**asdict(STATE), "workers": -1}).encode(),
        json.dumps({**asdict(STATE), "priorities": 1}).encode(),
        json.dumps({**asdict(STATE), "job": ""}).encode(),
        json.dumps({**asdict(STATE), "attained_mib": float("inf")}).encode(),
        json.dumps({**asdict(STATE), "job": "x" * MAX_ENTRY_BYTES}).encode(),  # too big to read
    ],
)
def test_malformed_entries_are_skipped_and_counted(tmp_path: Path, content: bytes) -> None:
    publish(STATE, tmp_path)
    (tmp_path / "job-hostile.json").write_bytes(content)
    assert read_all(tmp_path, now=NOW) == ([STATE], 1)


def test_an_entry_whose_scheduler_is_gone_is_removed(tmp_path: Path) -> None:
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    publish(replace(STATE, job="tcp://10.0.0.2:1", pid=int(dead.stdout)), tmp_path)
    publish(STATE, tmp_path)
    assert read_all(tmp_path, now=NOW) == ([STATE], 0)
    assert len(list(tmp_path.glob("job-*.json"))) == 1


def test_an_entry_not_refreshed_for_a_minute_is_stale_and_removed(tmp_path: Path) -> None:
    publish(STATE, tmp_path)
    assert read_all(tmp_path, now=STATE.updated + jobs_registry.STALE_S + 1) == ([], 0)
    assert not list(tmp_path.glob("job-*.json"))


def test_links_and_fifos_are_skipped_without_blocking(tmp_path: Path) -> None:
    publish(STATE, tmp_path)
    os.mkfifo(tmp_path / "job-fifo.json")  # opening it for reading would wait for a writer
    (tmp_path / "job-link.json").symlink_to(next(tmp_path.glob("job-tcp*.json")))
    assert read_all(tmp_path, now=NOW) == ([STATE], 2)


def test_a_directory_others_can_write_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(PermissionError, match="not private"):
        publish(STATE, shared)
    with pytest.raises(PermissionError, match="not private"):  # nor read: anyone could have written there
        read_all(shared, now=NOW)


def test_parse_state_takes_only_the_schema() -> None:
    assert parse_state(asdict(STATE)) == STATE
    assert parse_state({**asdict(STATE), "started": 5}) == replace(STATE, started=5.0)
    assert parse_state(None) is None


@pytest.mark.parametrize("raw", [None, [1, 2], [1, 2, 3, 4], [1, -2, 3], [1, 2.0, 3], [True, 2, 3], [1, 2, 1 << 60]])
def test_malformed_job_reports_are_refused(raw: object) -> None:
    with pytest.raises(WireError, match="job report"):
        parse_job_report(raw)
    assert parse_job_report([2, 1 << 30, 7]) == (2, 1 << 30, 7)
