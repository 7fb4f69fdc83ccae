"""bench/replace_worker.py's lost-host case: a worker's whole host lost on the ssh testbed, no slot free for it.

Ours: `--elastic --in-place`, the survivors go on without it in their own processes (the job shrinks
in place); the peer: `--elastic`, every process of the job started again without it (torchrun's way).
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

from testbed.host_loss import lose_host_in_job
from testbed.ssh import SshBed

SCRIPT = "tests/integration/scripts/elastic_train.py"
#: steps rank 0 has ended before the host is taken away (one digit: a regular expression matches it)
BEFORE_LOSS = 4


def lost_host_to_step(bed: SshBed, steps: int, in_place: bool, timeout: float) -> float:
    """One job of 3 workers (worker 0 on h2, workers 1 and 2 on h1) by allreduce; h2 is lost (every process
    in it killed, its link down) once rank 0 ended BEFORE_LOSS steps: seconds from the loss to the end of
    the next step the job trains."""
    h1, h2 = bed.hosts["h1"], bed.hosts["h2"]
    args = ["-H", f"{h2}:1,{h1}:2", "-w", "3", "-s", "0", "--elastic", *(["--in-place"] if in_place else []),
            "--min-workers", "2", "--", sys.executable, SCRIPT, "--steps", str(steps), "--pause", "0.1", "--times"]
    loss = lose_host_in_job(bed, args, "h2", rf'ELASTIC_STEP {{"step": ([{BEFORE_LOSS}-9]|\d\d+),', start_s=timeout,
                            end_s=timeout)
    steps_after: list[dict[str, Any]] = [s for m in re.finditer(r"ELASTIC_STEP (.*)$", loss.out, re.M)
                                         if (s := json.loads(m.group(1)))["t"] > loss.lost_at]
    if loss.returncode != 0 or not steps_after:
        raise SystemExit(f"lost-host: the job failed ({loss.returncode}) or trained no step after the loss:\n"
                         f"{loss.out[-3000:]}")
    return float(steps_after[0]["t"] - loss.lost_at)
