"""Where the launcher starts a server whose host was lost (ps.replicas): on the host that holds its mirror."""

from __future__ import annotations

from sluice.launch.children import SSH_FAILED, Child
from sluice.launch.cluster import ClusterPlan
from sluice.launch.config import SluiceConfig
from sluice.scheduler.recovery import holders


class Takeovers:
    """The servers moved to their mirror's host so far, and the hosts lost."""

    def __init__(self, config: SluiceConfig, plan: ClusterPlan | None, servers: int) -> None:
        self.config, self.plan, self.servers = config, plan, servers
        #: server rank -> the host it runs on now, where that is not its planned one
        self.moved: dict[int, str] = {}
        self.lost_hosts: set[str] = set()

    def host_of(self, rank: int) -> str | None:
        """Where server `rank` runs, if it moved (None: where the plan put it)."""
        return self.moved.get(rank)

    def host_lost(self, dead: Child) -> str | None:
        """`dead`'s ssh session failed (its host is down or cut off, SSH_FAILED; a process killed on a live
        host is reported as its signal or status instead) and ps.replicas keeps its state on another host:
        that host, now its own. None: restart it where it was, as without replicas."""
        plan = self.plan
        if (not self.config.ps.replicas or plan is None or dead.role != "server" or dead.via != "ssh"
                or dead.returncode != SSH_FAILED):
            return None
        hosts = [self.moved.get(r) or plan.place("server", r).host for r in range(self.servers)]
        holder = holders([plan.address(h) for h in hosts], self.config.ps.mirror_same_host).get(dead.rank)
        if holder is None or hosts[holder] == hosts[dead.rank]:
            return None
        self.lost_hosts.add(hosts[dead.rank])
        self.moved[dead.rank] = hosts[holder]
        return hosts[holder]

    def describe(self, dead: Child, host: str) -> str:
        assert self.plan is not None and dead.host is not None
        return (f"server {dead.rank}'s host {self.plan.address(dead.host)} lost; replica on "
                f"{self.plan.address(host)} took shard {dead.rank}")
