"""A host's local group (worker/local_group.py): real torch processes on this machine form one over gloo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.node_procs import ROOT

TAG = "0123456789abcdef"
# One member: forms the group, reduce-scatters and allgathers flat tensors of several lengths (padded as
# share_bounds says), and prints what it got; the store file's mode while the group lives; then closes.
MEMBER = """
import json, os, stat, sys, time
import torch
from sluice.errors import SluiceError
from sluice.worker.local_group import LocalGroup, store_path
from sluice.worker.topology import share_bounds
rank, size, directory, timeout = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
try:
    group = LocalGroup(sys.argv[5], 1, 0, rank, size, timeout=timeout, directory=directory)
except SluiceError as exc:
    print(json.dumps({"error": str(exc)}), flush=True)
    sys.exit(3)
mode = stat.S_IMODE(os.stat(store_path(sys.argv[5], 1, 0, directory)).st_mode)
out = {"mode": mode, "runs": []}
for length in (10, 3, 1, 64):
    padded, bounds = share_bounds(length, size)
    flat = torch.zeros(padded)
    flat[:length] = torch.arange(length, dtype=torch.float32) * (rank + 1)
    share = torch.empty(padded // size)
    group.reduce_scatter(flat, share).wait()
    whole = torch.empty(padded)
    group.allgather(share, whole).wait()
    out["runs"].append({"length": length, "share": share.tolist(), "whole": whole[:length].tolist()})
group.close()
print(json.dumps(out), flush=True)
"""


def _members(count: int, size: int, directory: Path, timeout: float = 30.0) -> list[subprocess.Popen[str]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT.parent)}
    return [subprocess.Popen([sys.executable, "-c", MEMBER, str(rank), str(size), str(directory), str(timeout), TAG],
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for rank in range(count)]


@pytest.mark.timeout(90)
def test_local_group_of_three_sums_each_share_and_gathers_them_back_and_one_missing_a_member_fails_in_time(
        tmp_path: Path) -> None:
    formed, lone = tmp_path / "formed", tmp_path / "lone"
    formed.mkdir()
    lone.mkdir()
    started = time.monotonic()
    # at once: a group of three, and a group of two whose second member never comes (timeout 2 s)
    members, (alone,) = _members(3, 3, formed), _members(1, 2, lone, timeout=2.0)
    results = []
    for member in members:
        out, err = member.communicate(timeout=60)
        assert member.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    total = 1 + 2 + 3  # each member scales 0..length-1 by its rank + 1
    for rank, result in enumerate(results):
        assert result["mode"] == 0o600  # the store says where gloo listens: this user's only
        for run in result["runs"]:
            length = run["length"]
            share = -(-length // 3)
            expected = [float(i * total) if i < length else 0.0 for i in range(rank * share, (rank + 1) * share)]
            assert run["share"] == expected, (rank, run)
            assert run["whole"] == [float(i * total) for i in range(length)], (rank, run)
    assert list(formed.iterdir()) == []  # the store's file went with its last member
    out, err = alone.communicate(timeout=40)
    assert alone.returncode == 3, (out, err[-2000:])
    error = json.loads(out.strip().splitlines()[-1])["error"]
    assert error.startswith("the workers of host 1 did not form their local group (gloo, 2 workers) within 2 s: "
                            "is one of them gone?"), error
    assert time.monotonic() - started < 60
    assert list(lone.iterdir()) == []  # nor does a group that never formed leave its store behind
