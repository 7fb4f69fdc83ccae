"""bench/replace_worker.py's lost-host case: a worker's whole host lost on the ssh testbed, no slot free for it.

Ours: `--elastic --in-place`, the survivors go on without it in their own processes (the job shrinks
in place); the peer: `--elastic`, every process of the job started again without it (torchrun's way).
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

from bench.common import ROOT
from testbed.ssh import SshBed, ssh_bed
from testbed.ssh import unavailable as ssh_unavailable

SCRIPT = "tests/integration/scripts/elastic_train.py"
#: steps rank 0 has ended before the host is taken away
BEFORE_LOSS = 4


@contextlib.contextmanager
def host_bed() -> Iterator[SshBed | None]:
    """The ssh testbed (the launcher, h1 and h2), or None with the reason printed when it cannot be built."""
    if reason := ssh_unavailable():
        print(f"lost-host: skipped, the ssh testbed is unavailable here: {reason}", file=sys.stderr)
        yield None
        return
    with TemporaryDirectory(prefix="replace-worker-ssh-") as keys, ssh_bed(Path(keys), ssh_hosts=2) as bed:
        yield bed


def lost_host_to_step(bed: SshBed, steps: int, in_place: bool, timeout: float) -> float:
    """One job of 3 workers (worker 0 on h2, workers 1 and 2 on h1) by allreduce; h2 is lost (every process
    in it killed, its link down) once rank 0 ended BEFORE_LOSS steps: seconds from the loss to the end of
    the next step the job trains."""
    h1, h2 = bed.hosts["h1"], bed.hosts["h2"]
    argv = [sys.executable, "-m", "sluice.launch.cli", "launch", *bed.ssh_options(), "-H", f"{h2}:1,{h1}:2",
            "-w", "3", "-s", "0", "--elastic", *(["--in-place"] if in_place else []), "--min-workers", "2", "--",
            sys.executable, SCRIPT, "--steps", str(steps), "--pause", "0.1", "--times"]
    job = bed.netbed.run("launcher", argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    going = threading.Event()

    def read() -> None:
        assert job.stdout is not None
        for line in iter(job.stdout.readline, ""):
            lines.append(line)
            if (found := re.search(r"ELASTIC_STEP (.*)$", line)) and json.loads(found.group(1))["step"] >= BEFORE_LOSS:
                going.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        if not going.wait(timeout):
            raise SystemExit("lost-host: the job did not train:\n" + "".join(lines)[-3000:])
        lost = time.time()
        bed.lose_host("h2")
        job.wait(timeout)
        reader.join(10)
    finally:
        bed.restore_link("h2")
        if job.poll() is None:
            job.kill()
    out = "".join(lines)
    steps_after: list[dict[str, Any]] = [s for m in re.finditer(r"ELASTIC_STEP (.*)$", out, re.M)
                                         if (s := json.loads(m.group(1)))["t"] > lost]
    if job.returncode != 0 or not steps_after:
        raise SystemExit(f"lost-host: the job failed ({job.returncode}) or trained no step after the loss:\n"
                         f"{out[-3000:]}")
    return float(steps_after[0]["t"] - lost)
