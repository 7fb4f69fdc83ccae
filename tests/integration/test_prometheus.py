"""Prometheus endpoints of a running job: `sluice launch --set metrics.port=-1` (2 workers, 1 server) is scraped
twice, between two phases of training, at every process's endpoint, and the counters agree with the run."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.integration import preloads

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "tests/integration/scripts/metrics_train.py"
STEPS = 6
_URL = re.compile(r"^\[(\w+)(?: (\d+))?\] .*(scheduler|server|worker|aggregator) (\d+) serves Prometheus metrics at "
                  r"(http://\S+)$")

parser = pytest.importorskip("prometheus_client.parser", reason="prometheus-client is not installed: "
                             "pip install 'sluice-ps[prometheus]'")
pytestmark = pytest.mark.slow

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in parser.text_string_to_metric_families(text) for s in family.samples}


def _total(samples: Samples, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))


class _Job:
    """The launcher's output, read on a thread: endpoints and phase lines as they come."""

    def __init__(self, argv: list[str]) -> None:
        self.process = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.urls: dict[tuple[str, int], str] = {}
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in iter(self.process.stdout.readline, ""):
            self.lines.append(line)
            if match := _URL.match(line.rstrip()):
                self.urls[(match.group(3), int(match.group(4)))] = match.group(5)

    def wait(self, what: str, count: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while sum(what in line for line in self.lines) < count:
            if time.monotonic() > deadline or self.process.poll() is not None:
                self.process.kill()
                pytest.fail(f"no {count} lines with {what!r} within {timeout:g} s:\n{''.join(self.lines)[-4000:]}")
            time.sleep(0.05)


@pytest.mark.timeout(120)
def test_every_process_serves_metrics_that_grow_with_the_run(tmp_path: Path) -> None:
    go, end = tmp_path / "go", tmp_path / "end"
    job = _Job([sys.executable, "-m", "sluice.launch.cli", "launch", *preloads.TORCH, "-w", "2", "-s", "1",
                "--set", "metrics.port=-1", "--set", "collective.mode=ps", "--",
                sys.executable, SCRIPT, "--steps", str(STEPS), "--go", str(go), "--end", str(end)])
    try:
        job.wait("PHASE 1 DONE", 2)
        processes = [("scheduler", 0), ("server", 0), ("worker", 0), ("worker", 1)]
        assert sorted(job.urls) == sorted(processes), job.urls
        first = {p: _scrape(job.urls[p]) for p in processes}
        go.touch()
        job.wait("PHASE 2 DONE", 2)
        second = {p: _scrape(job.urls[p]) for p in processes}
        end.touch()
        assert job.process.wait(60) == 0, "".join(job.lines)[-4000:]
    finally:
        end.touch()
        if job.process.poll() is None:
            job.process.kill()
    for (role, rank), samples in second.items():  # every sample is labelled with its process
        own = {(n, ls) for (n, ls) in samples if dict(ls).get("role") == role and dict(ls).get("rank") == str(rank)}
        assert {n for n, _ in own} >= {"sluice_bytes_sent_total", "sluice_messages_sent_total",
                                       "sluice_rejected_messages_total"}, (role, sorted(samples)[:20])
        assert _total(samples, "sluice_rejected_messages_total") == 0
        # the delay histogram counts each message handed to a socket, as the per-channel counter does
        assert _total(samples, "sluice_queue_delay_seconds_count") == _total(samples, "sluice_messages_sent_total")
        assert _total(samples, "sluice_queue_delay_seconds_bucket", le="+Inf") == _total(
            samples, "sluice_queue_delay_seconds_count")
        sent_before = _total(first[(role, rank)], "sluice_messages_sent_total")
        assert _total(samples, "sluice_messages_sent_total") >= sent_before > 0
    for rank in (0, 1):
        before, after = first[("worker", rank)], second[("worker", rank)]
        assert _total(before, "sluice_messages_sent_total") < _total(after, "sluice_messages_sent_total")
        assert 0 < _total(before, "sluice_bytes_sent_total") < _total(after, "sluice_bytes_sent_total")
        assert 0 < _total(before, "sluice_rounds_total") < _total(after, "sluice_rounds_total")
        # one step time per step after the first
        assert _total(before, "sluice_step_seconds_count") == STEPS - 1
        assert _total(after, "sluice_step_seconds_count") == 2 * STEPS - 1
        assert _total(after, "sluice_step_seconds_sum") > 0
    server_before, server_after = first[("server", 0)], second[("server", 0)]
    assert 0 < _total(server_before, "sluice_rounds_total") < _total(server_after, "sluice_rounds_total")
    received = "sluice_bytes_received_total"
    assert 0 < _total(server_before, received) < _total(server_after, received)
    assert _total(second[("scheduler", 0)], "sluice_plan_changes_total", kind="routes") == 0
    assert any(n == "sluice_process_cpu_seconds_total" for n, _ in second[("server", 0)])


