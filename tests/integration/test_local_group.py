"""A host's local group (worker/local_group.py): real torch processes on this machine form one over gloo."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.node_procs import ROOT

TAG = "0123456789abcdef"
# One member: forms the group (after a delay, if given), reduce-scatters and allgathers flat tensors of several
# lengths (padded as share_bounds says), and prints what it got and whether the store's file was still there once
# the group had formed; then closes.
MEMBER = """
import json, os, sys, time
import torch
from sluice.errors import SluiceError
from sluice.worker.local_group import LocalGroup, store_path
from sluice.worker.topology import share_bounds
rank, size, directory, timeout = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
time.sleep(float(sys.argv[6]))
try:
    group = LocalGroup(sys.argv[5], 1, 0, rank, size, timeout=timeout, directory=directory, lanes=2)
except SluiceError as exc:
    print(json.dumps({"error": str(exc)}), flush=True)
    sys.exit(3)
out = {"store_left": os.path.exists(store_path(sys.argv[5], 1, 0, directory)), "runs": []}
for lane, length in enumerate((10, 3, 1, 64)):
    padded, bounds = share_bounds(length, size)
    flat = torch.zeros(padded)
    flat[:length] = torch.arange(length, dtype=torch.float32) * (rank + 1)
    share = torch.empty(padded // size)
    group.reduce_scatter(flat, share, lane=lane % 2).wait()
    whole = torch.empty(padded)
    group.allgather(share, whole, lane=lane % 2).wait()
    out["runs"].append({"length": length, "share": share.tolist(), "whole": whole[:length].tolist()})
group.close()
print(json.dumps(out), flush=True)
"""


def _members(count: int, size: int, directory: Path, timeout: float = 30.0, last_delay: float = 0.0,
             lazy: bool = False) -> list[subprocess.Popen[str]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT.parent), "TORCH_GLOO_LAZY_INIT": "1" if lazy else "0"}
    return [subprocess.Popen([sys.executable, "-c", MEMBER, str(rank), str(size), str(directory), str(timeout), TAG,
                              str(last_delay if rank == count - 1 else 0.0)],
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for rank in range(count)]


def _store_mode_while_forming(directory: Path, deadline_s: float) -> int:
    """The mode of the store's file in `directory`, read while the group waits for its last member."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        for path in directory.iterdir():
            with contextlib.suppress(FileNotFoundError):
                return stat.S_IMODE(path.stat().st_mode)
        time.sleep(0.02)
    raise AssertionError(f"no store appeared in {directory} within {deadline_s:g} s")


@pytest.mark.timeout(90)
def test_local_group_of_three_sums_each_share_and_gathers_them_back_and_one_missing_a_member_fails_in_time(
        tmp_path: Path) -> None:
    formed, lone = tmp_path / "formed", tmp_path / "lone"
    formed.mkdir()
    lone.mkdir()
    started = time.monotonic()
    # at once: a group of three whose last member comes 3 s late, and a group of two whose second member never
    # comes (timeout 2 s). The three connect each of their 2 lanes at its first collective (gloo's lazy init): the
    # store must outlive that, as it does when every lane connects as it is made
    members = _members(3, 3, formed, last_delay=3.0, lazy=True)
    (alone,) = _members(1, 2, lone, timeout=2.0)
    # the store tells where gloo listens: this user's only, while it is there
    assert _store_mode_while_forming(formed, deadline_s=30.0) == 0o600
    results = []
    for member in members:
        out, err = member.communicate(timeout=60)
        assert member.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    total = 1 + 2 + 3  # each member scales 0..length-1 by its rank + 1
    for rank, result in enumerate(results):
        assert result["store_left"] is False  # gone once every member connected: a member killed now leaves none
        for run in result["runs"]:
            length = run["length"]
            share = -(-length // 3)
            expected = [float(i * total) if i < length else 0.0 for i in range(rank * share, (rank + 1) * share)]
            assert run["share"] == expected, (rank, run)
            assert run["whole"] == [float(i * total) for i in range(length)], (rank, run)
    assert list(formed.iterdir()) == []  # nor did closing the group bring it back
    out, err = alone.communicate(timeout=40)
    assert alone.returncode == 3, (out, err[-2000:])
    error = json.loads(out.strip().splitlines()[-1])["error"]
    assert error.startswith("the workers of host 1 did not form their local group (gloo, 2 workers) within 2 s: "
                            "is one of them gone?"), error
    assert time.monotonic() - started < 60
    assert list(lone.iterdir()) == []  # nor does a group that never formed leave its store behind
