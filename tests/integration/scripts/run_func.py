"""sluice.run called as Horovod's test/integration/test_interactiverun.py calls horovod.run (its functions, its
arguments): `happy` prints the two runs' results, `failed` what the run raised and after how long, `interrupt` how
a Ctrl-C ended it, `killed` its folder and workers for the test to kill it with SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

import sluice
import sluice.torch as hvd

QUICK = ["--preload", "torch,sluice.torch"]  # the workers fork from one process that imported torch


def fn(a: int, b: int, c: int, d: int) -> object:
    hvd.init()
    rank = hvd.rank()
    v = a + b + c + d
    res = hvd.allgather(torch.tensor([rank, v])).tolist()
    if rank == 0:
        return res
    elif rank == 1:
        return "ret_val_of_rank_1"
    else:
        return None


def failing() -> None:
    hvd.init()
    if hvd.rank() == 1:
        raise RuntimeError("rank 1 fails on purpose")
    time.sleep(120)  # the other worker waits: the job must be ended long before


def report_and_sleep() -> None:
    hvd.init()
    print(f"WORKER {os.getpid()} {sys.argv[1]}", flush=True)  # its pid, and the folder it runs from
    time.sleep(120)  # killed long before, with its caller


def workers() -> list[str]:
    """The pids of processes running a sluice.run worker."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if b"sluice.launch.run_task" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:  # it ended meanwhile
            pass
    return found


# the folders run() makes go into one of this process's own (its children's TMPDIR unchanged): counted apart from
# another test's
tempfile.tempdir = ours = tempfile.mkdtemp(prefix="sluice-run-test-")
if sys.argv[1] == "happy":
    res1 = sluice.run(fn, (1, 20), {"c": 300, "d": 4000}, num_proc=1, launch_args=QUICK)
    res2 = sluice.run(fn, (1, 20), {"c": 300, "d": 4000}, np=3, launch_args=QUICK)
    # elastic (horovodrun's --min-np): the first min_num_proc ranks' values, as Horovod's launch_gloo_elastic
    res3 = sluice.run(fn, (1, 20), {"c": 300, "d": 4000}, num_proc=2, min_num_proc=1,
                      launch_args=[*QUICK, "--log-level", "INFO"])  # the launcher's lines shown, as asked
    print("RESULTS " + json.dumps([res1, res2, res3]), flush=True)
elif sys.argv[1] == "interrupt":  # Ctrl-C in a terminal, or a notebook's interrupt, while the job runs
    # Python's own handler, as in a terminal: a background job of a shell without job control (a CI step's `&`)
    # starts with SIGINT ignored, and so would this process
    signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Timer(float(sys.argv[2]), os.kill, (os.getpid(), signal.SIGINT)).start()
    start = time.monotonic()
    try:
        sluice.run(time.sleep, (120,), num_proc=2, launch_args=QUICK)
    except KeyboardInterrupt:
        print(f"INTERRUPTED after {time.monotonic() - start:.1f} s, {len(workers())} workers left", flush=True)
elif sys.argv[1] == "killed":  # the test SIGKILLs this process while the job runs: nothing may be left
    print(f"OURS {ours}", flush=True)
    sluice.run(report_and_sleep, num_proc=2, launch_args=QUICK)
else:
    start = time.monotonic()
    try:
        sluice.run(failing, np=2, launch_args=QUICK)
    except RuntimeError as exc:
        print(f"RAISED after {time.monotonic() - start:.1f} s: {exc}", flush=True)
print(f"LEFT {len(list(Path(ours).iterdir()))} folders", flush=True)
Path(ours).rmdir()
