"""Horovod's `horovod.runner` for `from sluice.runner import run`: run(func, ...) on this host's workers."""

from sluice.launch.run_func import run

__all__ = ["run"]
