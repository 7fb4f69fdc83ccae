"""The launcher's side of a standby scheduler (scheduler.standby): where it runs, what the end of either means.

A standby is another scheduler process (rank k >= 1) that waits for the nodes to rejoin it should
the scheduler fall silent (scheduler/standby.py); with several, the nodes rejoin the next when the
one they are on falls silent too. Each runs on another host than the scheduler when the job has one
(the hosts the launcher reaches over ssh or srun, in order), else beside it. Any of them may end
without ending the job while another runs: the scheduler killed or its host lost, the nodes rejoin
the first standby; a standby lost, the job goes on with the others. When the job ends under one of
them, the standbys that never took over are stopped at once.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from sluice.launch.blame import exit_description
from sluice.launch.children import Child
from sluice.launch.cluster import ClusterPlan
from sluice.launch.config import SluiceConfig


def standby_count(config: SluiceConfig, plan: ClusterPlan | None) -> int:
    """How many standby schedulers the job gets: scheduler.standby, or (-1) one when the job spans several hosts."""
    wanted = config.scheduler.standby
    if wanted == -1:
        return int(plan is not None and any(plan.is_remote(p.host) for p in plan.layout.processes))
    return wanted


def standby_hosts(plan: ClusterPlan | None, count: int, lost: Collection[str] = ()) -> list[str | None]:
    """Where `count` standbys run: the job's hosts that are not the launcher's machine nor `lost`, one each in
    the order the job lists them, round again when there are fewer (None: here, when there is none)."""
    hosts: list[str] = [] if plan is None else list(dict.fromkeys(
        p.host for p in plan.layout.processes if plan.is_remote(p.host) and p.host not in lost))
    return [hosts[k % len(hosts)] if hosts else None for k in range(count)]


class Schedulers:
    """The scheduler and its standbys, as the launcher watches them."""

    def __init__(self, primary: Child, standbys: Sequence[Child]) -> None:
        self.primary, self.standbys = primary, list(standbys)
        #: schedulers that ended while another carried the job on
        self.survived: list[Child] = []

    def survive(self, child: Child, code: int) -> str | None:
        """`child` ended with `code` != 0: the line to log when the job goes on without it; None when it cannot."""
        everyone = [self.primary, *self.standbys]
        left = [c for c in self.standbys if c is not child and not c.done.done()]
        if child not in everyone or not [c for c in everyone if c is not child and not c.done.done()]:
            return None
        self.survived.append(child)
        if child is self.primary:
            return (f"{child.name} {exit_description(code)}; the nodes rejoin the {left[0].name} once they find the "
                    "scheduler silent (scheduler.heartbeat_timeout)") if left else None
        going_on = (f"with {len(left)} standby schedulers" if len(left) > 1 else f"with the {left[0].name}" if left
                    else "without a standby scheduler")
        return f"{child.name} {exit_description(code)}; the job goes on {going_on}"

    def acting(self) -> Child:
        """The scheduler the nodes are on (that a restarted role registers with): the scheduler while it runs, else
        the first standby still running (the nodes rejoin them in order), else the scheduler."""
        if not self.primary.done.done():
            return self.primary
        return next((c for c in self.standbys if not c.done.done()), self.primary)

    def idle(self) -> list[Child]:
        """The standbys still running once the job ended under one scheduler (they never took over)."""
        everyone = [self.primary, *self.standbys]
        if not any(c.done.done() and c.returncode == 0 for c in everyone):
            return []
        return [c for c in self.standbys if not c.done.done()]
