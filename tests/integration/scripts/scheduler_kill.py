"""What a test script does to SIGKILL its job's scheduler from a worker, as a crash of the scheduler would."""

import os
import signal
from pathlib import Path


def kill_scheduler(step: int, rank: int = 0) -> None:
    """SIGKILL the scheduler of `rank` that the launcher of this worker started (0: the scheduler; k: its k-th
    standby)."""
    launcher = os.getppid()
    if b"sluice.launch.preloader" in Path(f"/proc/{launcher}/cmdline").read_bytes():  # forked by `--preload`'s
        launcher = int(Path(f"/proc/{launcher}/stat").read_text().rsplit(")", 1)[1].split()[1])
    for proc in Path("/proc").iterdir():
        try:
            environ = dict(item.split("=", 1) for item in (proc / "environ").read_text().split("\0") if "=" in item)
            parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if (environ.get("SLUICE_ROLE"), environ.get("SLUICE_RANK")) == ("scheduler", str(rank)) \
                and parent == launcher:
            os.kill(int(proc.name), signal.SIGKILL)
            print(f"killed the {'standby ' * bool(rank)}scheduler (pid {proc.name}) in step {step}", flush=True)
            return
    raise SystemExit(f"the scheduler of rank {rank} of this job not found")
