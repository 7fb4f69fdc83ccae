"""A multi-host job's plan: which host runs each role, the address each listens on, and how it is started.

Built once by the launcher from -H, --hostfile or the SLURM allocation: names are resolved here (on
the launcher's machine, as ssh will resolve them), so a typo fails before anything starts. The
scheduler runs in the launcher's machine, as horovodrun's driver and torchrun's rendezvous host do:
it is where the job is watched and ended from.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace

from sluice.launch.config import SluiceConfig
from sluice.launch.hosts import Host, HostsError, parse_host_list, parse_hostfile
from sluice.launch.layout import Layout, Process, lay_out
from sluice.launch.reach import Reach, host_address, is_this_machine, outward_address
from sluice.launch.slurm import allocation_hosts

_DEFAULT_HOST = "127.0.0.1"


@dataclass(frozen=True)
class ClusterPlan:
    layout: Layout
    reach: Reach
    #: each host's address (what its processes listen on and are dialled at)
    addresses: Mapping[str, str]
    #: where the launcher's own processes (the scheduler, roles of a host that is this machine) listen
    launcher_address: str
    #: hosts whose roles start without ssh (this machine); under SLURM every role goes through srun
    here: frozenset[str]
    #: where the hosts came from, for the launcher's first lines ("-H", a hostfile's path, "SLURM job 12")
    source: str
    #: the hosts with their worker slots, spare ones included (--elastic --in-place replaces a worker there)
    hosts: tuple[Host, ...] = ()

    def spare_host(self, busy: Sequence[str], lost: Collection[str]) -> str | None:
        """A host with a free worker slot, not among `lost`, given the hosts of the workers running now."""
        return next((h.name for h in self.hosts if h.name not in lost and busy.count(h.name) < h.slots), None)

    def place(self, role: str, rank: int) -> Process:
        return next(p for p in self.layout.processes if p.role == role and p.rank == rank)

    def is_remote(self, host: str) -> bool:
        return self.reach.method == "srun" or host not in self.here

    def address(self, host: str) -> str:
        return self.launcher_address if host in self.here else self.addresses[host]

    def workers_on(self, host: str) -> int:
        return sum(1 for p in self.layout.on(host) if p.role == "worker")

    def describe(self) -> str:
        """One line per host: what runs there."""
        lines = [f"hosts from {self.source}; the scheduler runs here ({self.launcher_address})"
                 + ("; roles start with srun" if self.reach.method == "srun" else "")]
        for host in dict.fromkeys(p.host for p in self.layout.processes):
            parts = []
            for role in ("worker", "server", "aggregator"):
                ranks = [p.rank for p in self.layout.on(host) if p.role == role]
                if ranks:
                    shown = f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 2 else ",".join(map(str, ranks))
                    parts.append(f"{role}{'s' if len(ranks) > 1 else ''} {shown}")
            where = "this machine" if host in self.here else self.addresses[host]
            lines.append(f"  {host} ({where}): {', '.join(parts)}")
        return "\n".join(lines)

    def with_hosts(self, found: Sequence[Host]) -> ClusterPlan:
        """The plan with the worker slots a host discovery reports now (new hosts' addresses resolved here;
        HostsError when one does not resolve)."""
        addresses = {**self.addresses, **{h.name: host_address(h.name) for h in found if h.name not in self.addresses}}
        return replace(self, addresses=addresses, hosts=tuple(found))

    def with_workers(self, hosts: Sequence[str]) -> ClusterPlan:
        """The plan with its workers on `hosts` by rank (the job shrank in place); the other roles as they were."""
        workers = [Process("worker", rank, host, hosts[:rank].count(host)) for rank, host in enumerate(hosts)]
        others = [p for p in self.layout.processes if p.role != "worker"]
        return replace(self, layout=Layout(self.layout.scheduler, (*workers, *others)))

    def with_racks(self, config: SluiceConfig, hosts: Sequence[Host]) -> SluiceConfig:
        """The hostfile's rack labels as aggregation.racks (by address), unless the config sets racks itself."""
        if config.aggregation.racks or not any(h.rack for h in hosts):
            return config
        racks: dict[str, list[str]] = {}
        for host in hosts:
            racks.setdefault(host.rack or "unlabelled", []).append(self.address(host.name))
        entries = tuple(f"{rack}: {' '.join(members)}" for rack, members in racks.items())
        return replace(config, aggregation=replace(config.aggregation, racks=entries))


def read_hosts(host_list: str | None, hostfile: str | None, environ: Mapping[str, str]) -> tuple[list[Host], str]:
    """The job's hosts and where they came from; ([], "") for a job on this machine alone."""
    if host_list and hostfile:
        raise HostsError("give -H or --hostfile, not both")
    if host_list:
        return parse_host_list(host_list), "-H"
    if hostfile:
        try:
            with open(hostfile, encoding="utf-8") as stream:
                text = stream.read()
        except OSError as exc:
            raise HostsError(f"cannot read the hostfile: {exc}") from None
        return parse_hostfile(text, hostfile), hostfile
    if environ.get("SLURM_JOB_ID") and environ.get("SLURM_JOB_NODELIST", environ.get("SLURM_NODELIST")):
        return allocation_hosts(environ), f"SLURM job {environ['SLURM_JOB_ID']}"
    return [], ""


def plan_cluster(hosts: Sequence[Host], source: str, workers: int | None, servers: int, aggregators: int,
                 server_hosts: str | None, reach: Reach, config: SluiceConfig) -> ClusterPlan:
    """Lay the roles out over `hosts` and resolve every address; HostsError saying what to fix."""
    wanted = [name.strip() for name in server_hosts.split(",")] if server_hosts else None
    layout = lay_out(hosts, workers, servers, aggregators, server_hosts=wanted)
    addresses = {h.name: host_address(h.name) for h in hosts}
    here = frozenset(name for name, address in addresses.items() if is_this_machine(address))
    away = [addresses[h.name] for h in hosts if h.name not in here]
    if config.transport.host != _DEFAULT_HOST:  # the operator chose where this machine's processes listen
        launcher_address = config.transport.host
    elif away:  # other hosts must reach the scheduler: the address our packets to them leave from
        launcher_address = outward_address(away[0])
    else:
        launcher_address = _DEFAULT_HOST
    if away and launcher_address.startswith("127."):
        raise HostsError(f"transport.host = {launcher_address} cannot be reached from the other hosts: leave it "
                         "unset, or give this machine's address on the network the hosts share")
    return ClusterPlan(layout, reach, addresses, launcher_address, here, source, tuple(hosts))


__all__ = ["ClusterPlan", "HostsError", "plan_cluster", "read_hosts"]
