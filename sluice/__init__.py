"""Sluice: parameter-server and allreduce training with a priority network transport."""

import sys

__version__ = "0.1.0"


def close_at_exit() -> None:
    """What the interpreter's exit runs for Sluice's framework shims, for a process that ends with
    os._exit (a forked worker): sluice.torch keeps its connection after shutdown() until exit."""
    api = sys.modules.get("sluice.worker.torch.api")
    if api is not None:
        api._close()
