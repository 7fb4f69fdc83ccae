"""A SLURM allocation as the launcher reads it (pure, literal tables)."""

from __future__ import annotations

import pytest

from sluice.launch.cluster import read_hosts
from sluice.launch.hosts import Host, HostsError
from sluice.launch.slurm import allocation_hosts, per_node_counts, slurm_refusal


@pytest.mark.parametrize(("text", "counts"), [("4", [4]), ("2(x3),1", [2, 2, 2, 1]), ("8(x2)", [8, 8])])
def test_slurm_per_node_counts(text: str, counts: list[int]) -> None:
    assert per_node_counts(text, "SLURM_TASKS_PER_NODE") == counts


def test_slurm_allocation_gives_each_node_its_tasks_as_slots() -> None:
    env = {"SLURM_JOB_ID": "12", "SLURM_JOB_NODELIST": "gpu[01-03]", "SLURM_TASKS_PER_NODE": "2(x2),1"}
    assert allocation_hosts(env) == [Host("gpu01", 2), Host("gpu02", 2), Host("gpu03", 1)]
    assert read_hosts(None, None, env) == ([Host("gpu01", 2), Host("gpu02", 2), Host("gpu03", 1)], "SLURM job 12")
    with pytest.raises(HostsError, match="lists 1 nodes but SLURM_JOB_NODELIST has 3"):
        allocation_hosts({**env, "SLURM_TASKS_PER_NODE": "4"})
    with pytest.raises(HostsError, match=r"'x' is not N or N\(xK\)"):
        allocation_hosts({**env, "SLURM_TASKS_PER_NODE": "x"})


def test_one_launcher_per_allocation() -> None:
    assert slurm_refusal({"SLURM_STEP_ID": "0", "SLURM_NTASKS": "1"}) is None
    assert slurm_refusal({}) is None
    refusal = slurm_refusal({"SLURM_STEP_ID": "0", "SLURM_NTASKS": "4"})
    assert refusal is not None and "run `sluice launch` once" in refusal
