"""The rules of elastic jobs (`sluice launch --elastic`), pure: a generation's settings and its next hosts.

As torchrun's elastic agent does, a generation's end is the end of all its processes: when a worker
dies (or exits REFORM_EXIT, asking for it), the launcher stops the generation and starts the next
with the survivors' count, and with new slots a host discovery script reported (Horovod's
--host-discovery-script), between --min-workers and --max-workers. Every new generation's workers
run the script from the top; `hvd.elastic.run` (worker/torch/elastic.py) restores the state they
last committed, which lives in a per-host directory the launcher names (SLUICE_ELASTIC_DIR) and
removes at the end. New slots are announced to the running workers with SIGUSR1: each re-forms at
its next commit, so no step is lost.

Here: the settings, why a generation ended, and the hosts of the next one (dropped workers' slots
removed, discovered slots added). Running the discovery script and the state directory are
launch/elastic_io.py's; running the generations launch/generations.py's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from sluice.launch.hosts import Host
from sluice.scheduler.bootstrap import ENV_ELASTIC_DIR, ENV_ELASTIC_GENERATION, REFORM_EXIT
from sluice.scheduler.new_place import Place

__all__ = ["ENV_ELASTIC_DIR", "ENV_GENERATION", "REFORM_EXIT", "ElasticSettings", "Reform", "grown", "slots",
           "without"]

#: the variables the launcher gives workers, and the exit status (EX_TEMPFAIL, not a failure) by which
#: a worker asks for the next generation: shared with worker/torch/elastic_host.py
ENV_GENERATION = ENV_ELASTIC_GENERATION


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
    #: --in-place: a lost worker is replaced in its slot and the others re-form in their own processes
    in_place: bool = False

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


def slots(hosts: Sequence[Host]) -> int:
    return sum(h.slots for h in hosts)


def shrunk(hosts: Sequence[str], scheduler: str, standby: str = "") -> list[Place]:
    """The workers' places in a job re-formed in place: `hosts[i]` is the host of the i-th worker (when the job
    shrank, the i-th survivor in old rank order); ranks from 0 in that order, local ranks by host in the same
    order; the re-formed job's `scheduler` and `standby` ("": none)."""
    return [Place(rank, len(hosts), hosts[:rank].count(host), hosts.count(host), scheduler, standby)
            for rank, host in enumerate(hosts)]
