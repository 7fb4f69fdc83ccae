"""Offload of saved activations (worker/torch/offload.py): activation memory and step time, on a CPU or a GPU.

A ReLU CNN (conv-relu-conv-relu-pool twice, WIDTH then 2 x WIDTH channels, then a linear layer) on BATCH
random SIZExSIZE images. Step time: forward + backward with the hooks against without, the median of
REPEATS timings of LOOPS steps each, all alternating. Records: `memory_saved` = 1 - ours/peer memory
and `step_cost` = ours/peer step time - 1. Targets (issue 11): memory_saved >= 0.5 at step_cost <= 0.15.
Cases are named by what runs: `lean` (ReLUs and max-pools save bits and window offsets), `zvc`, `gpu`.

On a CPU (`--device cpu`) the offload is compression in place, on the cores the model uses: without
--compress/--no-compress, two configurations in one run, the defaults (lean saves alone) and ZVC on top
(`--compress`: what a ReLU CNN's convolutions save, their inputs, ZVC-encoded as well). Memory:
the bytes autograd saves for backward that are not parameters, counted once per tensor by a counting-only
pass of the same hooks (the peer), against the most bytes the offload hooks held at once (ours).
On a GPU (`--device cuda`) activations go to pinned host memory on a side stream during forward and come
back on another ahead of backward (with `--compress`, ZVC-packed on the GPU before the copy, as cDMA).
Memory: the GPU memory held for backward once forward has ended, with against without (what a pipeline
stage holds for each micro-batch in flight); field `gpu` adds the peaks during forward and the whole
step, and each phase's milliseconds. `copy_ms` is what copying the offloaded bytes one way alone takes at
the measured pinned bandwidth: where it exceeds the forward's compute, the link, not the overlap, sets
the step time.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/offload.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch import nn

from bench.common import add_common_options, print_table, progress, record, stats, write_json
from sluice.worker.torch.offload import COPIES_AHEAD, MIN_SAVING, OffloadStats, offloaded

TARGET_MEMORY_SAVED = 0.5
TARGET_STEP_COST = 0.15
MIB = float(1 << 20)


#: per device: (batch, size, width) when not given; on a GPU, wide layers at a small size, so that compute
#: per activation byte is high enough for the copies to hide behind it
DEFAULTS = {"cpu": (32, 64, 32), "cuda": (64, 32, 256)}


def relu_cnn(size: int, width: int = 32) -> nn.Module:
    torch.manual_seed(0)
    wide = 2 * width
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1), nn.ReLU(), nn.Conv2d(width, width, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2), nn.Conv2d(width, wide, 3, padding=1), nn.ReLU(), nn.Conv2d(wide, wide, 3, padding=1),
        nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(wide * (size // 4) ** 2, 10))


def step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, hooks: Any) -> OffloadStats | None:
    """One forward and backward; `hooks` is a fresh `offloaded(...)` block or None for none."""
    model.zero_grad(set_to_none=True)
    if hooks is None:
        nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
        return None
    with hooks as held:
        loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()  # type: ignore[no-untyped-call]
    assert isinstance(held, OffloadStats)
    return held


def check_exact(model: nn.Module, x: torch.Tensor, y: torch.Tensor, hooks: Any) -> None:
    deterministic = torch.backends.cudnn.deterministic  # the same algorithms both times, for the bits to match
    torch.backends.cudnn.deterministic = True
    try:
        step(model, x, y, None)
        plain = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        step(model, x, y, hooks())
        ours = [p.grad for p in model.parameters() if p.grad is not None]
    finally:
        torch.backends.cudnn.deterministic = deterministic
    if len(plain) != len(ours) or not all(torch.equal(a, b) for a, b in zip(plain, ours, strict=True)):
        raise SystemExit("gradients with offload differ from those without: the round trip is not exact")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gpu_memory(model: nn.Module, x: torch.Tensor, y: torch.Tensor, hooks: Any) -> dict[str, float]:
    """GPU MiB above what was allocated before the step (the model, its input): `held` once forward has
    ended (what waits for backward: in a pipeline, for each micro-batch in flight), `forward_peak` and
    `step_peak` (with the gradients); and the forward's and backward's milliseconds."""
    model.zero_grad(set_to_none=True)
    sync(x.device)
    base = torch.cuda.memory_allocated(x.device)
    torch.cuda.reset_peak_memory_stats(x.device)
    started = time.perf_counter()
    with hooks if hooks is not None else contextlib.nullcontext():
        loss = nn.functional.cross_entropy(model(x), y)
    sync(x.device)
    forward_ms = (time.perf_counter() - started) * 1e3
    forward = torch.cuda.max_memory_allocated(x.device) - base
    torch.cuda.empty_cache()  # frees the blocks whose copies have ended, which the allocator frees lazily
    held = torch.cuda.memory_allocated(x.device) - base
    started = time.perf_counter()
    loss.backward()  # type: ignore[no-untyped-call]
    sync(x.device)
    return {"held": held / MIB, "forward_peak": forward / MIB,
            "step_peak": (torch.cuda.max_memory_allocated(x.device) - base) / MIB, "forward_ms": forward_ms,
            "backward_ms": (time.perf_counter() - started) * 1e3}


def pinned_copy_ms(nbytes: int, device: torch.device) -> float:
    """Milliseconds to copy `nbytes` from the GPU to pinned host memory, measured on 256 MiB (median of 5)."""
    size = 256 << 20
    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    times = []
    for _ in range(5):
        sync(device)
        started = time.perf_counter()
        target.copy_(source, non_blocking=True)
        sync(device)
        times.append(time.perf_counter() - started)
    return nbytes / (size / stats(times).median) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the model runs "
                        "(default: %(default)s)")
    parser.add_argument("--batch", type=int, help="images per step (default: 32 on a CPU, 64 on a GPU)")
    parser.add_argument("--size", type=int, help="image side in pixels (default: 64 on a CPU, 32 on a GPU)")
    parser.add_argument("--width", type=int, help="channels of the first block; the second has twice as many "
                        "(default: 32 on a CPU, 256 on a GPU)")
    parser.add_argument("--loops", type=int, help="steps timed together (default: 3 on a CPU, 10 on a GPU)")
    parser.add_argument("--prefetch", type=int, help="offloaded tensors brought back ahead of backward's use "
                        "(default: the library's, 2 on a GPU, none on a CPU)")
    parser.add_argument("--copies-ahead", type=int, default=COPIES_AHEAD, help="GPU: copies to the host that "
                        "forward may run ahead of (default: %(default)s)")
    parser.add_argument("--keep-last", type=int, default=0, help="GPU: the last saved tensors that also stay "
                        "on the GPU, for the backward that follows at once (default: %(default)s)")
    parser.add_argument("--compress", action=argparse.BooleanOptionalAction, help="ZVC-encode what is "
                        "offloaded (ZVC-packed on the GPU before the copy, on a GPU). Default: on a CPU, both "
                        "the library's default (ZVC only without lean saves) and --compress; on a GPU, off")
    parser.add_argument("--lean", action=argparse.BooleanOptionalAction, default=True, help="ReLUs and max-pools "
                        "save a bitmask and window offsets instead of tensors, as Gist (default: on)")
    parser.add_argument("--min-saving", type=float, default=MIN_SAVING, help="CPU: ZVC-encode a tensor only "
                        "when that saves at least this fraction of its bytes (default: %(default)s)")
    add_common_options(parser, "batch 4 of 32x32 images, one repetition of 1 step", repeats=5)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU here; run on a machine with one, or use --device cpu")
    batch, size, width = DEFAULTS[device.type]
    args.batch, args.size, args.width = args.batch or batch, args.size or size, args.width or width
    args.loops = args.loops or (10 if device.type == "cuda" else 3)
    if args.quick:
        args.batch, args.size, args.width, args.repeats, args.loops = 4, 32, min(args.width, 32), 1, 1
    model = relu_cnn(args.size, args.width).to(device)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, 3, args.size, args.size, generator=generator).to(device)
    y = torch.randint(0, 10, (args.batch,), generator=generator).to(device)
    # on a CPU without --compress/--no-compress: the defaults (lean saves alone) and ZVC on top, in one run
    choices = [args.compress] if args.compress is not None or device.type == "cuda" or not args.lean else [None, True]
    configs = {label(device, args.lean, compress): functools.partial(
        offloaded, compress=compress, prefetch=args.prefetch, copies_ahead=args.copies_ahead,
        keep_last=args.keep_last, lean=args.lean, min_saving=args.min_saving) for compress in choices}

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} threads"
    progress(f"ReLU CNN {args.width}/{2 * args.width} channels, batch {args.batch} of {args.size}x{args.size}, "
             f"on {where}: checking the gradients are exact ...")
    for hooks in configs.values():
        check_exact(model, x, y, hooks)
    counted = step(model, x, y, offloaded(min_bytes=1 << 62, lean=False))  # torch's saves, kept: only counts
    assert counted is not None
    held = {name: step(model, x, y, hooks()) for name, hooks in configs.items()}
    progress(f"{args.repeats} x {args.loops} steps without offload and with {', '.join(configs)} ...")
    times: dict[str, list[float]] = {name: [] for name in ("none", *configs)}
    for _ in range(args.repeats):
        for name in times:  # alternating, so drifts hit all alike
            sync(device)
            started = time.perf_counter()
            for _ in range(args.loops):
                step(model, x, y, configs[name]() if name in configs else None)
            sync(device)
            times[name].append((time.perf_counter() - started) / args.loops * 1e3)
    peer = stats(times["none"])
    records, rows = [], []
    for name, hooks in configs.items():
        ours, kept = stats(times[name]), held[name]
        assert kept is not None
        gpu: dict[str, dict[str, float]] = {}
        if device.type == "cuda":
            for run_name in ("none", "offload"):
                runs = [gpu_memory(model, x, y, hooks() if run_name == "offload" else None)
                        for _ in range(args.repeats)]
                gpu[run_name] = {key: stats([run[key] for run in runs]).median for key in runs[0]}
            memory = stats([gpu["offload"]["held"]]), stats([gpu["none"]["held"]])
            memory_name = "no offload (GPU memory held for backward when forward ends)"
        else:
            memory = stats([kept.peak_bytes / MIB]), stats([counted.peak_bytes / MIB])
            memory_name = "saved tensors kept (counted)"
        memory_saved = 1 - memory[0].median / memory[1].median
        step_cost = ours.median / peer.median - 1
        common = {"memory_saved": memory_saved, "step_cost": step_cost, "target_memory_saved": TARGET_MEMORY_SAVED,
                  "target_step_cost": TARGET_STEP_COST, "met": memory_saved >= TARGET_MEMORY_SAVED
                  and step_cost <= TARGET_STEP_COST, "device": where, "batch": args.batch, "size": args.size,
                  "width": args.width, "compress": hooks.keywords["compress"], "defaults": name == label(
                      device, True, None), "threads": torch.get_num_threads(), "prefetch": args.prefetch,
                  "prefetched": kept.prefetched, "repeats": args.repeats, "loops": args.loops,
                  "raw_bytes": kept.raw_bytes, "stored_bytes": kept.stored_bytes, "zvc_ratio": kept.ratio,
                  "packed": kept.packed, "kept": kept.kept,
                  "copy_ms": pinned_copy_ms(kept.raw_bytes, device) if device.type == "cuda" else None,
                  "gpu": gpu or None, "copies_ahead": args.copies_ahead, "keep_last": args.keep_last,
                  "lean": kept.lean, "min_saving": args.min_saving}
        case = f"offload-{name}-cnn-w{args.width}-b{args.batch}-s{args.size}"
        these = [record(f"{case}-step", ours, peer, "no offload", "ms", "lower", **common),
                 record(f"{case}-memory", memory[0], memory[1], memory_name, "MiB", "lower", **common)]
        verdict = (f"memory {'met' if memory_saved >= TARGET_MEMORY_SAVED else 'MISSED'}, "
                   f"step {'met' if step_cost <= TARGET_STEP_COST else 'MISSED'}")
        rows += [[rec["case"], f"{rec['ours']:.2f} {rec['unit']}", f"{rec['peer']:.2f} {rec['unit']}",
                  f"{rec['ratio']:.3f}", f"{memory_saved:.3f}", f"{step_cost:+.3f}", f"{kept.ratio:.3f}", verdict]
                 for rec in these]
        records += these
        copy = "".join(f"\n  {gpu_name}: " + ", ".join(f"{key} {value:.1f}" for key, value in values.items())
                       for gpu_name, values in gpu.items())
        if gpu:
            copy = f"; copying them one way alone takes {common['copy_ms']:.1f} ms; GPU MiB and ms:{copy}"
        print(f"{name}: step ms {ours.brief(1)} against {peer.brief(1)} without; activations "
              f"{counted.peak_bytes / MIB:.1f} MiB -> {kept.peak_bytes / MIB:.1f} MiB ({kept.packed} offloaded, "
              f"{kept.kept} kept, {kept.prefetched} brought back ahead, {kept.lean} lean ReLUs and max-pools){copy}",
              flush=True)
    print_table(["case", "ours", "peer", "ratio", "memory_saved", "step_cost", "zvc ratio", "targets"], rows)
    write_json(args.json, records)
    return 0


def label(device: torch.device, lean: bool, compress: bool | None) -> str:
    """The case's name for these options: what runs on `device` with them (ZVC by default on a CPU only
    without lean saves, never on a GPU)."""
    zvc = compress if compress is not None else (device.type == "cpu" and not lean)
    parts = ["gpu"] * (device.type == "cuda") + ["lean"] * lean + ["zvc"] * zvc
    return "-".join(parts) or "kept"


if __name__ == "__main__":
    raise SystemExit(main())
