"""A task's place in a SLURM job step (pure): SLURM's variables read and checked, as torchrun and Horovod read them.

Under `srun`, SLURM starts one task per process itself (its own process start, accounting, signals
and clean-up); each task learns its place from SLURM_PROCID (global rank), SLURM_NTASKS (size),
SLURM_LOCALID (rank on its node), SLURM_NODEID, and the node list (SLURM_STEP_NODELIST, or the job's
SLURM_JOB_NODELIST / SLURM_NODELIST). Every error names the variable and says what it should hold.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from sluice.launch.hosts import Host, HostsError, expand_nodelist


@dataclass(frozen=True)
class SlurmTask:
    rank: int
    size: int
    local_rank: int
    node: int  # index of this task's node in `nodes`
    nodes: tuple[str, ...]
    job_id: str

    @property
    def first_node(self) -> str:
        """Where rank 0 runs: the node that hosts the scheduler."""
        return self.nodes[0]


def in_slurm_step(env: Mapping[str, str]) -> bool:
    """Is this process a task of a SLURM job step (started by srun)?"""
    return "SLURM_PROCID" in env and "SLURM_STEP_ID" in env


def _int(env: Mapping[str, str], name: str, low: int, high: int | None = None) -> int:
    value = env.get(name)
    if value is None:
        raise HostsError(f"{name} is not set: run under srun (SLURM sets it for every task)")
    if not value.isdigit() or int(value) < low or (high is not None and int(value) >= high):
        bound = f"from {low}" + ("" if high is None else f" to {high - 1}")
        raise HostsError(f"{name}={value!r} must be a whole number {bound}")
    return int(value)


def slurm_task(env: Mapping[str, str]) -> SlurmTask:
    """This task's place, from SLURM's variables in `env`; HostsError naming the variable otherwise."""
    size = _int(env, "SLURM_NTASKS", 1)
    rank = _int(env, "SLURM_PROCID", 0, size)
    listed = next((env[v] for v in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST") if env.get(v)),
                  None)
    if listed is None:
        raise HostsError("none of SLURM_STEP_NODELIST, SLURM_JOB_NODELIST, SLURM_NODELIST is set: run under srun")
    nodes = tuple(expand_nodelist(listed))
    node = _int(env, "SLURM_NODEID", 0, len(nodes))
    local = _int(env, "SLURM_LOCALID", 0, size)
    return SlurmTask(rank, size, local, node, nodes, env.get("SLURM_JOB_ID", ""))


def per_node_counts(text: str, name: str) -> list[int]:
    """SLURM's compressed per-node counts, e.g. SLURM_TASKS_PER_NODE=`2(x3),1` -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for item in text.split(","):
        matched = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if matched is None or int(matched.group(1)) < 1:
            raise HostsError(f"{name}={text!r}: {item!r} is not N or N(xK)")
        counts += [int(matched.group(1))] * int(matched.group(2) or 1)
    return counts


def allocation_hosts(env: Mapping[str, str]) -> list[Host]:
    """The nodes of the SLURM allocation this launcher runs in, each with its tasks as worker slots
    (SLURM_TASKS_PER_NODE: `salloc -N2 --ntasks-per-node=4` gives 4 slots a node; without tasks, the
    CPUs of SLURM_JOB_CPUS_PER_NODE)."""
    listed = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not listed:
        raise HostsError("SLURM_JOB_NODELIST is not set: run `sluice launch` inside an allocation (sbatch, salloc)")
    nodes = expand_nodelist(listed)
    name = next((v for v in ("SLURM_TASKS_PER_NODE", "SLURM_JOB_CPUS_PER_NODE") if env.get(v)), None)
    counts = per_node_counts(env[name], name) if name else [1] * len(nodes)
    if len(counts) != len(nodes):
        raise HostsError(f"{name} lists {len(counts)} nodes but SLURM_JOB_NODELIST has {len(nodes)}")
    return [Host(node, slots) for node, slots in zip(nodes, counts, strict=True)]
