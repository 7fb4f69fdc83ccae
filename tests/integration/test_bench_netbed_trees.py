"""Quick runs of the shaped-network benchmarks that build aggregation trees or jobs across ssh hosts (the rest:
test_bench_netbed.py; two files, so that the two test workers share them)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from testbed.bench_runs import check_records, requires_testbed, run_script
from testbed.ssh import unavailable as ssh_unavailable

pytestmark = requires_testbed


@pytest.mark.slow
@pytest.mark.timeout(220)
def test_curve_cost_quick_on_the_testbed(tmp_path: Path) -> None:
    out = tmp_path / "curve_cost.json"
    # ssh-train is testbed-train's job launched over OpenSSH (its own bed and two `sluice launch -H` jobs: 10 s
    # more here); the full run measures it, and test_ssh_security.py launches CURVE jobs over ssh
    result = run_script(["bench/curve_cost.py", "--quick", "--cases", "testbed-pushpull", "testbed-train", "--json",
                         str(out)], timeout=210)
    assert result.returncode == 0, result.stdout[-3000:]
    records = check_records(out, 2)
    assert [rec["case"] for rec in records] == ["testbed-pushpull", "testbed-train"]
    for rec in records:
        assert rec["peer_name"] == "sluice, transport.curve = false" and rec["target_cost"] == 10.0, rec
        faster = rec["ratio"] if rec["better"] == "higher" else 1 / rec["ratio"]
        assert rec["speedup"] == pytest.approx(faster, rel=1e-12), rec
        assert rec["cost"] == pytest.approx((1 / rec["speedup"] - 1) * 100, rel=1e-9, abs=1e-9), rec
        assert rec["case"] in result.stdout
    pushpull = records[0]
    # a 1 Gbit/s link carries at most 125 MB/s; both sides must have moved real data through it
    assert 10 < pushpull["ours"] <= 125 and 10 < pushpull["peer"] <= 125, pushpull


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_aggregation_quick_measures_planned_trees_and_flat_ps_against_their_bounds(tmp_path: Path) -> None:
    out, plot = tmp_path / "aggregation.json", tmp_path / "aggregation.svg"
    result = run_script(["bench/aggregation.py", "--quick", "--json", str(out), "--plot", str(plot)], timeout=190)
    assert result.returncode == 0, result.stdout[-3000:]
    # quick runs two of the four configurations: flat PS, and the planned trees with an auxiliary host per rack
    (rec,) = check_records(out, 1)  # planned+aux vs flat
    assert rec["case"] == "4:1 planned+aux aux" and rec["aux"] is True and rec["peer_name"] == "flat PS", rec
    assert rec["oversubscription"] == "4:1" and rec["better"] == "lower", rec
    assert rec["speedup"] == pytest.approx(rec["peer"] / rec["ours"], rel=1e-12), rec
    # the model's bound is printed beside each case: both the planned trees' and flat PS's
    assert 0.5 < rec["measured_vs_predicted"] < 3, rec
    assert 0.5 < rec["peer"] / rec["peer_predicted"] < 3, rec
    assert rec["target"] == 2.3 and rec["met"] == (rec["speedup"] >= 2.3), rec
    assert ET.parse(plot).getroot().tag == "{http://www.w3.org/2000/svg}svg"
    assert "measured/predicted" in result.stdout


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_replan_quick_switches_trees_after_an_uplink_is_cut_and_set_back_with_every_sum_exact(tmp_path: Path) -> None:
    out = tmp_path / "replan.json"
    result = run_script(["bench/replan.py", "--quick", "--json", str(out)], timeout=190)
    # the benchmark fails when no new trees come into force after the cut, or when any round's sum is off
    assert result.returncode == 0, result.stdout[-3000:]
    rec, kept, mended = check_records(out, 3)
    assert rec["peer_name"] == "fresh plan" and rec["periods_to_new_plan"] > 0, rec
    assert "throttle to the new trees carrying pushes" in result.stdout
    # mends counted while the uplink was still cut are reported (a period number each), not hidden
    assert all(isinstance(p, int) for periods in rec["false_mends"] for p in periods), rec
    assert "uplinks counted mended while still cut" in result.stdout
    # the same cut under the first trees, kept (no re-plan): what the re-plan buys, against the same rounds
    assert kept["peer_name"] == "the first trees kept (no re-plan)" and kept["ours"] == rec["ours"], kept
    assert kept["kept_rounds_s"] and all(d > 0 for d in kept["kept_rounds_s"][0]), kept
    assert "round in flight at the switch / first trees kept" in result.stdout
    # the uplink set back: the record of the rounds after it, against those before the cut
    assert mended["peer_name"] == "rounds before the cut" and mended["restore_after_s"] == 8.0, mended
    assert "mended to the new trees carrying pushes" in result.stdout


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.skipif(bool(ssh_unavailable()), reason=ssh_unavailable() or "sshd is available")
def test_pipeline_zvc_quick_compares_compression_on_and_off_between_hosts(tmp_path: Path) -> None:
    out = tmp_path / "pipeline_zvc.json"
    result = run_script(["bench/pipeline_zvc.py", "--quick", "--json", str(out)], timeout=110)
    (rec,) = check_records(out, 1)
    assert rec["compression_ratio"] > 1.5, rec  # ReLU activations: about half zeros
    assert str(rec["case"]) in result.stdout
