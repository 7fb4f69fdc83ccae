"""A task's place in a SLURM job step, from SLURM's variables (pure, literal tables)."""

from __future__ import annotations

import pytest

from sluice.launch.hosts import HostsError
from sluice.launch.slurm import SlurmTask, in_slurm_step, slurm_task

STEP = {"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1", "SLURM_STEP_NODELIST": "gpu[01-02,07]", "SLURM_JOB_NODELIST": "gpu[01-09]"}


def test_a_task_reads_its_place_from_the_step() -> None:
    assert in_slurm_step(STEP) and not in_slurm_step({"SLURM_JOB_ID": "42"})  # in an allocation, not a step
    task = slurm_task(STEP)
    assert task == SlurmTask(5, 8, 1, 1, ("gpu01", "gpu02", "gpu07"), "42")
    assert task.first_node == "gpu01"  # the step's node list, not the whole allocation's


@pytest.mark.parametrize(("change", "error"), [
    ({"SLURM_PROCID": None}, "SLURM_PROCID is not set: run under srun"),
    ({"SLURM_PROCID": "8"}, r"SLURM_PROCID='8' must be a whole number from 0 to 7"),
    ({"SLURM_NTASKS": "0"}, "SLURM_NTASKS='0'"),
    ({"SLURM_NODEID": "3"}, r"SLURM_NODEID='3' must be a whole number from 0 to 2"),
    ({"SLURM_LOCALID": "-1"}, "SLURM_LOCALID"),
    ({"SLURM_STEP_NODELIST": None, "SLURM_JOB_NODELIST": None}, "none of SLURM_STEP_NODELIST"),
    ({"SLURM_STEP_NODELIST": "gpu[2-1]"}, "not N or N-M"),
])
def test_missing_or_wrong_variables_are_named(change: dict[str, str | None], error: str) -> None:
    env = {k: v for k, v in {**STEP, **change}.items() if v is not None}
    with pytest.raises(HostsError, match=error):
        slurm_task(env)
