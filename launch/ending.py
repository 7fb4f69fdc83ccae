"""How a job ends: the first cause of a failure named, the roles given time to leave, every child stopped.

The part of the launcher's Job (launch/supervisor.py) that runs once the job is over or has failed:
`_failed` names the first cause (launch/blame.py) and shows the last lines of it and of the first to
exit; `_wind_down` gives the scheduler and servers `grace` seconds to leave by themselves after the
workers finished; `stop_all` stops and reaps every child.
"""

from __future__ import annotations

import asyncio
import signal
from typing import Any

from sluice.launch.blame import Watched, exit_description, find, first_report, judge, state_description
from sluice.launch.children import Child
from sluice.launch.standby import Schedulers

#: seconds between SIGTERM and SIGKILL when stopping a process group
STOP_TIMEOUT = 3.0
#: after a child exits non-zero, how long the launcher keeps reading before it names the first cause:
#: the report of what started the failure, and the exits it caused, may arrive a moment later
SETTLE_SECONDS = 0.5


class Ending:
    """What Job (launch/supervisor.py) does at its end; it holds these attributes and says things."""

    children: list[Child]
    interrupted: asyncio.Future[int]
    kill_now: asyncio.Event
    stopping: bool
    grace: float
    schedulers: Schedulers | None

    def say(self, text: str, debug: bool = False) -> None:
        raise NotImplementedError

    def complain(self, text: str) -> None:
        raise NotImplementedError

    @staticmethod
    def _context(child: Watched) -> str:
        return " while workers were still running" if child.role != "worker" else ""

    async def _failed(self, first: Child) -> int:
        """`first` exited non-zero while workers ran: name the first cause (launch/blame.py) and show the
        last lines of it and of `first`; the launcher's exit code."""
        code = first.returncode
        assert code is not None
        if code > 0:  # a consequence, maybe: the report of its cause may be a moment behind
            await asyncio.wait([self.interrupted], timeout=SETTLE_SECONDS)
            await self._let_culprit_settle()
        verdict = judge(first, self.children, self._context)
        self.complain(f"{verdict.headline}; stopping the job")
        cause = next((c for c in self.children if c is verdict.cause and c is not first), None)
        if cause is not None:
            self.complain(f"then {first.name} {exit_description(code)}{self._context(first)}")
        for child in (cause, first):
            if child is first or (child is not None and child.tail):
                self.complain(f"last lines of {child.label}:\n{child.last_lines()}")
        return code if code > 0 and first.role == "worker" else 1

    async def _let_culprit_settle(self) -> None:
        """A culprit still running may be on its way out (a worker that left early, still closing):
        give it SETTLE_SECONDS more, so that the report says how it ended."""
        report = first_report(self.children)
        named = find(self.children, report[1]) if report is not None else None
        child = next((c for c in self.children if c is named), None)
        if child is None or child.proc.returncode is not None or state_description(child).startswith("is stopped"):
            return
        exited = asyncio.ensure_future(child.proc.wait())
        await asyncio.wait([exited, self.interrupted], timeout=SETTLE_SECONDS)
        exited.cancel()

    async def _wind_down(self, roles: list[Child]) -> int:
        """The workers are done: give the scheduler and servers `grace` seconds to leave by themselves."""
        if self.schedulers is not None:  # a standby that never took over has nothing to end; a scheduler
            idle = self.schedulers.idle()  # that ended while another went on was told of
            for child in idle:
                child.stop()
            roles = [c for c in roles if c not in idle and c not in self.schedulers.survived]
        pending: set[asyncio.Future[Any]] = {child.done for child in roles}
        deadline = asyncio.get_running_loop().time() + self.grace
        while pending and not self.interrupted.done():
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                break
            watched: list[asyncio.Future[Any]] = [*pending, self.interrupted]
            _, pending = await asyncio.wait(watched, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            pending.discard(self.interrupted)
        if self.interrupted.done():
            return self.interrupted.result()
        for child in roles:
            code = child.returncode
            if code is None:
                self.say(f"stopping {child.name}, still running {self.grace:g} s after the workers finished")
            elif code != 0:
                self.complain(f"warning: {child.name} {exit_description(code)} after the workers finished")
        return 0

    async def stop_all(self) -> None:
        """SIGTERM every child's group, SIGKILL after STOP_TIMEOUT, and reap them all."""
        self.stopping = True
        await self.stop_children(self.children)
        for child in self.children:
            child.pump.cancel()

    async def stop_children(self, children: list[Child]) -> int:
        """SIGTERM `children`'s groups, SIGKILL those still there after STOP_TIMEOUT (or a second Ctrl-C),
        and reap them; how many needed the SIGKILL."""
        for child in children:
            child.stop()
        waiting = [child.done for child in children if not child.done.done()]
        if waiting:
            kill_now: asyncio.Future[Any] = asyncio.create_task(self.kill_now.wait())
            exited: asyncio.Future[Any] = asyncio.gather(*waiting)
            await asyncio.wait([exited, kill_now], timeout=STOP_TIMEOUT, return_when=asyncio.FIRST_COMPLETED)
            kill_now.cancel()
        killed = sum(not child.done.done() for child in children)
        for child in children:
            child.signal_group(signal.SIGKILL)
        await asyncio.gather(*(child.done for child in children), return_exceptions=True)
        return killed
