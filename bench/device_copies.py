"""The device-resident gradient path's copies: their throughput, how much of them backward hides, and the step time.

worker/torch/device_hierarchy.py keeps each fused group of a CUDA model on the GPU, copies its share
device-to-host on a side stream into page-locked registered memory, sends it and copies it back
(docs/collective.md, "Device-resident groups"). Measured, medians over --repeats, each record carrying
the device's name (`device_name`):

  copy    D2H and H2D GB/s of copies on a side stream (timed by CUDA events) to and from torch's pinned
          memory and ordinary memory page-locked by cudaHostRegister (as the path pins its buffers); the
          peer is the PCIe bound from nvidia-smi (link gen x width; per lane gen1 0.25 .. gen6 7.563 GB/s).
          Goal: >= 80% of it. `host_blocked`: the host call returned only once the copies had ended.
  hidden  2 workers launched (`sluice launch -w 2 -s 0 --timeline`) on one GPU, one host, so each is alone
          in it and copies whole groups, train examples/horovod/pytorch_synthetic_benchmark.py's ResNet on
          random images. Per worker and timed step of the merged timeline: the part of each D2H span inside
          the step's first-to-last READY, summed, over the summed D2H durations. Ours: the median of these
          (`pooled`: all spans at once); peer: 1, every copy hidden. Goal: >= 0.8. Spans are the host's view
          (queued to the path's thread seeing the copy done), READY the host running a gradient's hook.
  step    that job's step time (its slower worker, timeline on) against the same model, per-worker batch and
          optimizer (SGD, momentum 0.9) trained alone by plain torch in one process; lower is better.

Without CUDA (`--device cpu`, the default there) the same path runs with collective.local_group = torch
(gloo; the path's thread copies), one torch thread a process, so `hidden` and `step` are real; `copy`
times a plain host memcpy (a torch copy), printed without a record: a CPU has no PCIe bound.
"""

from __future__ import annotations

import argparse
import ast
import bisect
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/device_copies.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F
from torch import nn

from bench.common import ROOT, TORCH_PRELOAD, add_common_options, print_table, progress, record, stats, write_json

EXAMPLE = ROOT / "examples" / "horovod" / "pytorch_synthetic_benchmark.py"
LANE_GBS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}  # GB/s per PCIe lane, by generation
GOAL = 0.8
CLASSES = 10
#: per device: width, image side, batch per worker, warm-up steps, timed steps, MiB per copy
DEFAULTS = {"cuda": (64, 32, 64, 10, 40, 256), "cpu": (16, 32, 16, 3, 10, 256)}
QUICK = (4, 16, 4, 2, 5, 16)


def resnet(width: int) -> nn.Module:
    """The example's ResNet (ResNet-18's shape, `width` channels first), seeded: its classes taken from the
    script's source, which cannot be imported (it parses arguments and trains at import)."""
    tree = ast.parse(EXAMPLE.read_text())
    body: list[ast.stmt] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in ("BasicBlock", "ResNet")]
    names: dict[str, Any] = {"nn": nn, "F": F, "torch": torch}
    exec(compile(ast.Module(body=body, type_ignores=[]), str(EXAMPLE), "exec"), names)
    torch.manual_seed(0)
    model: nn.Module = names["ResNet"](width, num_classes=CLASSES)
    return model


# ---------------------------------------------------------------------------- a process of the job, or alone
def worker(spec: dict[str, Any]) -> None:
    """Train warmup + steps steps (through Sluice unless spec["alone"]); write the timed steps' ms to OUT.RANK.json."""
    if spec["device"] == "cpu":
        torch.set_num_threads(1)
    device, rank = torch.device(spec["device"]), 0  # "cuda:N" from the driver
    model = resnet(spec["width"])
    optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if not spec["alone"]:
        import sluice.torch as hvd
        from sluice.worker.torch.device_hierarchy import made
        from sluice.worker.torch.state import require

        hvd.init()
        rank = hvd.rank()
    if device.type == "cuda":  # both workers on this one GPU (where the driver measured the copies)
        torch.cuda.set_device(device)
    model.to(device)
    if not spec["alone"]:
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(spec["batch"], 3, spec["image"], spec["image"], generator=generator).to(device)
    y = torch.randint(0, CLASSES, (spec["batch"],), generator=generator).to(device)

    def train(steps: int) -> None:
        for _ in range(steps):
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
            optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    train(spec["warmup"])
    if not spec["alone"]:
        hvd.barrier(name="timed")
    started = time.perf_counter()
    train(spec["steps"])
    result: dict[str, Any] = {"step_ms": (time.perf_counter() - started) / spec["steps"] * 1e3}
    if not spec["alone"]:
        result["device_resident"] = sum(path.summed for path in made(require()))
        hvd.shutdown()
    Path(f"{spec['out']}.{rank}.json").write_text(json.dumps(result))


