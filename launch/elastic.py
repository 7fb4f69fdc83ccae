"""Elastic jobs (`sluice launch --elastic`): generations of the job, re-formed when workers leave or hosts come.

As torchrun's elastic agent does, a generation's end is the end of all its processes: when a worker
dies (or exits REFORM_EXIT, asking for it), the launcher stops the generation and starts the next
with the survivors' count, and with new slots a host discovery script reported (Horovod's
--host-discovery-script), between --min-workers and --max-workers. Every new generation's workers
run the script from the top; `hvd.elastic.run` (worker/torch/elastic.py) restores the state they
last committed, which lives in a per-host directory the launcher names (SLUICE_ELASTIC_DIR) and
removes at the end. New slots are announced to the running workers with SIGUSR1: each re-forms at
its next commit, so no step is lost.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from sluice.launch.hosts import Host, HostsError, parse_host_list
from sluice.scheduler.bootstrap import ENV_ELASTIC_DIR, ENV_ELASTIC_GENERATION, REFORM_EXIT

__all__ = ["ENV_ELASTIC_DIR", "ENV_GENERATION", "REFORM_EXIT", "ElasticSettings", "Reform", "discover", "grown",
           "remove_state_dir", "slots", "state_dir", "without"]

#: the variables the launcher gives workers, and the exit status (EX_TEMPFAIL, not a failure) by which
#: a worker asks for the next generation: shared with worker/torch/elastic_host.py
ENV_GENERATION = ENV_ELASTIC_GENERATION
#: longest a discovery script may run
DISCOVERY_TIMEOUT = 10.0


@dataclass(frozen=True)
class ElasticSettings:
    min_workers: int
    max_workers: int
    #: a program printing the hosts now available, `host:slots` a line (Horovod's shape); None: no growth
    discovery: str | None = None
    #: seconds between runs of the discovery script
    interval: float = 5.0
    #: re-formings not caused by new hosts, at most (a script that fails the same way each time stops)
    max_restarts: int = 10

    def __post_init__(self) -> None:
        if not 1 <= self.min_workers <= self.max_workers:
            raise ValueError(f"--min-workers {self.min_workers} and --max-workers {self.max_workers} must satisfy "
                             "1 <= min <= max")
        if self.interval <= 0 or self.max_restarts < 0:
            raise ValueError("the discovery interval must be positive and --max-restarts not negative")


@dataclass(frozen=True)
class Reform:
    """Why a generation ended for a new one: the workers dropped (by rank) and whether hosts were added."""

    dropped: tuple[int, ...] = ()
    grown: bool = False


def state_dir() -> str:
    """A fresh directory name for the job's committed state, the same on every host (made there by the
    workers, mode 0700): on /dev/shm, memory that outlives a process but not the job."""
    return f"/dev/shm/sluice-elastic-{os.getuid()}-{secrets.token_hex(8)}"


def remove_state_dir(path: str) -> None:
    if Path(path).name.startswith("sluice-elastic-"):
        shutil.rmtree(path, ignore_errors=True)


def without(hosts: Sequence[Host], placed: Sequence[str], dropped: Sequence[int]) -> list[Host]:
    """The hosts after dropping workers `dropped` (ranks), `placed[r]` being worker r's host: each dropped
    worker takes its slot with it; a host left with no slot leaves the job."""
    slots = {h.name: h.slots for h in hosts}
    for rank in dropped:
        slots[placed[rank]] -= 1
    return [replace(h, slots=slots[h.name]) for h in hosts if slots[h.name] > 0]


def grown(hosts: Sequence[Host], found: Sequence[Host], cap: int) -> list[Host]:
    """`hosts` with the slots the discovery reported (new hosts appended, in its order), at most `cap` slots in all."""
    known = {h.name: h for h in hosts}
    merged = [replace(h, slots=max(h.slots, next((f.slots for f in found if f.name == h.name), 0))) for h in hosts]
    merged += [f for f in found if f.name not in known]
    out, total = [], 0
    for host in merged:
        take = min(host.slots, cap - total)
        if take > 0:
            out.append(replace(host, slots=take))
            total += take
    return out


async def discover(script: str) -> list[Host]:
    """The hosts the discovery script reports now; HostsError (with its output) when it fails."""
    proc = await asyncio.create_subprocess_exec(script, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE, start_new_session=True)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), DISCOVERY_TIMEOUT)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise HostsError(f"the host discovery script {script} ran over {DISCOVERY_TIMEOUT:g} s") from None
    if proc.returncode != 0:
        raise HostsError(f"the host discovery script {script} exited {proc.returncode}: "
                         f"{err.decode(errors='replace').strip()[-300:]}")
    lines = [line.strip() for line in out.decode(errors="replace").splitlines() if line.strip()]
    return parse_host_list(",".join(lines)) if lines else []


def slots(hosts: Sequence[Host]) -> int:
    return sum(h.slots for h in hosts)
