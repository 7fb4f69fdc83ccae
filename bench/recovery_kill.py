"""bench/recovery.py's resume-after-kill case: a launched job whose server 0 is SIGKILLed, its steps time-stamped.

Run as a script (by `sluice launch`, one copy per worker) it trains the digits model of
examples/train_digits.py with Adam on the servers, each worker on its own shard (model and data
from a file the driver wrote: the workers need not import scikit-learn, seconds on a busy host). After every step it
waits for the updated parameters (hvd.synchronize_parameters), so a step's timestamp is the moment it
is done. Rank 0 prints `RECOVERY_STEP i T` after step i (T: time.monotonic(), one clock for every
process on the host), and with --kill-at K it SIGKILLs server 0 at the start of step K, printing
`RECOVERY_KILL T` just before: every round of step K on server 0 then needs the replacement, so the
end of step K is when training resumed. (Killed after the backward pass instead, as
tests/integration/test_recovery.py does to have pushes in flight, the dying server may still answer
that step, and the stall lands in step K or K+1 by chance.) Every rank ends with `RECOVERY_RESULT
{json}`: a SHA-256 of its final parameters' bytes, so runs with and without the kill compare bit for bit.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

if __package__ in (None, ""):  # run as `python bench/recovery_kill.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

from bench.common import ROOT, TORCH_PRELOAD, progress, record, stats
from bench.train_throughput import demo, worker_batches

_STEP = re.compile(r"RECOVERY_STEP (\d+) ([0-9.]+)")
_KILL = re.compile(r"RECOVERY_KILL ([0-9.]+)")
_RESULT = re.compile(r"RECOVERY_RESULT (\{.*\})")
_RESTART = re.compile(r"server 0 \(pid \d+\) was killed by SIGKILL; restarting it")
_BACK = re.compile(r"server 0 \(node \d+, pid \d+\) is back")


# ---------------------------------------------------------------------------- inside each worker
def find_server(rank: int) -> int:
    """The pid of server `rank` of this job (by its SLUICE_* variables), looked up before the timed steps."""
    mine = os.environ["SLUICE_SCHEDULER"]
    for proc in Path("/proc").iterdir():
        try:
            environ = dict(item.split("=", 1) for item in (proc / "environ").read_text().split("\0") if "=" in item)
            cmdline = (proc / "cmdline").read_text()
        except (OSError, ValueError):  # not ours to read, or gone meanwhile
            continue
        if (environ.get("SLUICE_ROLE"), environ.get("SLUICE_RANK"), environ.get("SLUICE_SCHEDULER")) == (
                "server", str(rank), mine) and "sluice.launch.cli" in cmdline:
            return int(proc.name)
    raise SystemExit(f"server {rank} of this job not found in /proc: is it running on another host?")


def worker_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="torch.save'd {model, x, y} (kill_record writes it)")
    parser.add_argument("--steps", type=int, default=60, help="training steps (default: %(default)s)")
    parser.add_argument("--kill-at", type=int, default=-1, metavar="K",
                        help="rank 0 SIGKILLs server 0 as step K starts; -1: no kill (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=16, help="samples per worker per step (default: %(default)s)")
    args = parser.parse_args(argv)
    import sluice.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    saved = torch.load(args.data, weights_only=False)  # our own file, just written: torch's classes only
    model, x, y = saved["model"], saved["x"], saved["y"]
    optimizer = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.001),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    images, labels = worker_batches(x, y, rank, size, args.batch_size, args.steps)
    victim = find_server(0) if rank == 0 and args.kill_at >= 0 else 0
    hvd.barrier(name="start")
    for step in range(args.steps):
        if step == args.kill_at and rank == 0:
            print(f"RECOVERY_KILL {time.monotonic():.6f}", flush=True)
            os.kill(victim, signal.SIGKILL)
        optimizer.zero_grad()
        F.cross_entropy(model(images[step]), labels[step]).backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        hvd.synchronize_parameters()  # the step is done once its parameters are: a clean timestamp
        if rank == 0:
            print(f"RECOVERY_STEP {step} {time.monotonic():.6f}", flush=True)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
    print("RECOVERY_RESULT " + json.dumps({"rank": rank, "digest": digest}), flush=True)
    hvd.shutdown()
    return 0


# ---------------------------------------------------------------------------- the driver's side
def launch(args: argparse.Namespace, data: Path, kill_at: int) -> list[tuple[float, str]]:
    """One `sluice launch` job; every line of its output with the time.monotonic() this process read it at."""
    argv = [sys.executable, "-m", "sluice.launch.cli", "launch", "--preload", TORCH_PRELOAD, "-w",
            str(args.kill_workers), "-s", str(args.servers), "--set", "collective.mode=ps", "--set",
            "ps.recover=true", "--set", "worker.optimizer_on=server", "--", sys.executable,
            str(Path(__file__).resolve()), "--data", str(data), "--steps", str(args.kill_steps), "--kill-at",
            str(kill_at), "--batch-size", str(args.batch_size)]
    process = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    lines: list[tuple[float, str]] = []  # list.append is atomic: the two readers share it

    def pump(stream: IO[str]) -> None:
        for line in stream:
            lines.append((time.monotonic(), line.rstrip("\n")))

    readers = [threading.Thread(target=pump, args=(s,), daemon=True) for s in (process.stdout, process.stderr)]
    for reader in readers:
        reader.start()
    try:
        code = process.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        code = None
    finally:  # nothing the job started outlives it
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    for reader in readers:
        reader.join(5.0)
    lines.sort()
    if code != 0:
        tail = "\n".join(line for _, line in lines[-40:])
        ran = f"ran past {args.timeout:.0f} s" if code is None else f"exited {code}"
        raise RuntimeError(f"the {'killed' if kill_at >= 0 else 'reference'} job {ran}:\n{tail}")
    return lines


def digest_of(lines: list[tuple[float, str]], workers: int) -> str:
    """The final parameters' digest, the same on every worker (else an error naming them)."""
    found = [str(json.loads(m.group(1))["digest"]) for _, line in lines if (m := _RESULT.search(line))]
    if len(found) != workers or len(set(found)) != 1:
        raise RuntimeError(f"expected {workers} RECOVERY_RESULT lines agreeing, got {len(found)} with "
                           f"{len(set(found))} digests")
    return found[0]


