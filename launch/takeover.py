"""Where the launcher starts a server whose host was lost (ps.replicas): on the host that holds its mirror.

A host is lost when a session to it fails (ssh notices a silent peer after ServerAliveInterval x
ServerAliveCountMax, 15 s), or sooner: when the scheduler says a node it waits for fell silent
(SLUICE_NODE_SILENT, after scheduler.heartbeat_timeout: a server, or an aggregator with ps.recover; a
worker's silence fails the job at once, which the launcher hears anyway) and the node's host does
not answer a TCP connection to its ssh port within PROBE_S (`host_answers`; a refused connection is
an answer): the launcher then takes every session to that host as failed (launch/supervisor.py).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from sluice.launch.children import SSH_FAILED, Child
from sluice.launch.cluster import ClusterPlan
from sluice.launch.config import SluiceConfig
from sluice.scheduler.recovery import Placement, chosen_mirror_every, holders


def with_replicas(config: SluiceConfig, plan: ClusterPlan | None, elastic: bool,
                  workers: int) -> tuple[SluiceConfig, str]:
    """ps.replicas and ps.mirror_every as the job's processes get them, and a line saying what was chosen
    ("" when nothing was). Left at -1, replicas become 1 (with ps.recover) when the job's servers run on
    several hosts and recovery can run (ps.sync, not --elastic, which restarts every process anyway; an
    aggregator lost with a server's host is started on another, `aggregator_host_lost`); a mirror_every left
    at 0 is chosen from the worker count (scheduler/recovery.py)."""
    ps, said = config.ps, ""
    hosts = {p.host for p in plan.layout.processes if p.role == "server"} if plan is not None else set()
    if ps.replicas > 1 and plan is not None and len(hosts) <= ps.replicas and not ps.mirror_same_host:
        said = (f"ps.replicas = {ps.replicas}, but the servers span {len(hosts)} hosts: each server's state is "
                f"mirrored on {max(len(hosts) - 1, 0)} other host(s)")
    if ps.replicas == -1:
        why_not = ("the servers run on one host" if len(hosts) < 2 else
                   "ps.sync = false is not covered" if not ps.sync else
                   "--elastic restarts every process of a generation" if elastic else "")
        ps = replace(ps, replicas=0 if why_not else 1, recover=ps.recover or not why_not)
        if plan is not None and any(plan.is_remote(p.host) for p in plan.layout.processes):
            said = (f"ps.replicas: off ({why_not})" if why_not else
                    f"ps.replicas: each server's committed state is mirrored on another host (its servers span "
                    f"{len(hosts)} hosts): a lost server host costs nothing; --set ps.replicas=0 turns this off")
    if ps.mirror_every == 0:
        copies = ps.replicas if ps.mirror_same_host else min(ps.replicas, max(len(hosts) - 1, 1))
        ps = replace(ps, mirror_every=chosen_mirror_every(workers, copies))
        if ps.mirrored:
            said += ("; " if said else "ps.replicas: ") + (
                f"ps.mirror_every = {ps.mirror_every} (from {workers} workers"
                f"{f' and {copies} copies' if copies > 1 else ''}: each worker keeps that many copies of its "
                "gradients to replay)")
    return replace(config, ps=ps), said


#: how long a silent server's host has to answer on its ssh port
PROBE_S = 2.0


async def host_answers(address: str, port: int, timeout: float = PROBE_S) -> bool:
    """Whether `address` answers a TCP connection to `port` within `timeout` (accepted or refused)."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(address, port), timeout)
    except ConnectionRefusedError:
        return True
    except (TimeoutError, OSError):
        return False
    writer.close()
    return True


class Takeovers:
    """The servers moved to their mirror's host so far, and the hosts lost."""

    def __init__(self, config: SluiceConfig, plan: ClusterPlan | None, servers: int) -> None:
        self.config, self.plan, self.servers = config, plan, servers
        #: server rank -> the host it runs on now, where that is not its planned one
        self.moved: dict[int, str] = {}
        #: server rank -> the rank of the server whose mirror of it it restores from (on that server's host)
        self.took_from: dict[int, int] = {}
        self.lost_hosts: set[str] = set()

    def host_of(self, rank: int) -> str | None:
        """Where server `rank` runs, if it moved (None: where the plan put it)."""
        return self.moved.get(rank)

    def host_lost(self, dead: Child) -> str | None:
        """`dead`'s ssh session failed (its host is down or cut off, SSH_FAILED; a process killed on a live
        host is reported as its signal or status instead) and ps.replicas keeps its state on another host:
        the host of its first holder whose host is not lost, now its own. None: restart it where it was, as
        without replicas (its host lost with every copy, the restart fails naming it)."""
        plan = self.plan
        if (not self.config.ps.mirrored or plan is None or dead.role != "server" or dead.via != "ssh"
                or dead.returncode != SSH_FAILED):
            return None
        ps, placed = self.config.ps, [plan.place("server", r).host for r in range(self.servers)]
        hosts = [self.moved.get(r) or placed[r] for r in range(self.servers)]
        self.lost_hosts.add(hosts[dead.rank])
        # the scheduler's placement (scheduler/recovery.py), from where the servers first ran: the first live holder
        placement = Placement(holders([plan.address(h) for h in placed], ps.mirror_same_host, ps.replicas),
                              ps.mirror_same_host, set(self.moved))
        holder = next((h for h in placement.holders(dead.rank, [plan.address(h) for h in hosts])
                       if hosts[h] not in self.lost_hosts), None)
        if holder is None:
            return None
        self.moved[dead.rank], self.took_from[dead.rank] = hosts[holder], holder
        return hosts[holder]

    def aggregator_host_lost(self, dead: Child) -> str | None:
        """`dead`, an aggregator, was lost with its host (its ssh session failed) in a job with ps.replicas: the
        live host it starts again on (the first server host left, else the first host; its children replay to
        it what it summed for a server that took over rounds behind, worker/replaced.py). None: not so."""
        plan = self.plan
        if (not self.config.ps.mirrored or plan is None or dead.role != "aggregator" or dead.via != "ssh"
                or dead.returncode != SSH_FAILED or dead.host is None):
            return None
        self.lost_hosts.add(dead.host)
        servers = [self.moved.get(r) or plan.place("server", r).host for r in range(self.servers)]
        return next((h for h in [*servers, *(h.name for h in plan.hosts)] if h not in self.lost_hosts), None)

    def describe(self, dead: Child, host: str) -> str:
        assert self.plan is not None and dead.host is not None
        return (f"server {dead.rank}'s host {self.plan.address(dead.host)} lost; replica on "
                f"{self.plan.address(host)} took shard {dead.rank}")
