"""The scheduler's side of server recovery (ps.recover; pure): re-admit a replaced server, re-plan it, announce it.

A server that dies is restarted by the launcher under its own name (its CURVE keys derive from the
job secret and that name, so nobody else can claim it). When it registers again while the job runs,
the scheduler welcomes it with its old node id and rank, sends it again every PLAN the dead one got,
in order (it restores each chunk's committed state from its state file, ps/snapshot.py, before it
acknowledges), and once it acknowledged them all tells the workers SERVER_BACK with its new
endpoints, on which they re-send what the dead one left unanswered (scheduler/resend.py). No worker
talks to the replacement before it knows its chunks: the same rule as a declaration's. While a
server is silent, the job waits ps.recover_timeout beyond the heartbeat timeout for its replacement
before it fails naming it.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from sluice.scheduler.node import endpoint_host
from sluice.transport.wire import Kind, Message

#: ps.mirror_every when it is left at 0 and no launcher chose it (ps/config.py): here, as the workers, which keep
#: that many pushes to replay, read the ps section without the server's settings class (worker/ may not import ps/)
MIRROR_EVERY = 4
#: the most rounds between a chunk's mirrors that `sluice launch` chooses: each worker keeps that many copies
#: of its gradients in host memory
MIRROR_EVERY_CHOSEN_MAX = 16


def mirror_rounds(mirror_every: int) -> int:
    """ps.mirror_every as the processes use it: 0 (not chosen by a launcher) means MIRROR_EVERY."""
    return mirror_every if mirror_every > 0 else MIRROR_EVERY


def chosen_mirror_every(workers: int, copies: int = 1) -> int:
    """ps.mirror_every for a job of `workers` when left at 0, its servers' state kept in `copies` places
    (ps.replicas as the hosts allow): the fewest rounds between a chunk's mirrors whose bytes stay within 7.5%
    of what a server's link carries anyway (the rest of a 10% budget is the messages' own cost). Per round a
    server's link carries W pushes and W replies of its shard; mirroring Adam's state (3x the shard: value, m,
    v) to C holders every N rounds adds 3C/N of it, and as much again to check and write on the holders' hosts,
    so N >= 40 C / W (N = 30 / W measured +10% on a job the links bound; 2 copies at 40 / W measured +18%).
    At least MIRROR_EVERY (each MIRROR is also a message each way: small shards pay for messages, not bytes), at
    most MIRROR_EVERY_CHOSEN_MAX (the workers' copies)."""
    return min(MIRROR_EVERY_CHOSEN_MAX, max(MIRROR_EVERY, math.ceil(40 * max(copies, 1) / max(workers, 1))))


#: the most hosts besides its own that a server's state is mirrored on (ps.replicas)
MAX_REPLICAS = 3


def holders(hosts: Sequence[str], same_host: bool = False, replicas: int = 1) -> dict[int, list[int]]:
    """ps.replicas: server rank -> the ranks of the servers that mirror its state (ps/mirror.py), first the one
    that takes over: the next `replicas` servers in rank order (wrapping) each on another host than the
    server's and than each other's (`hosts[rank]`); fewer where the servers span fewer hosts, none for a
    server alone on the servers' hosts. `same_host`: any other servers will do (ps.mirror_same_host, tests
    on one machine only)."""
    mirrored: dict[int, list[int]] = {}
    for rank, host in enumerate(hosts):
        taken: list[int] = []
        for step in range(1, len(hosts)):
            other = (rank + step) % len(hosts)
            if len(taken) < replicas and (same_host or hosts[other] not in {host, *(hosts[t] for t in taken)}):
                taken.append(other)
        if taken:
            mirrored[rank] = taken
    return mirrored


@dataclass
class Placement:
    """Which servers hold each server's mirror: placed once, from the hosts the servers first ran on, and then
    only shrunk. A server that moved to another host (it took over from a mirror, its own host lost) holds no
    mirror any more (its files were on the lost host), and no server is mirrored on its own host; a lost
    holder is not replaced, so a shard keeps the copies that survive."""

    placed: dict[int, list[int]]
    same_host: bool = False
    #: ranks that run on another host than they were placed on
    moved: set[int] = field(default_factory=set)

    def holders(self, rank: int, hosts: Sequence[str]) -> list[int]:
        """Server `rank`'s live holders, first the one that takes over, with the servers on `hosts` now."""
        return [h for h in self.placed.get(rank, []) if h not in self.moved and h < len(hosts) and rank < len(hosts)
                and (self.same_host or hosts[h] != hosts[rank])]

    def holds(self, holder: int, hosts: Sequence[str]) -> list[int]:
        """The ranks whose mirrors server `holder` keeps, with the servers on `hosts` now."""
        return [rank for rank in sorted(self.placed) if holder in self.holders(rank, hosts)]


@dataclass
class ServerRecovery:
    enabled: bool = False
    #: seconds a silent server may stay silent beyond the heartbeat timeout (its replacement's start)
    timeout: float = 60.0
    #: every PLAN sent to each server, in order
    plans: dict[str, list[Message]] = field(default_factory=dict)
    #: replacements that have yet to acknowledge these plans (by declaration seq)
    pending: dict[str, set[int]] = field(default_factory=dict)
    #: how many times each server was replaced
    incarnations: dict[str, int] = field(default_factory=dict)
    #: servers already said to be silent (logged once)
    silent: set[str] = field(default_factory=set)
    #: ps.replicas and ps.mirror_same_host: each holder gets its primaries' part of every PLAN
    replicas: int = 0
    same_host: bool = False
    #: where each server's state is mirrored: placed at the first call with every server's endpoints
    placement: Placement | None = None

    def _placed(self, endpoints: Sequence[Sequence[str]]) -> tuple[Placement, list[str]]:
        """The placement (made now from `endpoints` if there is none yet) and the servers' hosts now."""
        hosts = [endpoint_host(e) for e in endpoints]
        if self.placement is None:
            self.placement = Placement(holders(hosts, self.same_host, self.replicas), self.same_host)
        return self.placement, hosts

    def rebuild(self, holders_now: dict[int, list[int]]) -> None:
        """A standby that took over: the placement from what each server says its holders are now (ps.replicas;
        a server that moved before says so by holding none, and is held by the ones left)."""
        if self.enabled and self.replicas and holders_now:
            self.placement = Placement(dict(holders_now), self.same_host)

    def links(self, rank: int, endpoints: Sequence[Sequence[str]]) -> dict[str, list[int]]:
        """What server `rank`'s WELCOME says of its mirrors (meta `mirror`, {} without ps.replicas): `holders`,
        the ranks that hold its state, first the one that takes over; `holds`, the ranks whose state it holds."""
        if not (self.enabled and self.replicas):
            return {}
        placement, hosts = self._placed(endpoints)
        return {"holders": placement.holders(rank, hosts), "holds": placement.holds(rank, hosts)}

    def took_over(self, rank: int, before: Sequence[Sequence[str]], endpoints: Sequence[str]) -> int | None:
        """Server `rank`'s replacement registered at `endpoints`: the rank of the server whose host held its
        mirror when it came up there (the launcher started it on the holder's host: its own was lost). A server
        that came up on another host is moved: it holds no mirror from now on."""
        if not (self.enabled and self.replicas) or endpoint_host(endpoints) == endpoint_host(before[rank]):
            return None
        placement, hosts = self._placed(before)
        holder = next((h for h in placement.holders(rank, hosts) if hosts[h] == endpoint_host(endpoints)), None)
        placement.moved.add(rank)
        return holder

    def mirrored_by(self, endpoints: Sequence[Sequence[str]]) -> dict[int, list[int]]:
        """Holder rank -> the ranks of the servers it mirrors, from the servers' endpoints in rank order."""
        if not (self.enabled and self.replicas):
            return {}
        placement, hosts = self._placed(endpoints)
        return {holder: held for holder in range(len(hosts)) if (held := placement.holds(holder, hosts))}

    def sent(self, server: str, plan: Message) -> None:
        """Remember a PLAN sent to `server` or an aggregator (only with recovery on: plans are small, but not
        free)."""
        if self.enabled:
            self.plans.setdefault(server, []).append(plan)

    def replaced(self, server: str) -> list[Message]:
        """`server` registered again: the PLANs to send it; it is recovering until it acknowledged them."""
        self.incarnations[server] = self.incarnations.get(server, 0) + 1
        self.silent.discard(server)
        plans = self.plans.get(server, [])
        self.pending[server] = {int(msg.meta["seq"]) for msg in plans if msg.meta}
        return plans

    def recovering(self, server: str) -> bool:
        return server in self.pending

    def acked(self, server: str, seq: int) -> bool:
        """A recovering server acknowledged plan `seq`; True once it has acknowledged every one."""
        waiting = self.pending.get(server)
        if waiting is None:
            return False
        waiting.discard(seq)
        if waiting:
            return False
        del self.pending[server]
        return True

    def patience(self, role: str) -> float:
        """Extra seconds a silent node of `role` gets before the job fails (the start of a server's or an
        aggregator's replacement)."""
        return self.timeout if self.enabled and role in ("server", "aggregator") else 0.0

    def back(self, node_id: int, rank: int, name: str, endpoints: list[str], role: str = "server") -> Message:
        kind = Kind.SERVER_BACK if role == "server" else Kind.AGGREGATOR_BACK
        return Message(kind, sender=0, meta={
            "node_id": node_id, "rank": rank, "name": name, "endpoints": endpoints,
            "incarnation": self.incarnations.get(name, 0)})


#: the line the scheduler prints when a node falls silent: the launcher checks whether its host still answers
SILENT_PREFIX = "SLUICE_NODE_SILENT "
_SILENT_LINE = re.compile(rf"^{SILENT_PREFIX}(server|worker|aggregator) (\d+)$")


def report_silent(role: str, rank: int) -> None:
    """Say on stdout that `role` `rank` fell silent (its launcher may find its host lost before ssh does)."""
    with contextlib.suppress(OSError, ValueError):  # no stdout left: the launcher learns it from ssh
        print(f"{SILENT_PREFIX}{role} {rank}", flush=True)


def parse_silent(text: str) -> tuple[str, int] | None:
    """The (role, rank) a line of the scheduler's output says is silent; None for any other line."""
    match = _SILENT_LINE.match(text) if text.startswith(SILENT_PREFIX) else None
    return (match.group(1), int(match.group(2))) if match is not None else None
