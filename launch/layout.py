"""Which host runs which role of a multi-host job (pure): workers fill the hosts' slots, servers spread over hosts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sluice.launch.hosts import Host, HostsError


@dataclass(frozen=True)
class Process:
    role: str  # "worker", "server" or "aggregator"
    rank: int
    host: str
    local_rank: int  # its index among the processes of its role on its host


@dataclass(frozen=True)
class Layout:
    scheduler: str  # the host the scheduler runs on
    processes: tuple[Process, ...]

    def on(self, host: str) -> list[Process]:
        return [p for p in self.processes if p.host == host]


def _spread(role: str, count: int, hosts: Sequence[str]) -> list[Process]:
    """`count` processes round-robin over `hosts`, in order."""
    made, per_host = [], dict.fromkeys(hosts, 0)
    for rank in range(count):
        host = hosts[rank % len(hosts)]
        made.append(Process(role, rank, host, per_host[host]))
        per_host[host] += 1
    return made


def lay_out(hosts: Sequence[Host], workers: int | None, servers: int, aggregators: int = 0,
            server_hosts: Sequence[str] | None = None, scheduler_host: str | None = None) -> Layout:
    """Workers fill each host's slots in order (Horovod's and torchrun's order, so ranks on one host are
    consecutive); `workers` None takes every slot. Servers and aggregators use no slots: they go
    round-robin over `server_hosts` (default: every host, so each host's link carries a share of the
    servers' traffic). The scheduler runs on `scheduler_host` (default: the first host)."""
    names = [h.name for h in hosts]
    total = sum(h.slots for h in hosts)
    count = total if workers is None else workers
    if count < 1:
        raise HostsError(f"a job needs at least one worker, got -w {count}")
    if count > total:
        raise HostsError(f"-w {count} asks for more workers than the hosts have slots ({total}): lower -w, or "
                         "give the hosts more slots (host:N, or slots=N in the hostfile)")
    if servers < 0 or aggregators < 0:
        raise HostsError("the server and aggregator counts cannot be negative")
    for wanted, what in ((server_hosts or (), "server host"), ((scheduler_host,) if scheduler_host else (),
                                                               "scheduler host")):
        unknown = [h for h in wanted if h not in names]
        if unknown:
            raise HostsError(f"{what} {unknown[0]!r} is not one of the job's hosts ({', '.join(names)})")
    processes: list[Process] = []
    rank = 0
    for host in hosts:
        for local in range(host.slots):
            if rank == count:
                break
            processes.append(Process("worker", rank, host.name, local))
            rank += 1
    spread = list(server_hosts) if server_hosts else names
    processes += _spread("server", servers, spread)
    processes += _spread("aggregator", aggregators, spread)
    return Layout(scheduler_host or names[0], tuple(processes))
