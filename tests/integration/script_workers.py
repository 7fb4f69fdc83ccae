"""A test script (tests/integration/scripts/) run by workers forked from the test process (testbed/cluster.py).

For the reference jobs a test compares a launched job against: the same script and settings, without the
fresh Python that imports torch for every worker of `sluice launch`.
"""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import sys
from pathlib import Path
from typing import Any

from sluice.launch.config import SluiceConfig
from testbed.cluster import LocalCluster
from tests.integration import prefork

prefork.torch_optimizers()  # once here, not in every forked worker


def run_script(path: str, *args: str) -> str:
    """In a forked worker: `path` run as __main__ with the command line `args`; what it printed."""
    printed = io.StringIO()
    saved, saved_path = sys.argv, list(sys.path)
    sys.argv = [path, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))  # as `python path` does: its modules beside it
    try:
        with contextlib.redirect_stdout(printed):
            runpy.run_path(path, run_name="__main__")
    finally:
        sys.argv, sys.path[:] = saved, saved_path
    return printed.getvalue()


def script_outputs(workers: int, servers: int, config: dict[str, Any], path: Path | str, *args: str,
                   timeout: float = 90, aggregators: int = 0) -> list[str]:
    """What each worker of a LocalCluster running the script printed, by rank; every process exited 0. The
    processes get every section of the config, defaults filled in, as `sluice launch` hands it over."""
    with LocalCluster(workers, servers, SluiceConfig.from_sections(config).to_sections(), aggregators) as cluster:
        printed = cluster.run(run_script, str(path), *args, timeout=timeout)
        assert cluster.wait() == [0] * (1 + servers + aggregators + workers)
    return list(printed)
