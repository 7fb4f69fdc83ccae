"""How soon N torch workers are up, and at what CPU: `sluice launch --preload` against torchrun and a plain launch."""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/launch_start.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    ROOT,
    TORCH_PRELOAD,
    add_common_options,
    free_port,
    print_table,
    progress,
    record,
    stats,
    write_json,
)

DESCRIPTION = """\
Each worker imports torch, builds an SGD optimizer (which imports torch._dynamo in torch 2.13), joins
its job, allreduces one number and leaves: what every torch training script does before its first
step (Sluice's workers through sluice.torch, torchrun's through torch.distributed with gloo).
Measured from the launcher's start to its exit: the wall time, and the CPU time of the launcher and
everything it started (each process reaped by its parent, so counted in getrusage's children).
  ours      sluice launch -s 0 --preload torch,torch._dynamo,sluice.torch: one process imports them and
            the workers are forked from it
  peer      torchrun --standalone --nproc-per-node N: a fresh Python per worker
  plain     sluice launch -s 0 without --preload (a fresh Python per worker, as torchrun)
The three alternate within each repeat; medians of --repeats. With --machines M, also M launchers at once, each
with N workers, as a job of M machines is started on each of them (here all on this one):
  ours      sluice launch --nnodes M --node-rank K --master-addr 127.0.0.1 --nproc-per-node N --secret-file F
            --preload ...
  peer      torchrun --nnodes M --node-rank K --master-addr 127.0.0.1 --nproc-per-node N (static rendezvous)
from the first launcher's start to the last one's exit.
"""

WORKER = """\
import sys
import torch
torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
if sys.argv[1] == "sluice":
    import sluice.torch as hvd
    hvd.init()
    hvd.allreduce(torch.ones(1))
    hvd.shutdown()
else:
    import torch.distributed as dist
    dist.init_process_group("gloo")
    dist.all_reduce(torch.ones(1))
    dist.destroy_process_group()
"""
PEER_NAME = "torchrun --standalone (a fresh Python per worker)"


def _commands(workers: int, script: str) -> dict[str, list[str]]:
    launch = [sys.executable, "-m", "sluice.launch.cli", "launch", "-w", str(workers), "-s", "0"]
    return {
        "ours": [*launch, "--preload", TORCH_PRELOAD, "--", sys.executable, script, "sluice"],
        "peer": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(workers),
                 script, "torch"],
        "plain": [*launch, "--", sys.executable, script, "sluice"],
    }


def machine_commands(machines: int, workers: int, script: str, port: int, secret: str) -> dict[str, list[list[str]]]:
    """Each side's launcher of each machine (machine 0 last), a job of `machines` x `workers` on MASTER_PORT `port`."""
    def ours(rank: int) -> list[str]:
        return [sys.executable, "-m", "sluice.launch.cli", "launch", "--nnodes", str(machines), "--node-rank",
                str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port), "--nproc-per-node", str(workers),
                "--secret-file", secret, "--preload", TORCH_PRELOAD, "--", sys.executable, script, "sluice"]

    def peer(rank: int) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(machines), "--node-rank", str(rank),
                "--master-addr", "127.0.0.1", "--master-port", str(port), "--nproc-per-node", str(workers), script,
                "torch"]

    ranks = [*range(1, machines), 0]
    return {"ours": [ours(rank) for rank in ranks], "peer": [peer(rank) for rank in ranks]}


