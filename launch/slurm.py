"""A SLURM allocation as the launcher sees it (pure): its nodes and their slots, and where the launcher must not run.

`sluice launch` runs once inside an allocation (sbatch, salloc) and starts every process as an srun
step on the allocation's nodes (launch/reach.py), each node offering the tasks SLURM gave it as
worker slots. Every error names the variable and says what it should hold.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from sluice.launch.hosts import Host, HostsError, expand_nodelist


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


def slurm_refusal(env: Mapping[str, str]) -> str | None:
    """Why `sluice launch` must not run as one task of several in a SLURM step, or None."""
    tasks = env.get("SLURM_NTASKS", "1")
    if env.get("SLURM_STEP_ID") is not None and tasks.isdigit() and int(tasks) > 1:
        return (f"this launcher is one of {tasks} tasks of a SLURM job step (srun -n {tasks} sluice launch ...): run "
                "`sluice launch` once, in the batch script or the salloc shell; it starts every role with srun itself")
    return None
