"""bench/recovery.py's cost cases on the network-namespace testbed: every process on its own host, shaped links.

With `bench/recovery.py --testbed` each job of a cost case runs as separate processes (scheduler,
servers, aggregators, workers: testbed/job.py's run_sluice_job) on testbed hosts: the scheduler on
an unshaped host, each server, aggregator and worker on a host of its own whose link is shaped to
--rate-mbit both ways. So with ps.replicas = 1 a server's mirror crosses two shaped links (its own and its holder's),
as between real hosts, and no ps.mirror_same_host is needed. Run as `python -m bench.recovery_testbed
--worker JOB`, this module is the worker program: it trains the case's job (JSON of bench/recovery.py's
Job) as a LocalCluster worker does and emits its timings.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/recovery_testbed.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from testbed.job import emit_result, run_sluice_job
from testbed.netbed import Netbed

SCHEDULER_HOST = "sched"


def servers_of(job: Any) -> list[str]:
    return [f"s{i}" for i in range(job.servers)]


def workers_of(job: Any) -> list[str]:
    return [f"w{i}" for i in range(job.workers)]


def aggregators_of(job: Any) -> list[str]:
    return [f"a{i}" for i in range(job.aggregators)]


@contextmanager
def testbed(rate_mbit: float, tos_bands: bool, servers: int, workers: int, aggregators: int = 0) -> Iterator[Netbed]:
    """A testbed with the hosts of the largest job: sched (unshaped), s0.., w0.., a0.. at `rate_mbit` each (with
    pfifo_fast's ToS bands under the shaper when `tos_bands`)."""
    with Netbed() as bed:
        bed.host(SCHEDULER_HOST)
        for prefix, count in (("s", servers), ("w", workers), ("a", aggregators)):
            for i in range(count):
                bed.host(f"{prefix}{i}", rate_mbit, tos_bands)
        yield bed


def run_testbed_job(bed: Netbed, job: Any, ps: dict[str, Any], timeout: float,
                    verbose: bool = False) -> list[float]:
    """One job of `job` (bench/recovery.py's Job) with these ps settings: ms per step of each timed repetition."""
    from bench.recovery import job_config

    argv = [sys.executable, "-m", "bench.recovery_testbed", "--worker", json.dumps(asdict(job))]
    results = run_sluice_job(bed, SCHEDULER_HOST, servers_of(job), workers_of(job), job_config(job, ps), argv,
                             timeout=timeout, env={"OMP_NUM_THREADS": "1"}, echo=verbose,
                             aggregators=aggregators_of(job))
    return [s / job.steps * 1000 for s in results[0]["seconds"]]


def worker_main(argv: list[str] | None = None) -> int:
    """A worker of a testbed job: train the job given as JSON, emit {"seconds", ...} (testbed/job.py)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worker", required=True, metavar="JOB", help="bench/recovery.py's Job as JSON")
    args = parser.parse_args(argv)
    import torch

    from bench.recovery import Job, train_worker
    from bench.train_throughput import demo

    torch.set_num_threads(1)
    job = Job(**json.loads(args.worker))
    x, y, _, _ = demo()[1]() if job.model == "digits" else (torch.zeros(0), torch.zeros(0), None, None)
    result = train_worker(job, x, y, "")  # no state tag: the files are the servers' hosts' business here
    emit_result(result)
    return 0


if __name__ == "__main__":
    sys.exit(worker_main())
