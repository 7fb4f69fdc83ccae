"""What the timeline costs: training throughput with `sluice launch --timeline` against the same job without it.

The job is examples/horovod/pytorch_synthetic_benchmark.py (a ResNet with SyncBatchNorm on synthetic
images), by allreduce (-s 0) and through parameter servers (-s 2, collective.mode = ps: every fused
group's round is traced at both ends); runs with and without the timeline alternate, and the table
quotes the median of the repeats. Target: the timeline costs at most 5% of throughput.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/timeline_cost.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, TORCH_PRELOAD, add_common_options, print_table, progress, record, stats, write_json

SCRIPT = ROOT / "examples" / "horovod" / "pytorch_synthetic_benchmark.py"
CASES = {"allreduce": ["-s", "0"], "ps": ["-s", "2", "--set", "collective.mode=ps"]}
TARGET_COST = 0.05
_TOTAL = re.compile(r"\[worker 0\] Total img/sec on \d+ CPU\(s\): ([0-9.]+)")


def run_job(case: str, timeline: Path | None, args: argparse.Namespace) -> float:
    """One launched job; its total images per second."""
    argv = [sys.executable, "-m", "sluice.launch.cli", "launch", "--preload", TORCH_PRELOAD, "-w", str(args.workers),
            *CASES[case]]
    if timeline is not None:
        argv += ["--timeline", str(timeline)]
    argv += ["--", sys.executable, str(SCRIPT), "--sync-bn", "--batch-size", str(args.batch_size),
             "--num-iters", str(args.iters), "--num-batches-per-iter", str(args.batches)]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    found = _TOTAL.search(done.stdout)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"the {case} job failed (exit {done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return float(found.group(1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2, help="workers per job (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=16, help="images per worker per step (default: %(default)s)")
    parser.add_argument("--iters", type=int, default=4, help="timed iterations per job (default: %(default)s)")
    parser.add_argument("--batches", type=int, default=6, help="steps per iteration (default: %(default)s)")
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=sorted(CASES),
                        help="which jobs (default: all)")
    add_common_options(parser, "one repeat of the allreduce case, 1 iteration of 2 steps of batch 8", repeats=5)
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.iters, args.batches, args.batch_size, args.cases = 1, 1, 2, 8, ["allreduce"]
    records, rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases:
            on: list[float] = []
            off: list[float] = []
            events = 0
            for repeat in range(args.repeats):
                progress(f"{case}: repeat {repeat + 1}/{args.repeats}, without and with the timeline ...")
                off.append(run_job(case, None, args))
                path = Path(tmp) / f"{case}.{repeat}.json"
                on.append(run_job(case, path, args))
                events = path.read_text().count('"ph"')
            with_tl, without = stats(on), stats(off)
            cost = 1 - with_tl.median / without.median
            records.append(record(f"timeline-{case}", with_tl, without, "the same job without the timeline",
                                  "img/s", cost=cost, events_per_job=events, target_cost=TARGET_COST,
                                  met=cost <= TARGET_COST, workers=args.workers, repeats=args.repeats))
            rows.append([f"timeline-{case}", with_tl.brief(1), without.brief(1), f"{cost * 100:+.1f}%", str(events),
                         "met" if cost <= TARGET_COST else "MISSED"])
    print_table(["case", "img/s with timeline", "img/s without", "cost", "events", "target <= 5%"], rows)
    write_json(args.json, records)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
