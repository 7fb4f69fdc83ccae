"""How soon a job that lost a worker trains again: replaced in place (--in-place) against every process restarted."""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/replace_worker.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, TORCH_PRELOAD, add_common_options, print_table, progress, record, stats, write_json
from bench.replace_worker_host import BEFORE_LOSS, lost_host_to_step
from testbed.host_loss import host_bed
from testbed.ssh import SshBed

SCRIPT = "tests/integration/scripts/elastic_train.py"
#: case -> (servers, seconds each worker process spends setting up before hvd.init())
CASES = {"allreduce": ("0", 0.0), "ps": ("1", 0.0), "ps-setup-3s": ("1", 3.0)}
#: on the ssh testbed (bench/replace_worker_host.py): a worker's host lost and no slot free, so the job shrinks
LOST_HOST = "lost-host-shrink"
PEER_NAME = "sluice launch --elastic: every process restarted (torchrun's way)"
DESCRIPTION = """\
A job of W workers (tests/integration/scripts/elastic_train.py, Horovod's elastic shape, committing
after every step) loses worker W-1, which SIGKILLs itself after step K. Measured: seconds from that
loss to the end of the first step after it (step K+1, trained again from commit K+1), with
`sluice launch --elastic --in-place` (ours: a new worker in the lost one's slot, the others re-form in
their own processes, the scheduler and servers started again) against `--elastic` (the peer: every
process of the job stopped and started again, as torchrun's elastic agent does). Both in the same
run, alternating, median of --repeats. Cases: allreduce (-s 0) and ps (-s 1); ps-setup-3s: each worker
process first spends 3 s as a real one does once (its dataset read, a CUDA context, data loader
processes; here a sleep), which a replaced-in-place survivor does not spend again. lost-host-shrink (on
the ssh testbed, root): 3 workers by allreduce, worker 0 alone on host h2 and workers 1 and 2 on h1
with no slot free; h2 is lost (every process in it killed, its link down) after rank 0's step 4:
seconds from the loss to the end of the next step; ours: the survivors go on as a job of 2 in their
own processes (--in-place), the peer: both restarted (--elastic)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", choices=[*CASES, LOST_HOST], default=[*CASES, LOST_HOST],
                        help="which routes to measure (default: all)")
    parser.add_argument("--workers", type=int, default=3, metavar="W", help="workers (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=16, metavar="N", help="steps of each job (default: %(default)s)")
    parser.add_argument("--die-at", type=int, default=8, metavar="K",
                        help="the last worker dies after this step (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=180.0, metavar="SECONDS",
                        help="one job's limit (default: %(default)s)")
    parser.add_argument("--preload", action="store_true",
                        help=f"both jobs run with `sluice launch --preload {TORCH_PRELOAD}`: a worker, the replacement "
                             "included, is forked from a process that imported them once (not on the ssh testbed)")
    add_common_options(parser, "one repeat of the ps case, 2 workers, 4 steps, the loss after step 1", repeats=5)
    args = parser.parse_args(argv)
    if args.quick:
        args.cases, args.workers, args.steps, args.die_at, args.repeats = ["ps"], 2, 4, 1, 1
    return args


def loss_to_step(args: argparse.Namespace, case: str, in_place: bool) -> float:
    """One job: seconds from the worker's loss to the end of the next step trained after it."""
    servers, setup = CASES[case]
    argv = [sys.executable, "-m", "sluice.launch.cli", "launch", "--elastic", *(["--in-place"] if in_place else []),
            *(["--preload", TORCH_PRELOAD] if args.preload else []), "-w", str(args.workers), "-s", servers, "--",
            sys.executable, SCRIPT, "--steps", str(args.steps),
            "--die-at", str(args.die_at), "--die-rank", str(args.workers - 1), "--times", "--setup", str(setup)]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise SystemExit(f"the job failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
    died = [json.loads(m.group(1))["t"] for m in re.finditer(r"ELASTIC_DIE (.*)$", done.stdout, re.M)]
    steps: list[dict[str, Any]] = [json.loads(m.group(1)) for m in re.finditer(r"ELASTIC_STEP (.*)$", done.stdout,
                                                                              re.M)]
    after = [s["t"] for s in steps if s["step"] == args.die_at + 1 and died and s["t"] > died[0]]
    if len(died) != 1 or not after:
        raise SystemExit(f"no loss or no step after it in the job's output:\n{done.stdout[-3000:]}")
    return float(after[0] - died[0])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    records, rows = [], []
    with host_bed("lost-host") if LOST_HOST in args.cases else contextlib.nullcontext() as bed:
        for case in args.cases:
            if case == LOST_HOST and bed is None:
                continue
            records.append(measure(args, case, bed))
            rows.append([case, f"{records[-1]['ours']:.2f}", f"{records[-1]['peer']:.2f}",
                         f"{records[-1]['speedup']:.2f}x"])
    print_table(["case", "in place (s)", "every process restarted (s)", "speedup"], rows)
    write_json(args.json, records)
    return 0


def measure(args: argparse.Namespace, case: str, bed: SshBed | None) -> dict[str, Any]:
    ours: list[float] = []
    peer: list[float] = []
    for repeat in range(args.repeats):
        for in_place in (True, False) if repeat % 2 == 0 else (False, True):
            if case == LOST_HOST:
                assert bed is not None
                seconds = lost_host_to_step(bed, max(args.steps, 3 * BEFORE_LOSS), in_place, args.timeout)
            else:
                seconds = loss_to_step(args, case, in_place)
            (ours if in_place else peer).append(seconds)
        progress(f"{case}: repeat {repeat + 1}/{args.repeats}: in place {ours[-1]:.2f} s, every process "
                 f"restarted {peer[-1]:.2f} s")
    return record(case, stats(ours), stats(peer), PEER_NAME, "s", "lower", workers=3 if case == LOST_HOST else
                  args.workers, die_at=args.die_at, steps=args.steps, preload=args.preload and case != LOST_HOST)


if __name__ == "__main__":
    raise SystemExit(main())
