"""Launching bench/pipeline.py's processes: a pipeline run on either side, or any commands at once."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from bench.common import ROOT, TORCH_PRELOAD, free_port

JOB = ROOT / "bench" / "pipeline_job.py"
RESULT = re.compile(r"PIPELINE_BENCH (\{.*\})$", re.M)


def run_processes(commands: list[tuple[list[str], dict[str, str]]], timeout: float) -> str:
    """Run the commands at once, each in its own process group; their output, or RuntimeError naming
    the first that failed (with its last lines; the others are killed at once rather than left to
    wait for it) or saying they ran past `timeout`."""
    with contextlib.ExitStack() as stack:
        files = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in commands]
        processes = [subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True) for (argv, env), out in zip(commands, files, strict=True)]
        deadline = time.monotonic() + timeout
        killed = set()
        try:
            while time.monotonic() < deadline:
                codes = [p.poll() for p in processes]  # every one polled: a failure ends the wait at once
                if all(code == 0 for code in codes) or any(codes):
                    break
                time.sleep(0.05)
        finally:
            for process in processes:
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
                    killed.add(process.pid)
        outputs = []
        for out in files:
            out.seek(0)
            outputs.append(out.read())
    failed = next((i for i, p in enumerate(processes) if p.returncode and p.pid not in killed), None)
    if failed is not None:
        raise RuntimeError(f"{' '.join(commands[failed][0])} exited {processes[failed].returncode}:\n"
                           f"{outputs[failed][-3000:]}")
    if killed:
        raise RuntimeError(f"{' '.join(commands[0][0][:6])} ... ran past {timeout:.0f} s: raise --timeout if the "
                           f"machine is this slow. Its output:\n{outputs[0][-3000:]}")
    return "\n".join(outputs)


def launch(side: str, stages: int, micro: int, schedule: str, args: argparse.Namespace,
           *job: str, virtual: int = 1) -> list[dict[str, Any]]:
    """One run of the pipeline on `side`: each process's PIPELINE_BENCH record, by stage."""
    argv = [sys.executable, str(JOB), "--side", side, "--stages", str(stages), "--micro", str(micro),
            "--schedule", schedule, "--virtual", str(virtual), *job]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if side == "sluice":
        commands = [([sys.executable, "-m", "sluice.launch.cli", "launch", "--preload", TORCH_PRELOAD, "-w",
                      str(stages), "-s", "0", "--", *argv],
                     env)]
    else:
        port = str(free_port())
        commands = [(argv, {**env, "RANK": str(rank), "WORLD_SIZE": str(stages), "MASTER_ADDR": "127.0.0.1",
                            "MASTER_PORT": port}) for rank in range(stages)]
    output = run_processes(commands, args.timeout)
    found = sorted((json.loads(m.group(1)) for m in RESULT.finditer(output)), key=lambda r: int(r["stage"]))
    if [r["stage"] for r in found] != list(range(stages)):
        raise RuntimeError(f"{side}: expected a result from each of {stages} stages, got:\n{output[-3000:]}")
    return found
