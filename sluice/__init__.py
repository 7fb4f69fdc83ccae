"""Sluice: parameter-server and allreduce training with a priority network transport."""

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sluice.launch.run_func import run as run

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """`sluice.run` (Horovod's `horovod.run`), imported when first used: every process of a job imports sluice."""
    if name == "run":
        from sluice.launch.run_func import run

        return run
    raise AttributeError(f"module 'sluice' has no attribute {name!r}")


def close_at_exit() -> None:
    """What the interpreter's exit runs for Sluice's framework shims, for a process that ends with
    os._exit (a forked worker): sluice.torch keeps its connection after shutdown() until exit."""
    api = sys.modules.get("sluice.worker.torch.api")
    if api is not None:
        api._close()