def _run(*argvs: list[str]) -> tuple[float, float]:
    """(wall s, CPU s of them and their descendants) of launchers started together, to the last one's end."""
    before, began = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    running = [subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for argv in argvs]
    outputs = [proc.communicate(timeout=300)[0] for proc in running]
    wall, after = time.monotonic() - began, resource.getrusage(resource.RUSAGE_CHILDREN)
    for argv, proc, output in zip(argvs, running, outputs, strict=True):
        if proc.returncode != 0:
            raise SystemExit(f"{argv[:8]} exited {proc.returncode}:\n{output[-3000:]}")
    return wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="2,4", metavar="N,...", help="worker counts (default: %(default)s)")
    parser.add_argument("--machines", type=int, default=0, metavar="M",
                        help="also M launchers at once, one per machine as torchrun's --nnodes M, each with N "
                             "workers (default: %(default)s, none)")
    add_common_options(parser, "1 repeat of 3 workers (and of --machines M with 1 worker each, when given)",
                       repeats=5)
    args = parser.parse_args(argv)
    counts = [3] if args.quick else [int(n) for n in args.workers.split(",")]
    # torchrun's --nnodes adds its rendezvous and exit barrier (5-35 s here): not run by --quick unless asked
    machine_counts = [1] if args.quick else counts
    repeats = 1 if args.quick else args.repeats
    records, rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        script = str(Path(tmp) / "worker.py")
        Path(script).write_text(WORKER)
        for workers in counts:
            runs: dict[str, list[tuple[float, float]]] = {"ours": [], "peer": [], "plain": []}
            for repeat in range(repeats):
                for name, command in _commands(workers, script).items():
                    runs[name].append(_run(command))
                progress(f"{workers} workers, repeat {repeat + 1}/{repeats}: " + ", ".join(
                    f"{name} {wall:.2f} s / {cpu:.1f} CPU-s" for name, ((wall, cpu), *_) in
                    ((n, r[-1:]) for n, r in runs.items())))
            for index, (what, unit) in enumerate((("wall", "s"), ("cpu", "CPU-s"))):
                ours, peer, plain = (stats([run[index] for run in runs[n]]) for n in ("ours", "peer", "plain"))
                records.append(record(f"{what}-w{workers}", ours, peer, PEER_NAME, unit, better="lower",
                                      plain=plain.median, workers=workers, repeats=repeats))
                rows.append([f"{what}, {workers} workers", f"{ours.brief(2)} {unit}", f"{peer.brief(2)} {unit}",
                             f"{plain.median:.2f} {unit}", f"{peer.median / ours.median:.2f}x"])
        if args.machines > 1:
            secret = Path(tmp) / "secret"
            secret.write_bytes(os.urandom(32))
            secret.chmod(0o600)
            for workers in machine_counts:
                _per_machine(args.machines, workers, repeats, script, str(secret), records, rows)
    print_table(["measure", "sluice launch --preload", "torchrun", "sluice launch", "speedup"], rows)
    write_json(args.json, records)
    return 0


def _per_machine(machines: int, workers: int, repeats: int, script: str, secret: str, records: list[dict[str, Any]],
                 rows: list[list[str]]) -> None:
    runs: dict[str, list[tuple[float, float]]] = {"ours": [], "peer": []}
    for repeat in range(repeats):
        for name, argvs in machine_commands(machines, workers, script, free_port(), secret).items():
            runs[name].append(_run(*argvs))
        progress(f"{machines} machines x {workers} workers, repeat {repeat + 1}/{repeats}: " + ", ".join(
            f"{name} {r[-1][0]:.2f} s / {r[-1][1]:.1f} CPU-s" for name, r in runs.items()))
    for index, (what, unit) in enumerate((("wall", "s"), ("cpu", "CPU-s"))):
        ours, peer = (stats([run[index] for run in runs[n]]) for n in ("ours", "peer"))
        records.append(record(f"{what}-m{machines}-w{workers}", ours, peer, "torchrun --nnodes (static rendezvous)",
                              unit, better="lower", machines=machines, workers=workers, repeats=repeats))
        rows.append([f"{what}, {machines} launchers x {workers} workers", f"{ours.brief(2)} {unit}",
                     f"{peer.brief(2)} {unit}", "", f"{peer.median / ours.median:.2f}x"])


if __name__ == "__main__":
    sys.exit(main())
