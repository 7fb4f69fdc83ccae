"""The launcher's side of a standby scheduler (scheduler.standby): where it runs, what the end of either means.

The standby is a second scheduler process (rank 1) that waits for the nodes to rejoin it should
the scheduler fall silent (scheduler/standby.py). It runs on another host than the scheduler when
the job has one (the first host the launcher reaches over ssh or srun), else beside it. Either one may
end without ending the job while the other runs: the scheduler killed or its host lost, the nodes
rejoin the standby; the standby lost, the job goes on without one. When the job ends under the
scheduler, the standby, which never took over, is stopped at once.
"""

from __future__ import annotations

from collections.abc import Collection

from sluice.launch.blame import exit_description
from sluice.launch.children import Child
from sluice.launch.cluster import ClusterPlan
from sluice.launch.config import SluiceConfig


def standby_wanted(config: SluiceConfig, plan: ClusterPlan | None) -> bool:
    """Whether the job gets a standby scheduler: scheduler.standby, or (-1) when the job spans several hosts."""
    wanted = config.scheduler.standby
    if wanted == -1:
        return plan is not None and any(plan.is_remote(p.host) for p in plan.layout.processes)
    return wanted == 1


def standby_host(plan: ClusterPlan | None, lost: Collection[str] = ()) -> str | None:
    """Where the standby runs: the first host of the job that is not the launcher's machine nor `lost` (None:
    here)."""
    if plan is None:
        return None
    return next((p.host for p in plan.layout.processes if plan.is_remote(p.host) and p.host not in lost), None)


class Schedulers:
    """The scheduler and its standby, as the launcher watches them."""

    def __init__(self, primary: Child, standby: Child | None) -> None:
        self.primary, self.standby = primary, standby
        #: schedulers that ended while the other carried the job on
        self.survived: list[Child] = []

    def survive(self, child: Child, code: int) -> str | None:
        """`child` ended with `code` != 0: the line to log when the job goes on without it; None when it cannot."""
        other = self.standby if child is self.primary else self.primary if child is self.standby else None
        if other is None or other.done.done():
            return None
        self.survived.append(child)
        if child is self.primary:
            return (f"{child.name} {exit_description(code)}; the nodes rejoin the {other.name} once they find the "
                    "scheduler silent (scheduler.heartbeat_timeout)")
        return f"{child.name} {exit_description(code)}; the job goes on without a standby scheduler"

    def idle(self) -> Child | None:
        """The standby, if the job ended under the scheduler and the standby still runs (it never took over)."""
        standby = self.standby
        if standby is None or standby.done.done() or not self.primary.done.done() or self.primary.returncode != 0:
            return None
        return standby
