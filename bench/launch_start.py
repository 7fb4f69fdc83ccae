"""How soon N torch workers are up, and at what CPU: `sluice launch --preload` against torchrun and a plain launch."""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/launch_start.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, TORCH_PRELOAD, add_common_options, print_table, progress, record, stats, write_json

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
The three alternate within each repeat; medians of --repeats.
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


def _run(argv: list[str]) -> tuple[float, float]:
    """(wall s, CPU s of it and its descendants) of one run to its end."""
    before, began = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    wall, after = time.monotonic() - began, resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{argv[:6]} exited {done.returncode}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="2,4", metavar="N,...", help="worker counts (default: %(default)s)")
    add_common_options(parser, "1 repeat of 3 workers", repeats=5)
    args = parser.parse_args(argv)
    counts = [3] if args.quick else [int(n) for n in args.workers.split(",")]
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
    print_table(["measure", "sluice launch --preload", "torchrun", "sluice launch", "speedup"], rows)
    write_json(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
