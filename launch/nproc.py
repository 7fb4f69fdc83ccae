"""torchrun's --nproc-per-node values: a count, or `cpu`, `gpu` or `auto`, resolved on the machine the launcher runs on.

torch 2.13's torchrun (torch/distributed/run.py, determine_local_world_size) takes an integer, or `cpu` (the CPUs
this process may run on), `gpu` (the CUDA devices; an error without one), `xpu` and the like (other accelerators),
or `auto` (the accelerators when there are any, else the CPUs). Kubeflow's TrainJob sets PET_NPROC_PER_NODE=auto
unless told otherwise, and tutorials write `--nproc-per-node gpu`. The launcher does not import torch to count: it
counts the NVIDIA devices the process sees (/dev/nvidiaN, narrowed by CUDA_VISIBLE_DEVICES as CUDA narrows them).
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Mapping, Sequence

NAMES = ("cpu", "gpu", "auto")


def visible_gpus(environ: Mapping[str, str], devices: Sequence[str]) -> int:
    """CUDA devices a process sees: CUDA_VISIBLE_DEVICES's entries up to the first that names no device (CUDA stops
    there; "" or -1: none), else the machine's /dev/nvidiaN `devices`."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return len(devices)
    count = 0
    for entry in (part.strip() for part in visible.split(",")):
        if not (entry.isdigit() and int(entry) < len(devices)) and not entry.startswith(("GPU-", "MIG-")):
            break
        count += 1
    return count


def local_world_size(value: str, environ: Mapping[str, str], devices: Sequence[str], cpus: int) -> int:
    """The workers of one machine for --nproc-per-node `value`; ValueError saying what to give."""
    if value.isdigit() and int(value) > 0:
        return int(value)
    gpus = visible_gpus(environ, devices)
    if value == "cpu" or (value == "auto" and not gpus):
        return cpus
    if value in ("gpu", "auto"):
        if not gpus:
            raise ValueError("--nproc-per-node gpu: this machine has no CUDA device (no /dev/nvidiaN, or "
                             "CUDA_VISIBLE_DEVICES hides them); give a count, or cpu")
        return gpus
    raise ValueError(f"--nproc-per-node {value!r}: give the workers of each machine as a count, or cpu, gpu or auto "
                     "(as torchrun)")


def nproc_per_node(value: str, environ: Mapping[str, str] = os.environ) -> int:
    """`local_world_size` on this machine: its NVIDIA devices and the CPUs this process may run on."""
    devices = [path for path in glob.glob("/dev/nvidia*") if re.fullmatch(r"/dev/nvidia\d+", path)]
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return local_world_size(value.strip(), environ, devices, cpus)
