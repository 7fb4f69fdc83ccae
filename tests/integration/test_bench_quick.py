"""Each benchmark's --quick setting runs end to end and writes consistent JSON records."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, out: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run a benchmark in its own process group, so that a hang kills every process it forked."""
    command = [sys.executable, script, "--quick", "--json", str(out)]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        stdout, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, _ = process.communicate()
        pytest.fail(f"{script} --quick ran past {timeout:.0f} s:\n{stdout[-3000:]}")
    finally:
        with contextlib.suppress(ProcessLookupError):  # nothing it forked may outlive it
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    return subprocess.CompletedProcess(command, process.returncode, stdout, None)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("script", ["bench/push_pull.py", "bench/train_throughput.py", "bench/transport_rate.py"])
def test_quick_run_writes_records(script: str, tmp_path: Path) -> None:
    out = tmp_path / "records.json"
    result = _run(script, out, timeout=110)
    assert result.returncode == 0, result.stdout[-3000:]
    records = json.loads(out.read_text())
    assert isinstance(records, list) and records
    for rec in records:
        assert isinstance(rec["case"], str) and rec["case"]
        assert isinstance(rec["peer_name"], str) and rec["peer_name"]
        assert isinstance(rec["unit"], str) and rec["unit"]
        assert rec["ours"] > 0 and rec["peer"] > 0, rec
        assert rec["ratio"] == pytest.approx(rec["ours"] / rec["peer"], rel=1e-12), rec
        assert rec["case"] in result.stdout  # the printed table names every case
