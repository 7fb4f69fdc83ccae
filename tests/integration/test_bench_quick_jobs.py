"""The --quick settings of the benchmarks that run whole training jobs, end to end, writing consistent JSON records
(apart from test_bench_quick.py, so that the two test workers share them)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from testbed.bench_runs import requires_testbed, run_quick


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("script", [
    # the cost cases share one path (test_recovery.py covers each optimizer)
    "bench/recovery.py --cases digits-server-adam resume-after-kill",
    # ps.replicas 1 against 0, each process on its own testbed host
    pytest.param("bench/recovery.py --replicas --testbed --cases digits-aggregated", marks=requires_testbed),
    "bench/pipeline.py", "bench/replace_worker.py",
    pytest.param("bench/train_throughput.py --framework keras --workers 2 --servers 1",
                 marks=pytest.mark.skipif(importlib.util.find_spec("keras") is None,
                                          reason="needs the tensorflow extra"))])
def test_quick_run_of_a_training_benchmark_writes_records(script: str, tmp_path: Path) -> None:
    run_quick(script, tmp_path)
