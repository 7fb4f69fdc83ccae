"""Each benchmark's --quick setting runs end to end and writes consistent JSON records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench_runs import run_script


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("script", ["bench/push_pull.py", "bench/train_throughput.py", "bench/transport_rate.py"])
def test_quick_run_writes_records(script: str, tmp_path: Path) -> None:
    out = tmp_path / "records.json"
    result = run_script([script, "--quick", "--json", str(out)], timeout=110)
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
