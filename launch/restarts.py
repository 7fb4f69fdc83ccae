"""torchrun's --max-restarts for a job of one launcher: when a process fails, every process stops and the job
starts again, up to N times, each worker told which start it is (TORCHELASTIC_RESTART_COUNT), as torchrun does.

torchrun restarts its whole worker group whenever a worker fails (not when it is stopped by a signal sent to
torchrun), and a script resumes from its own checkpoint; so here the whole job starts again: scheduler,
servers and workers (servers keep nothing across a restart, as a new torchrun worker group keeps nothing).
An elastic job (--elastic) re-forms instead (launch/generations.py), where --max-restarts counts re-formings.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence

from sluice.launch.children import Child
from sluice.launch.cluster import ClusterPlan
from sluice.launch.config import SluiceConfig
from sluice.launch.run_options import RunOptions
from sluice.launch.spawner import KeptPreloader
from sluice.launch.supervisor import Job
from sluice.launch.torchrun_env import ENV_MAX_RESTARTS, ENV_RESTART_COUNT


def max_restarts(given: int | None, environ: Mapping[str, str]) -> int:
    """--max-restarts, else torchrun's PET_MAX_RESTARTS, else 0; ValueError for a count below 0."""
    raw = str(given) if given is not None else environ.get("PET_MAX_RESTARTS", "0")
    if not raw.isdigit():
        raise ValueError(f"--max-restarts {raw}: give the number of restarts, 0 or more")
    return int(raw)


class Attempt(Job):
    """One start of a restarting job: the preloader (--preload) stays for the next start when this one fails."""

    def __init__(self, config: SluiceConfig, workers: int, servers: int, command: Sequence[str], grace: float,
                 ready_timeout: float, aggregators: int, plan: ClusterPlan | None, options: RunOptions | None,
                 restart: int, limit: int) -> None:
        env = {ENV_RESTART_COUNT: str(restart), ENV_MAX_RESTARTS: str(limit)}
        super().__init__(config, workers, servers, command, grace, ready_timeout, sys.stdout.buffer, sys.stderr,
                         aggregators, plan, env, options)
        self.restart, self.limit = restart, limit
        #: the process whose failure ended this start (None: it ended otherwise)
        self.failure: Child | None = None

    def hands_over_preloader(self) -> bool:
        return self.restart < self.limit and self.failure is not None and not self.interrupted.done()

    async def _failed(self, first: Child) -> int:
        self.failure = first
        return await super()._failed(first)


async def restarting(config: SluiceConfig, workers: int, servers: int, command: Sequence[str], grace: float,
                     ready_timeout: float, aggregators: int, plan: ClusterPlan | None, limit: int,
                     options: RunOptions | None) -> int:
    """Start the job, and again after each failure of one of its processes, up to `limit` restarts; the launcher's
    exit code (the last start's)."""
    kept, restart = KeptPreloader(), 0
    try:
        while True:
            job = Attempt(config, workers, servers, command, grace, ready_timeout, aggregators, plan, options, restart,
                          limit)
            code = await kept.run(job.spawner, job.run())
            if code == 0 or job.failure is None or job.interrupted.done():
                return code
            if restart == limit:
                job.complain(f"the job failed after {limit} restart{'s' * (limit != 1)} (--max-restarts {limit}); "
                             "ending it")
                return code
            restart += 1
            job.say(f"restarting every process of the job: start {restart + 1} of at most {limit + 1} "
                    f"(--max-restarts {limit}; the workers see {ENV_RESTART_COUNT}={restart})")
    finally:
        await kept.close()