# ---------------------------------------------------------------------------- the driver's measurements
def pcie_bound() -> tuple[float, str] | None:
    """The GPU's PCIe copy bound in GB/s and its name ("PCIe gen G xW bound"), or None where nvidia-smi cannot say."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=pcie.link.gen.max,pcie.link.width.max,name",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30).stdout
        gen, width = (int(field) for field in out.splitlines()[0].split(",")[:2])
        return LANE_GBS[gen] * width, f"PCIe gen {gen} x{width} bound"
    except (OSError, subprocess.SubprocessError, ValueError, IndexError, KeyError):
        return None


def copy_rates(device: torch.device, mib: int, loops: int) -> dict[str, tuple[float, bool]]:
    """GB/s of `loops` copies of `mib` MiB each way on a side stream, by host memory kind, and whether the host
    waited for them (GPU); or the rate of a host memcpy (CPU)."""
    n = mib << 20
    if device.type == "cpu":
        source, target = torch.ones(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
        target.copy_(source)
        started = time.perf_counter()
        for _ in range(loops):
            target.copy_(source)
        return {"memcpy": (n * loops / (time.perf_counter() - started) / 1e9, False)}
    gpu, side = torch.ones(n, dtype=torch.uint8, device=device), torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    registered = torch.empty(n, dtype=torch.uint8)
    failed = int(torch.cuda.cudart().cudaHostRegister(registered.data_ptr(), n, 0))  # type: ignore[no-untyped-call]
    if failed:
        raise SystemExit(f"cudaHostRegister of {mib} MiB failed (CUDA error {failed})")
    hosts = {"pinned": torch.empty(n, dtype=torch.uint8, pin_memory=True), "registered": registered}
    rates = {}
    try:
        for kind, host in hosts.items():
            for direction, (target, source) in (("d2h", (host, gpu)), ("h2d", (gpu, host))):
                side.wait_stream(torch.cuda.current_stream(device))  # the fill of `gpu` first
                with torch.cuda.stream(side):
                    target.copy_(source, non_blocking=True)  # warm
                    side.synchronize()
                    begin, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))  # type: ignore[no-untyped-call]
                    issued = time.perf_counter()
                    begin.record(side)
                    for _ in range(loops):
                        target.copy_(source, non_blocking=True)
                    end.record(side)
                    issued = time.perf_counter() - issued
                    end.synchronize()
                gpu_s = begin.elapsed_time(end) / 1e3
                rates[f"{direction}-{kind}"] = (n * loops / gpu_s / 1e9, issued >= 0.9 * gpu_s)
    finally:
        torch.cuda.synchronize(device)
        torch.cuda.cudart().cudaHostUnregister(registered.data_ptr())  # type: ignore[no-untyped-call]
    return rates


def adjacent_pin_error() -> int:
    """The CUDA error of registering a buffer that starts on the page where a registered one ends (0: none), as
    the path registers its two fusion buffers, 64-byte aligned one after the other in one shared-memory arena."""
    cudart, memory = torch.cuda.cudart(), torch.empty(5 << 12, dtype=torch.uint8)  # type: ignore[no-untyped-call]
    first = -(-memory.data_ptr() // 4096) * 4096  # a page's start; the second starts 1 KiB into the page after
    if int(cudart.cudaHostRegister(first, 5 << 10, 0)):
        return -1
    failed = int(cudart.cudaHostRegister(first + (5 << 10), 5 << 10, 0))
    for start in (first,) if failed else (first, first + (5 << 10)):
        cudart.cudaHostUnregister(start)
    return failed


def hidden_fractions(events: list[dict[str, Any]], warmup: int) -> tuple[list[float], float, int]:
    """Per worker and timed step, the share of D2H time inside that step's first-to-last READY; the pooled share
    over all of them; and how many D2H spans counted. A span belongs to the last step whose first READY precedes it."""
    workers = {e["pid"] for e in events if e.get("name") == "process_name" and "worker" in e["args"]["name"]}
    fractions, inside, total, spans = [], 0.0, 0.0, 0
    for pid in sorted(workers):
        ready: dict[int, list[float]] = {}
        for e in events:
            if e["pid"] == pid and e.get("name") == "READY":
                ready.setdefault(e["args"]["step"], []).append(e["ts"])
        steps = sorted(ready)
        firsts = [min(ready[s]) for s in steps]
        sums: dict[int, list[float]] = {}
        for e in events:
            if e["pid"] != pid or e.get("name") != "D2H" or e.get("ph") != "X":
                continue
            at = bisect.bisect_right(firsts, e["ts"]) - 1
            if at < 0 or steps[at] <= warmup:
                continue
            low, high = firsts[at], max(ready[steps[at]])
            overlap = max(0.0, min(e["ts"] + e["dur"], high) - max(e["ts"], low))
            both = sums.setdefault(steps[at], [0.0, 0.0])
            both[0], both[1], spans = both[0] + overlap, both[1] + e["dur"], spans + 1
        for hid, dur in sums.values():
            if dur > 0:
                fractions.append(hid / dur)
                inside, total = inside + hid, total + dur
    if not fractions:
        raise SystemExit("the timeline has no D2H spans in the timed steps: the job did not take the device path")
    return fractions, inside / total, spans


def run_step_jobs(args: argparse.Namespace, tmp: Path, repeat: int) -> dict[str, Any]:
    """One repeat: the model alone, then the launched 2-worker job; their step ms and the job's hidden fractions."""
    spec = {"device": str(args.torch_device), "width": args.width, "image": args.image, "batch": args.batch,
            "warmup": args.warmup, "steps": args.steps}
    me = [sys.executable, str(Path(__file__).resolve()), "--worker"]
    timeline = tmp / f"timeline.{repeat}.json"
    sets = [f"collective.fusion_bytes={args.fusion_bytes}"] + ["collective.local_group=torch"] * (args.device == "cpu")
    launch = [sys.executable, "-m", "sluice.launch.cli", "launch", "--preload", TORCH_PRELOAD, "-w", "2", "-s", "0",
              "--timeline", str(timeline)]
    out: dict[str, Any] = {}
    for name, argv in (("alone", []), ("job", [*launch, *(a for s in sets for a in ("--set", s)), "--"])):
        alone, prefix = name == "alone", tmp / f"{name}.{repeat}"
        command = [*argv, *me, json.dumps({**spec, "alone": alone, "out": str(prefix)})]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout,
                              env={**os.environ, "OMP_NUM_THREADS": "1"} if args.device == "cpu" else None)
        results = [json.loads(p.read_text()) for p in sorted(tmp.glob(f"{prefix.name}.*.json"))]
        if done.returncode != 0 or len(results) != (1 if alone else 2):
            raise SystemExit(f"the {name} run failed (exit {done.returncode}):\n"
                             f"{done.stdout[-3000:]}{done.stderr[-3000:]}")
        if not alone and min(r["device_resident"] for r in results) < args.steps:
            raise SystemExit(f"a worker's groups did not take the device-resident path: {results}")
        out[name] = max(r["step_ms"] for r in results)
        # the path logs each registered buffer cudaHostRegister refused (its copies then block the host)
        out["pin_failures"] = (done.stdout + done.stderr).count("could not page-lock")
    fractions, out["pooled"], out["spans"] = hidden_fractions(json.loads(timeline.read_text()), args.warmup)
    out["fraction"], out["lowest"] = stats(fractions).median, min(fractions)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", metavar="SPEC", help=argparse.SUPPRESS)  # a process of the job, or alone
    cuda = torch.cuda.is_available()
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if cuda else "cpu",
                        help="where the model and copies run (default: cuda where present, else cpu: %(default)s)")
    parser.add_argument("--width", type=int, help="the ResNet's first-stage channels (default: 64 GPU, 16 CPU)")
    parser.add_argument("--image", type=int, help="image side in pixels (default: 32)")
    parser.add_argument("--batch", type=int, help="images per worker per step (default: 64 GPU, 16 CPU)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (default: 10 GPU, 3 CPU)")
    parser.add_argument("--steps", type=int, help="timed steps per run (default: 40 GPU, 10 CPU)")
    parser.add_argument("--fusion-bytes", type=int, help="collective.fusion_bytes of the job (default: an eighth "
                        "of the model's gradient bytes, so about 8 fused groups a step)")
    parser.add_argument("--copy-mib", type=int, help="MiB per timed copy (default: 256)")
    parser.add_argument("--copy-loops", type=int, default=8, help="copies per timing (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for each run (default: %(default)s)")
    add_common_options(parser, "width 4, 16x16 images, batch 4, 2 + 5 steps, 16 MiB copies, 1 repeat", repeats=3)
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker(json.loads(args.worker))
        return 0
    if args.device == "cuda" and not cuda:
        raise SystemExit("--device cuda: no CUDA GPU here; use --device cpu")
    defaults = QUICK if args.quick else DEFAULTS[args.device]
    for option, value in zip(("width", "image", "batch", "warmup", "steps", "copy_mib"), defaults, strict=True):
        setattr(args, option, value if args.quick or getattr(args, option) is None else getattr(args, option))
    args.repeats, args.copy_loops = (1, 2) if args.quick else (args.repeats, args.copy_loops)
    grad_bytes = sum(p.numel() * p.element_size() for p in resnet(args.width).parameters())
    args.fusion_bytes = args.fusion_bytes or max(grad_bytes // 8, 4096)
    device = args.torch_device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else (
        torch.device("cpu"))
    cpu = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
           if line.startswith("model name")] if Path("/proc/cpuinfo").exists() else []
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else (
        f"CPU, {os.cpu_count()} cores{': ' + cpu[0] if cpu else ''}")
    same = {"device_name": device_name, "device": args.device, "repeats": args.repeats}
    records: list[dict[str, Any]] = []
    rows: list[list[str]] = []
    progress(f"on {device_name}: {args.repeats} x {args.copy_loops} copies of {args.copy_mib} MiB ...")
    copies = [copy_rates(device, args.copy_mib, args.copy_loops) for _ in range(args.repeats)]
    bound = pcie_bound() if device.type == "cuda" else None
    adjacent = adjacent_pin_error() if device.type == "cuda" else 0
    if adjacent:
        progress(f"  cudaHostRegister of a buffer sharing a page with a registered one: CUDA error {adjacent}")
    for case in copies[0]:
        rate = stats([c[case][0] for c in copies])
        blocked = any(c[case][1] for c in copies)
        progress(f"  {case}: {rate.brief(2)} GB/s{' (the host waited for these copies)' * blocked}")
        if bound is None:
            why = "a CPU has no PCIe bound" if device.type == "cpu" else "nvidia-smi gave no PCIe link"
            progress(f"  {case}: no record ({why})")
            continue
        rec = record(f"copy-{case}-{args.copy_mib}MiB", rate, stats([bound[0]]), bound[1], "GB/s", "higher",
                     goal=GOAL, met=rate.median >= GOAL * bound[0], host_blocked=blocked, adjacent_pin_error=adjacent,
                     bytes=args.copy_mib << 20, loops=args.copy_loops, **same)
        records.append(rec)
        rows.append([rec["case"], f"{rate.median:.2f} GB/s", f"{bound[0]:.2f} GB/s", f"{rec['ratio']:.3f}",
                     "met" if rec["met"] else "MISSED"])
    model = f"resnet-w{args.width}-i{args.image}-b{args.batch}"
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            progress(f"repeat {repeat + 1}/{args.repeats}: {model} alone, then 2 workers launched "
                     f"(fusion_bytes {args.fusion_bytes}, {args.warmup} + {args.steps} steps) ...")
            runs.append(got := run_step_jobs(args, Path(tmp), repeat))
            progress(f"  alone {got['alone']:.1f} ms a step, sluice {got['job']:.1f} ms; D2H hidden "
                     f"{got['fraction']:.3f} (pooled {got['pooled']:.3f}, lowest step {got['lowest']:.3f}, "
                     f"{got['spans']} spans){'; buffers NOT page-locked: ' * bool(got['pin_failures'])}"
                     f"{got['pin_failures'] or ''}")
    job = {"workers": 2, "width": args.width, "image": args.image, "batch": args.batch, "warmup": args.warmup,
           "steps": args.steps, "fusion_bytes": args.fusion_bytes, "gradient_bytes": grad_bytes,
           "pin_failures": max(r["pin_failures"] for r in runs), **same}
    hidden = stats([r["fraction"] for r in runs])
    rec = record(f"hidden-d2h-{model}", hidden, stats([1.0]), "every D2H copy hidden under backward",
                 "fraction of D2H time", "higher", goal=GOAL, met=hidden.median >= GOAL,
                 pooled=stats([r["pooled"] for r in runs]).median, lowest_step=min(r["lowest"] for r in runs),
                 spans=sum(r["spans"] for r in runs), **job)
    step = record(f"step-{model}", stats([r["job"] for r in runs]), stats([r["alone"] for r in runs]),
                  "the model alone in one process (plain torch)", "ms", "lower", **job)
    records += [rec, step]
    rows += [[rec["case"], f"{rec['ours']:.3f}", "1", f"{rec['ratio']:.3f}", "met" if rec["met"] else "MISSED"],
             [step["case"], f"{step['ours']:.1f} ms", f"{step['peer']:.1f} ms", f"{step['ratio']:.3f}", "-"]]
    progress(f"\nmedians of {args.repeats} repeats on {device_name} (goal: ratio >= {GOAL} for copy and hidden)")
    print_table(["case", "ours", "peer", "ours/peer", "goal"], rows)
    write_json(args.json, records)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
