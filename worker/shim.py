"""What every framework shim does as it joins a job: Sluice's log lines shown, the [worker] settings read."""

from __future__ import annotations

import logging

from sluice.worker.config import WorkerConfig
from sluice.worker.node import WorkerNode


def show_our_logs() -> None:
    """Our INFO lines (calibration, the priority map, metrics) reach stderr unless the script set up logging."""
    ours = logging.getLogger("sluice")
    if not logging.getLogger().handlers and not ours.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        ours.addHandler(handler)
        ours.setLevel(logging.INFO)


def worker_settings(node: WorkerNode) -> WorkerConfig:
    """The job's [worker] settings, as the node received them."""
    section = dict(node.env.section("worker"))
    if "priority_overrides" in section:  # a list in JSON, a tuple in the settings
        section["priority_overrides"] = tuple(section["priority_overrides"])
    return WorkerConfig(**section)
