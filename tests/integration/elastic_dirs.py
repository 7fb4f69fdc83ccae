"""The committed-state directory an elastic job's launcher names, and the check that the job removed it.

By name, not by a glob of /dev/shm: tests running beside each other have directories of their own.
"""

from __future__ import annotations

import re
from pathlib import Path


def assert_state_dir_removed(output: str) -> None:
    named = re.findall(r"committed state in (/dev/shm/sluice-elastic-\d+-[0-9a-f]+)", output)
    assert named, "the launcher did not name the committed-state directory:\n" + output[:3000]
    left = [directory for directory in named if Path(directory).exists()]
    assert not left, f"the committed state outlived the job: {left}"
