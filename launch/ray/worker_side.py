"""What runs inside each Ray Train worker for Sluice: joining the job's environment, and leaving it.

Ray's workers are running processes when the backend starts, so the job secret cannot be an
inherited pipe as under `sluice launch`: it arrives as an argument of a call over Ray's own
connections (which already carry the training code), and this process puts it into a pipe of its
own whose descriptor SLUICE_SECRET_FD names. `hvd.init()` reads it from there and closes it, as
under `sluice launch`, so the secret never sits in the environment, a command line or a log.
"""

from __future__ import annotations

import contextlib
import os
from types import TracebackType

from ray.train.torch.config import TorchConfigContextManager

from sluice.errors import SluiceError
from sluice.scheduler.bootstrap import ENV_SECRET_FD, NodeEnv, secret_pipe
from sluice.worker.topology import placement


def node_address() -> str:
    """This process's node address, as Ray reports it (what peers on other nodes reach it at)."""
    import ray.util

    return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]  # Ray's own is untyped


def place_environ(node: NodeEnv, hosts: list[str], rank: int) -> dict[str, str]:
    """A worker's SLUICE_* variables and torchrun's, its local rank from the workers' nodes."""
    where = placement(hosts, rank)
    return {**node.to_environ(), "RANK": str(rank), "WORLD_SIZE": str(node.workers),
            "LOCAL_RANK": str(where.local_rank), "LOCAL_WORLD_SIZE": str(where.local_size)}


def join_job(environ: dict[str, str], secret: bytes) -> None:
    """Run in a Ray worker by the backend: the next hvd.init() in this process joins the job."""
    os.environ.update(environ)
    if not secret:  # transport.curve = false
        os.environ.pop(ENV_SECRET_FD, None)
        return
    secret_fd = secret_pipe(secret)
    os.set_inheritable(secret_fd, False)  # read here by hvd.init(); the worker's own subprocesses get nothing
    os.environ[ENV_SECRET_FD] = str(secret_fd)


def leave_job() -> None:
    """Close this worker's Sluice connection (its goodbye to the scheduler) if the training function did not.
    Never raises: a job that failed already has its error reported by the rank that caused it."""
    import sluice

    try:
        sluice.close_at_exit()
    except SluiceError:  # finishing this rank's updates failed with the job: close the connection regardless
        from sluice.worker.torch.state import STATE  # loaded already: close_at_exit() raised from it

        node, STATE.node = STATE.node, None
        if node is not None:
            with contextlib.suppress(SluiceError, OSError):
                node.close()


class SluiceContext(TorchConfigContextManager):
    """Wraps the training function on each worker: when it ends, this worker leaves the Sluice job at
    once, so that a failure on one rank fails the others' collectives promptly, naming it, instead of
    leaving them waiting for a rank that will not come."""

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> bool:
        leave_job()
        return bool(super().__exit__(kind, value, traceback))  # type: ignore[no-untyped-call]  # Ray's
