"""Does ZVC pay between pipeline stages on other hosts? Samples/s of a 2-stage pipeline, compression on and off.

Two testbed hosts (network namespaces with sshd, testbed/ssh.py), each link shaped to RATE
Mbit/s; `sluice launch -H h1:1,h2:1 -s 0` runs stage 0 on h1 and stage 1 on h2, so every micro-batch's
activations and gradients cross the shaped link. The model is an MLP of Linear + ReLU blocks cut in
two, its activations ReLU outputs (about half zeros); 1F1B with M micro-batches. Ours: `compress="on"`
(what "auto" picks between hosts); the peer: the same job with `compress="off"`. Pairs alternate
which runs first; each job times STEPS steps after WARMUP. Records add the compression ratio the
first stage measured on its activations (raw bytes over bytes sent). Needs root and OpenSSH's server
(without them, it says why and exits 0 with no records). Both stages share this machine's 2 cores,
whose one-thread matrix products are about a hundred times slower than a GPU's: 100 Mbit/s links here
(the default) put compute and transfer in the proportion 10 Gbit/s links do between GPUs.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/pipeline_zvc.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import add_common_options, print_table, progress, record, stats, write_json
from testbed.ssh import ssh_bed
from testbed.ssh import unavailable as ssh_unavailable

RESULT = "PIPELINE_ZVC"


def job(args: argparse.Namespace) -> int:
    """One worker of the timed job (run by `sluice launch` with --job)."""
    import torch
    from torch import nn

    import sluice.torch as hvd
    from sluice.worker.torch.pipelining import PipelineStage, Schedule1F1B, split_model

    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(args.layers):
        blocks += [nn.Linear(args.width, args.width), nn.ReLU()]
    parts = split_model(nn.Sequential(*blocks, nn.Linear(args.width, 10)), 2, points=[2 * (args.layers // 2)])
    stage = PipelineStage(parts[hvd.rank() % 2], None, 2, compress=args.compress)
    schedule = Schedule1F1B(stage, args.micro, loss_fn=nn.functional.cross_entropy)
    optimizer = torch.optim.SGD(stage.submod.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.width, generator=generator)
    y = torch.randint(0, 10, (args.batch,), generator=generator)
    started = 0.0
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            started = time.perf_counter()
        optimizer.zero_grad()
        if stage.is_first:
            schedule.step(x)
        else:
            schedule.step(target=y)
        optimizer.step()
    elapsed = time.perf_counter() - started
    print(f"{RESULT} " + json.dumps({"stage": stage.stage_index, "samples_per_s": args.steps * args.batch / elapsed,
                                     "ratio": stage.compression_ratio()}), flush=True)
    hvd.shutdown()
    return 0


def run_job(bed: Any, args: argparse.Namespace, compress: str) -> tuple[float, float]:
    """Samples/s (the last stage's) and the first stage's activation compression ratio of one job."""
    h1, h2 = bed.hosts["h1"], bed.hosts["h2"]
    done = bed.launch(["-H", f"{h1}:1,{h2}:1", "-s", "0", "--", sys.executable, str(Path(__file__).resolve()),
                       "--job", "--compress", compress, "--width", str(args.width), "--layers", str(args.layers),
                       "--batch", str(args.batch), "--micro", str(args.micro), "--steps", str(args.steps),
                       "--warmup", str(args.warmup)], timeout=args.timeout)
    if done.returncode != 0:
        raise SystemExit(f"the {compress} job failed:\n{done.stdout[-4000:]}")
    found = {r["stage"]: r for r in (json.loads(m.group(1)) for m in re.finditer(rf"{RESULT} (.*)$", done.stdout,
                                                                                    re.M))}
    return float(found[1]["samples_per_s"]), float(found[0]["ratio"]["forward"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate-mbit", type=float, default=100.0, help="each host's link (default: %(default)s)")
    parser.add_argument("--width", type=int, default=1024, help="MLP width (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=2, help="Linear + ReLU blocks (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=512, help="samples per step (default: %(default)s)")
    parser.add_argument("--micro", type=int, default=4, help="micro-batches per step (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per job (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one job may take (default: %(default)s)")
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--compress", default="on", help=argparse.SUPPRESS)
    add_common_options(parser, "width 512, batch 64, 3 steps, one pair of jobs", repeats=3)
    args = parser.parse_args(argv)
    if args.job:
        return job(args)
    if args.quick:
        args.width, args.batch, args.steps, args.warmup, args.repeats = 512, 64, 3, 1, 1
    if reason := ssh_unavailable():
        progress(f"skipped: {reason}")
        write_json(args.json, [])
        return 0
    activation_mib = args.batch // args.micro * args.width * 4 / (1 << 20)
    progress(f"2-stage pipeline across two hosts on {args.rate_mbit:g} Mbit/s links: MLP width {args.width}, "
             f"batch {args.batch} in {args.micro} micro-batches ({activation_mib:.2f} MiB of activations each), "
             f"{args.repeats} pairs of jobs ...")
    ours: list[float] = []
    peer: list[float] = []
    ratios: list[float] = []
    with tempfile.TemporaryDirectory() as keys, \
            ssh_bed(Path(keys), 2, rates=[args.rate_mbit, args.rate_mbit], tos_bands=True) as bed:
        for pair in range(args.repeats):
            for compress in (("on", "off") if pair % 2 == 0 else ("off", "on")):
                rate, ratio = run_job(bed, args, compress)
                (ours if compress == "on" else peer).append(rate)
                if compress == "on":
                    ratios.append(ratio)
                progress(f"  pair {pair + 1}: compress {compress}: {rate:.0f} samples/s "
                         f"(activations ratio {ratio:.2f})")
    case = f"pipeline-zvc-{args.rate_mbit:g}mbit-w{args.width}-b{args.batch}-m{args.micro}"
    rec = record(case, stats(ours), stats(peer), "sluice pipeline, compress off", "samples/s", "higher",
                 compression_ratio=statistics.median(ratios), rate_mbit=args.rate_mbit,
                 activation_mib=activation_mib)
    print_table(["case", "ZVC on", "ZVC off", "speedup", "activation ratio"],
                [[case, f"{rec['ours']:.0f}", f"{rec['peer']:.0f}", f"{rec['speedup']:.2f}",
                  f"{rec['compression_ratio']:.2f}"]])
    write_json(args.json, [rec])
    return 0


if __name__ == "__main__":
    sys.exit(main())