def first(lines: list[tuple[float, str]], pattern: re.Pattern[str], what: str) -> tuple[float, re.Match[str]]:
    for read, line in lines:
        if m := pattern.search(line):
            return read, m
    raise RuntimeError(f"the killed job never printed {what}")


def analyse(lines: list[tuple[float, str]], kill_at: int) -> dict[str, float]:
    """Seconds from the kill to step K's end (recovery), the launcher's and scheduler's lines; a normal step."""
    ends = {int(m.group(1)): float(m.group(2)) for _, line in lines if (m := _STEP.search(line))}
    killed = float(first(lines, _KILL, "RECOVERY_KILL")[1].group(1))
    # steps 0 and 1 build the priority map and settle; the kill is in K's time, and may spill into K+1's
    normal = statistics.median(ends[i] - ends[i - 1] for i in range(2, len(ends)) if i not in (kill_at, kill_at + 1))
    return {"recovery_s": ends[kill_at] - killed, "normal_s": normal,
            "lost_s": ends[kill_at] - ends[kill_at - 1] - normal,
            "restart_s": first(lines, _RESTART, "the launcher's restart line")[0] - killed,
            "back_s": first(lines, _BACK, "the scheduler's 'is back' line")[0] - killed}


def kill_record(case: str, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        make_model, load_data = demo()
        x, y, _, _ = load_data()
        torch.manual_seed(0)
        data = Path(tmp) / "digits.pt"
        torch.save({"model": make_model(), "x": x, "y": y}, data)
        return _kill_runs(case, args, data)


def _kill_runs(case: str, args: argparse.Namespace, data: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    reference = digest_of(launch(args, data, -1), args.kill_workers)
    progress(f"  {case:<22} reference job without the kill  ({time.perf_counter() - t0:.1f} s)")
    runs: list[dict[str, float]] = []
    equal = True
    for run in range(args.repeats):
        t0 = time.perf_counter()
        lines = launch(args, data, args.kill_at)
        same = digest_of(lines, args.kill_workers) == reference
        equal = equal and same
        runs.append(analyse(lines, args.kill_at))
        got = runs[-1]
        progress(f"  {case:<22} job {run + 1}/{args.repeats}  kill -> step done {got['recovery_s']:.3f} s, "
                 f"restart line {got['restart_s']:.3f} s, back line {got['back_s']:.3f} s, normal step "
                 f"{got['normal_s'] * 1000:.1f} ms, parameters {'equal' if same else 'DIFFERENT'}  "
                 f"({time.perf_counter() - t0:.1f} s)")
    ours, peer = stats([r["recovery_s"] for r in runs]), stats([r["normal_s"] for r in runs])
    describe = (f"sluice launch, digits model, Adam on the servers, {args.kill_workers} workers x {args.servers} "
                f"servers, batch {args.batch_size}, server 0 SIGKILLed as step {args.kill_at} of {args.kill_steps} "
                "starts; ours: seconds from the kill to that step's end")
    return record(case, ours, peer, "normal step (median step time of the same jobs)", "s", better="lower",
                  equal=equal, steps_lost=ours.median / peer.median,
                  **{key: statistics.median(r[key] for r in runs) for key in ("lost_s", "restart_s", "back_s")},
                  runs=args.repeats, kill_at=args.kill_at, steps=args.kill_steps, workers=args.kill_workers,
                  servers=args.servers, batch_size=args.batch_size, description=describe)


if __name__ == "__main__":
    sys.exit(worker_main())
