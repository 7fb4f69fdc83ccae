"""torchrun's --nproc-per-node values (a count, cpu, gpu, auto) on machines of given devices and CPUs, and the
launcher taking them from the flag or torchrun's PET_NPROC_PER_NODE; literal tables."""

from __future__ import annotations

import pytest

from sluice.launch.cli import build_parser
from sluice.launch.foreign_flags import translate
from sluice.launch.nproc import local_world_size, visible_gpus

FOUR = ["/dev/nvidia0", "/dev/nvidia1", "/dev/nvidia2", "/dev/nvidia3"]


@pytest.mark.parametrize(("environ", "devices", "want"), [
    ({}, FOUR, 4),
    ({}, [], 0),
    ({"CUDA_VISIBLE_DEVICES": "1,3"}, FOUR, 2),
    ({"CUDA_VISIBLE_DEVICES": ""}, FOUR, 0),  # none, as CUDA reads it
    ({"CUDA_VISIBLE_DEVICES": "0,7,1"}, FOUR, 1),  # CUDA stops at the first index that names no device
    ({"CUDA_VISIBLE_DEVICES": "-1"}, FOUR, 0),
    ({"CUDA_VISIBLE_DEVICES": "GPU-8f2a,GPU-11c0"}, FOUR, 2),  # by UUID
    ({"CUDA_VISIBLE_DEVICES": "0"}, [], 0),
])
def test_the_cuda_devices_a_process_sees(environ: dict[str, str], devices: list[str], want: int) -> None:
    assert visible_gpus(environ, devices) == want


@pytest.mark.parametrize(("value", "environ", "devices", "want"), [
    ("3", {}, FOUR, 3),
    ("cpu", {}, FOUR, 16),
    ("gpu", {}, FOUR, 4),
    ("auto", {}, FOUR, 4),
    ("auto", {}, [], 16),  # no accelerator: torchrun's auto takes the CPUs
    ("auto", {"CUDA_VISIBLE_DEVICES": "2"}, FOUR, 1),
])
def test_each_value_torchrun_takes(value: str, environ: dict[str, str], devices: list[str], want: int) -> None:
    assert local_world_size(value, environ, devices, 16) == want


@pytest.mark.parametrize(("value", "message"), [
    ("0", "give the workers of each machine as a count, or cpu, gpu or auto"),
    ("xpu", "give the workers of each machine as a count"),
    ("gpu", "this machine has no CUDA device"),
])
def test_a_value_that_cannot_run_says_what_to_give(value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        local_world_size(value, {}, [], 16)


@pytest.mark.parametrize(("argv", "environ", "want"), [
    (["--nproc-per-node", "cpu", "train.py"], {}, 2),
    (["train.py"], {"PET_NPROC_PER_NODE": "cpu"}, 2),  # torchrun's variable, as Kubeflow's TrainJob sets it
    (["train.py"], {"PET_NPROC_PER_NODE": "3"}, 3),
    (["-w", "5", "train.py"], {"PET_NPROC_PER_NODE": "3"}, 5),  # a flag wins over the variable
    (["train.py"], {}, None),
])
def test_the_launcher_takes_the_flag_or_torchruns_variable(argv: list[str], environ: dict[str, str],
                                                            want: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    args = build_parser().parse_args(["launch", *argv])
    translate(args, has_hosts=False, environ=environ)
    assert args.workers == want
