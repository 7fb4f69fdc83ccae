"""What tests of benchmarks and of the testbed share: running a script bounded in time, skipping without root."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from testbed.netbed import NetbedUnavailable, check_available

ROOT = Path(__file__).resolve().parents[1]

try:
    check_available()
    TESTBED_UNAVAILABLE = ""
except NetbedUnavailable as exc:
    TESTBED_UNAVAILABLE = str(exc)

#: for tests that build a shaped-network testbed: skipped, with the reason, where that needs what is missing
requires_testbed = pytest.mark.skipif(
    bool(TESTBED_UNAVAILABLE), reason=f"no network namespaces here: {TESTBED_UNAVAILABLE}"
)


def run_script(argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """`python ARGV` from the repository root in its own process group: a hang fails the test and
    kills everything the script started; nothing it forked may outlive it in any case."""
    process = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        stdout, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, _ = process.communicate()
        pytest.fail(f"{argv[0]} ran past {timeout:.0f} s:\n{stdout[-3000:]}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    return subprocess.CompletedProcess(argv, process.returncode, stdout, None)


def check_records(path: Path, count: int | None = None) -> list[dict[str, Any]]:
    """The benchmark records at `path` (`count` of them, when given), each consistent as the guide's format says."""
    records = json.loads(path.read_text())
    assert isinstance(records, list) and records and (count is None or len(records) == count), records
    for rec in records:
        assert isinstance(rec["case"], str) and rec["case"], rec
        assert isinstance(rec["peer_name"], str) and rec["peer_name"], rec
        assert isinstance(rec["unit"], str) and rec["unit"], rec
        assert rec["ours"] > 0 and rec["peer"] > 0, rec
        assert rec["ratio"] == pytest.approx(rec["ours"] / rec["peer"], rel=1e-12), rec
        assert rec["better"] in ("higher", "lower") and rec["speedup"] > 0, rec
    return records


def run_quick(script: str, tmp_path: Path) -> None:
    """`python SCRIPT --quick --json ...` ends well, writes consistent records, and its printed table names each."""
    out = tmp_path / "records.json"
    result = run_script([*script.split(), "--quick", "--json", str(out)], timeout=110)
    assert result.returncode == 0, result.stdout[-3000:]
    for rec in check_records(out):
        assert rec["case"] in result.stdout
