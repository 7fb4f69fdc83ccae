"""Offload of saved activations with ZVC (worker/torch/offload.py): activation memory and step time, on a CPU.

A ReLU CNN (conv-relu-conv-relu-pool twice, 32 then 64 channels, then a linear layer) on BATCH random
SIZExSIZE images. Memory: the bytes autograd saves for backward that are not parameters, counted once per
tensor by a counting-only pass of the same hooks (the peer), against the most bytes the offload hooks
held at once (ours). Step time: forward + backward with the hooks against without, the median of REPEATS
timings of LOOPS steps each, the two alternating. Records: `memory_saved` = 1 - ours/peer memory and
`step_cost` = ours/peer step time - 1. Targets (issue 11): memory_saved >= 0.5 at step_cost <= 0.15.
On a CPU the offload is the compression itself: encode and decode run on the cores the model uses.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/offload.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch import nn

from bench.common import add_common_options, print_table, progress, record, stats, write_json
from sluice.worker.torch.offload import OffloadStats, offloaded

TARGET_MEMORY_SAVED = 0.5
TARGET_STEP_COST = 0.15
MIB = float(1 << 20)


def relu_cnn(size: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * (size // 4) ** 2, 10))


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


def check_exact(model: nn.Module, x: torch.Tensor, y: torch.Tensor, prefetch: int) -> None:
    step(model, x, y, None)
    plain = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    step(model, x, y, offloaded(prefetch=prefetch))
    ours = [p.grad for p in model.parameters() if p.grad is not None]
    if len(plain) != len(ours) or not all(torch.equal(a, b) for a, b in zip(plain, ours, strict=True)):
        raise SystemExit("gradients with offload differ from those without: the round trip is not exact")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32, help="images per step (default: %(default)s)")
    parser.add_argument("--size", type=int, default=64, help="image side in pixels (default: %(default)s)")
    parser.add_argument("--loops", type=int, default=3, help="steps timed together (default: %(default)s)")
    parser.add_argument("--prefetch", type=int, default=0,
                        help="saved tensors decoded ahead in the background (default: %(default)s)")
    add_common_options(parser, "batch 4 of 32x32 images, one repetition of 1 step", repeats=5)
    args = parser.parse_args(argv)
    if args.quick:
        args.batch, args.size, args.repeats, args.loops = 4, 32, 1, 1
    model = relu_cnn(args.size)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, 3, args.size, args.size, generator=generator)
    y = torch.randint(0, 10, (args.batch,), generator=generator)
    progress(f"ReLU CNN, batch {args.batch} of {args.size}x{args.size}, torch on {torch.get_num_threads()} threads: "
             "checking the gradients are exact ...")
    check_exact(model, x, y, args.prefetch)
    counted = step(model, x, y, offloaded(min_bytes=1 << 62))  # keeps every tensor: only counts
    held = step(model, x, y, offloaded(prefetch=args.prefetch))
    assert counted is not None and held is not None
    progress(f"{args.repeats} x {args.loops} steps with and without offload ...")
    times: dict[str, list[float]] = {"none": [], "offload": []}
    for _ in range(args.repeats):
        for name in ("none", "offload"):  # alternating, so drifts hit both alike
            started = time.perf_counter()
            for _ in range(args.loops):
                step(model, x, y, None if name == "none" else offloaded(prefetch=args.prefetch))
            times[name].append((time.perf_counter() - started) / args.loops * 1e3)
    ours, peer = stats(times["offload"]), stats(times["none"])
    memory_saved = 1 - held.peak_bytes / counted.peak_bytes
    step_cost = ours.median / peer.median - 1
    common = {"memory_saved": memory_saved, "step_cost": step_cost, "target_memory_saved": TARGET_MEMORY_SAVED,
              "target_step_cost": TARGET_STEP_COST, "met": memory_saved >= TARGET_MEMORY_SAVED
              and step_cost <= TARGET_STEP_COST, "batch": args.batch, "size": args.size,
              "threads": torch.get_num_threads(), "prefetch": args.prefetch, "repeats": args.repeats,
              "loops": args.loops, "raw_bytes": held.raw_bytes, "stored_bytes": held.stored_bytes,
              "zvc_ratio": held.ratio, "packed": held.packed, "kept": held.kept}
    case = f"offload-zvc-cnn-b{args.batch}-s{args.size}"
    records = [
        record(f"{case}-step", ours, peer, "no offload", "ms", "lower", **common),
        record(f"{case}-memory", stats([held.peak_bytes / MIB]), stats([counted.peak_bytes / MIB]),
               "saved tensors kept (counted)", "MiB", "lower", **common),
    ]
    print_table(["case", "ours", "peer", "ratio", "memory_saved", "step_cost", "zvc ratio", "target"],
                [[rec["case"], f"{rec['ours']:.2f} {rec['unit']}", f"{rec['peer']:.2f} {rec['unit']}",
                  f"{rec['ratio']:.3f}", f"{memory_saved:.3f}", f"{step_cost:+.3f}", f"{held.ratio:.3f}",
                  "met" if common["met"] else "MISSED"] for rec in records])
    print(f"step ms: offload {ours.brief(1)}, none {peer.brief(1)}; activations {counted.peak_bytes / MIB:.1f} MiB "
          f"-> {held.peak_bytes / MIB:.1f} MiB held ({held.packed} offloaded, {held.kept} kept)", flush=True)
    write_json(args.json, records)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
