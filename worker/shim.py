"""What every framework shim does as it joins a job: Sluice's log lines shown, the [worker] settings read."""

from __future__ import annotations

import logging
import os

from sluice.worker.config import WorkerConfig
from sluice.worker.node import WorkerNode


def show_our_logs() -> None:
    """Our INFO lines (calibration, the priority map, metrics) reach stderr unless the script set up logging;
    `sluice launch --log-level`, `--log-with-timestamp` set the level and the time (launch/run_options.py)."""
    ours = logging.getLogger("sluice")
    if not logging.getLogger().handlers and not ours.handlers:
        handler = logging.StreamHandler()
        timed = "%(asctime)s " if os.environ.get("SLUICE_LOG_TIME") == "1" else ""
        handler.setFormatter(logging.Formatter(f"{timed}%(levelname)s %(name)s: %(message)s"))
        ours.addHandler(handler)
        level = os.environ.get("SLUICE_LOG_LEVEL", "INFO").upper()
        ours.setLevel(level if level in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL") else "INFO")


def worker_settings(node: WorkerNode) -> WorkerConfig:
    """The job's [worker] settings, as the node received them."""
    section = dict(node.env.section("worker"))
    if "priority_overrides" in section:  # a list in JSON, a tuple in the settings
        section["priority_overrides"] = tuple(section["priority_overrides"])
    return WorkerConfig(**section)
