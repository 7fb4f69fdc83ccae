"""An elastic job's effects on its hosts: the committed-state directory, and the host discovery script run.

The rules they serve are launch/elastic.py's; launch/generations.py runs the discovery now and then
and names the directory, and launch/janitor.py removes it should the launcher be killed.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
from pathlib import Path

from sluice.launch.hosts import Host, HostsError, parse_host_list

#: longest a discovery script may run
DISCOVERY_TIMEOUT = 10.0


def state_dir() -> str:
    """A fresh directory name for the job's committed state, the same on every host (made there by the
    workers, mode 0700): on /dev/shm, memory that outlives a process but not the job."""
    return f"/dev/shm/sluice-elastic-{os.getuid()}-{secrets.token_hex(8)}"


def remove_state_dir(path: str) -> None:
    if Path(path).name.startswith("sluice-elastic-"):
        shutil.rmtree(path, ignore_errors=True)


async def discover(script: str) -> list[Host]:
    """The hosts the discovery script reports now; HostsError (with its output) when it fails."""
    proc = await asyncio.create_subprocess_exec(script, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE, start_new_session=True)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), DISCOVERY_TIMEOUT)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise HostsError(f"the host discovery script {script} ran over {DISCOVERY_TIMEOUT:g} s") from None
    if proc.returncode != 0:
        raise HostsError(f"the host discovery script {script} exited {proc.returncode}: "
                         f"{err.decode(errors='replace').strip()[-300:]}")
    lines = [line.strip() for line in out.decode(errors="replace").splitlines() if line.strip()]
    return parse_host_list(",".join(lines)) if lines else []
