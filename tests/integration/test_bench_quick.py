"""Each benchmark's --quick setting runs end to end and writes consistent JSON records (the benchmarks that run
whole training jobs: test_bench_quick_jobs.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from testbed.bench_runs import check_records, run_quick, run_script


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("script", ["bench/push_pull.py", "bench/train_throughput.py", "bench/transport_rate.py",
                                    "bench/allreduce.py", "bench/coordinator.py", "bench/fusion.py",
                                    "bench/plan_quality.py", "bench/timeline_cost.py", "bench/zvc.py",
                                    "bench/offload.py", "bench/mirror_cost.py", "bench/local_group.py",
                                    "bench/chunk_cpu.py", "bench/cold_path.py"])
def test_quick_run_writes_records(script: str, tmp_path: Path) -> None:
    run_quick(script, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_curve_cost_quick_measures_every_loopback_case(tmp_path: Path) -> None:
    out = tmp_path / "curve_cost.json"
    result = run_script(["bench/curve_cost.py", "--quick", "--cases", "loopback", "--json", str(out)], timeout=140)
    assert result.returncode == 0, result.stdout[-3000:]
    records = json.loads(out.read_text())
    assert [rec["case"] for rec in records] == ["pushpull-shm", "pushpull-tcp", "train", "zmq-pair",
                                                "zmq-pair-sealed"], records
    for rec in records:
        assert rec["peer_name"] == "sluice, transport.curve = false", rec
        assert min(rec["ours"], rec["peer"], rec["ours_min"], rec["peer_min"]) > 0, rec
        assert rec["samples"] == 2, rec  # one pair of jobs, two timed repetitions in each
        assert rec["ratio"] == pytest.approx(rec["ours"] / rec["peer"], rel=1e-12), rec
        assert rec["better"] in ("higher", "lower") and rec["speedup"] > 0, rec
        faster = rec["ratio"] if rec["better"] == "higher" else 1 / rec["ratio"]
        assert rec["speedup"] == pytest.approx(faster, rel=1e-12), rec
        assert rec["cost"] == pytest.approx((1 / rec["speedup"] - 1) * 100, rel=1e-9, abs=1e-9), rec
        if rec["case"].startswith("zmq-pair"):  # ZeroMQ alone: a cipher's price, no target; each costs CPU
            assert rec["target_cost"] is None and rec["met"] is None and rec["ours"] > rec["peer"], rec
        else:
            assert rec["target_cost"] == 25.0 and rec["met"] == (rec["cost"] <= 25.0), rec
        assert rec["case"] in result.stdout
    curve, sealed = records[3], records[4]
    assert curve["ours"] > 2 * curve["peer"], curve  # CURVE more than doubles the pair's CPU a GB
    # AES-GCM in the threads costs about two thirds of CURVE in full runs (1.49-1.56 against 2.21-2.38 CPU s/GB);
    # the quick run's 32 MiB under the suite's load is too short to order them (once 1.37 against 1.27): this
    # catches only a sealing gone far costlier than CURVE
    assert sealed["ours"] < 1.5 * curve["ours"], (sealed, curve)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_flood_quick_floods_and_the_servers_count_it(tmp_path: Path) -> None:
    out = tmp_path / "flood.json"
    result = run_script(["bench/flood.py", "--quick", "--json", str(out)], timeout=140)
    assert result.returncode == 0, result.stdout[-3000:]
    records = {rec["mode"]: rec for rec in json.loads(out.read_text())}
    assert set(records) == {"strangers", "member", "curve-off", "curve-off-banned", "busy-loop"}, records
    for rec in records.values():
        assert rec["peer"] > 0 and rec["clean_failed_jobs"] == 0, rec  # the clean jobs trained
        assert rec["ratio"] == pytest.approx(rec["ours"] / rec["peer"], rel=1e-12) == rec["speedup"], rec
        assert rec["case"] in result.stdout
    for mode in ("strangers", "member", "curve-off-banned", "busy-loop"):  # training went on under these
        assert records[mode]["ours"] > 0 and not records[mode]["failed_jobs"], records[mode]
    for mode in ("member", "curve-off", "curve-off-banned"):  # garbage reached the servers, which counted it
        rec = records[mode]
        assert rec["sent"] > 0 and rec["send_rate"] > 0 and rec["servers_rejected"] > 0, rec
        assert all(len(counts) == 2 for counts in rec["rejected_by_job"]), rec  # both servers logged their totals
    # strangers never got a message in: the servers refused their connections, and counted them
    assert records["strangers"]["servers_refused_connections"] > 0, records["strangers"]
    assert records["member"]["bans"] == 0  # a member is never banned, only counted
    assert records["curve-off-banned"]["bans"] > 0  # strangers that keep their identity are
    assert records["busy-loop"]["sent"] == 0
    # curve-off (a new identity every 90 messages) may crawl past the deadline or fail: findings the record
    # reports (the rate so far, or 0 samples/s and the error), not failures of the benchmark
    assert len(records["curve-off"]["errors"]) == records["curve-off"]["failed_jobs"]
    # however many strangers come and go, no server forgets how to reach a worker
    assert all(rec["worker_messages_without_route"] == 0 for rec in records.values()), records


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_device_copies_quick_measures_hidden_copies_and_step_time(tmp_path: Path) -> None:
    """bench/device_copies.py on the CPU twin of the device path: a hidden fraction and both step times, no copy
    record (a CPU has no PCIe bound)."""
    out = tmp_path / "device_copies.json"
    result = run_script(["bench/device_copies.py", "--quick", "--device", "cpu", "--json", str(out)], timeout=80)
    assert result.returncode == 0, result.stdout[-3000:]
    records = {rec["case"].split("-")[0]: rec for rec in json.loads(out.read_text())}
    assert set(records) == {"hidden", "step"}, records
    assert "memcpy: no record (a CPU has no PCIe bound)" in result.stdout
    for rec in records.values():
        assert rec["case"] in result.stdout and rec["peer_name"] and rec["unit"], rec
        assert rec["device"] == "cpu" and rec["device_name"].startswith("CPU") and rec["repeats"] == 1, rec
        assert rec["peer"] > 0 and rec["ratio"] == pytest.approx(rec["ours"] / rec["peer"], rel=1e-12), rec
        assert rec["speedup"] == pytest.approx(rec["ratio"] if rec["better"] == "higher" else 1 / rec["ratio"]), rec
    hidden, step = records["hidden"], records["step"]
    assert isinstance(hidden["ours"], float) and 0.0 <= hidden["ours"] <= 1.0, hidden
    assert 0.0 <= hidden["lowest_step"] <= 1.0 and 0.0 <= hidden["pooled"] <= 1.0, hidden
    assert hidden["peer"] == 1.0 and hidden["better"] == "higher" and hidden["met"] == (hidden["ours"] >= 0.8)
    assert hidden["spans"] >= 2 * hidden["steps"], hidden  # each worker copied at least one group a timed step
    assert step["better"] == "lower" and step["ours"] > 0 and step["unit"] == "ms", step


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_allreduce_latency_quick_splits_sluices_time_into_negotiation_and_data(tmp_path: Path) -> None:
    out = tmp_path / "allreduce_latency.json"
    result = run_script(["bench/allreduce_latency.py", "--quick", "--json", str(out)], timeout=110)
    assert result.returncode == 0, result.stdout[-3000:]
    [rec] = check_records(out, 1)
    assert rec["case"] == "38282f-p2-work0ms" and rec["case"] in result.stdout, rec
    assert rec["processes"] == 2 and rec["unit"] == "ms" and rec["better"] == "lower", rec
    assert rec["speedup"] == pytest.approx(rec["peer"] / rec["ours"], rel=1e-12), rec
    # every part was measured: a decision comes after the submit, the result after the decision
    assert min(rec["ours"], rec["peer"], rec["ours_latency"], rec["peer_latency"]) > 0, rec
    assert 0 < rec["negotiation_ms"] < rec["ours_latency"] and 0 < rec["data_ms"] < rec["ours_latency"], rec


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_launch_start_quick_forks_preloaded_workers_for_a_fraction_of_the_cpu(tmp_path: Path) -> None:
    """Three torch workers that import torch and build an optimizer: `sluice launch --preload` against torchrun
    and a plain launch, a fresh Python per worker. Each of those pays 3-5 CPU-s a worker; forked from one
    preloaded process, a worker pays 0.1."""
    out = tmp_path / "launch_start.json"
    result = run_script(["bench/launch_start.py", "--quick", "--json", str(out)], timeout=110)
    assert result.returncode == 0, result.stdout[-3000:]
    wall, cpu = check_records(out, 2)
    assert (wall["case"], cpu["case"]) == ("wall-w3", "cpu-w3") and cpu["unit"] == "CPU-s", (wall, cpu)
    assert cpu["ours"] < 0.7 * cpu["peer"] and cpu["ours"] < 0.7 * cpu["plain"], cpu
