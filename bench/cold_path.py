"""What a pipeline stage's per-action calls cost right after an idle pause, against the same calls back to back.

A stage that computes (or, in bench/pipeline.py's idle cases, sleeps) for a slot of T ms comes back to its
Python with the core's caches holding whatever ran meanwhile; every call then costs more than the same call
made again at once. This measures that, in one process, for what a stage does around each slot:

  python loop     300 integer additions in Python: no library, no system call (the control)
  autograd        a tiny y = x * w backward through torch.autograd.grad (what any torch library pays)
  stage send      a [16, 4] float32 activation made a wire array, cut into its stage message and written
                  into a direct lane (sluice.worker.torch.pipelining.stage._wire, pipeline.frames.build,
                  transport.lane.Lane.send): a forward's hand-off in the idle cases
  stage receive   the same message read from the lane, checked and made a tensor (Lane.receive,
                  frames.read, Assembly, staging.tensor_of)

ours = the median microseconds of a call made after sleeping PAUSE ms; peer = the same call back to back
(caches warm). Their ratio is what an idle slot does to the per-action overhead that bench/pipeline.py
reports as overhead_ms_per_slot, and it is this machine's, not the code's: the control shows it too.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/cold_path.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench.common import add_common_options, print_table, progress, record, stats, write_json
from sluice.transport.lane import Lane
from sluice.worker.pipeline.frames import FORWARD, Assembly, read
from sluice.worker.pipeline.frames import build as build_messages
from sluice.worker.staging import tensor_of
from sluice.worker.torch.pipelining.stage import TORCH_DTYPES, _wire

PEER = "the same call back to back (caches warm)"


def python_loop() -> int:
    total = 0
    for i in range(300):
        total += i
    return total


class StageCalls:
    """A connected pair of lanes and the calls a stage makes around a slot: send an activation, receive it."""

    def __init__(self) -> None:
        ends = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for end in ends:
            end.setblocking(False)
        self.out, self.into = Lane(ends[0]), Lane(ends[1])
        self.activation = torch.randn(16, 4)
        self.weight = torch.ones((), requires_grad=True)
        self.got: torch.Tensor | None = None

    def send(self) -> None:
        array, dtype = _wire(self.activation)
        for msg in build_messages(FORWARD, 0, 1, 0, 0, 1, array, dtype, 1, False, self.out.piece):
            self.out.send(msg)

    def receive(self) -> None:
        for msg in self.into.receive():
            assert not isinstance(msg, Exception), msg
            received = Assembly(read(msg, 1 << 20), adopt=True).tensor()
            self.got = tensor_of(received.array, TORCH_DTYPES[received.dtype])

    def autograd(self) -> None:
        x = self.activation.requires_grad_(True)
        torch.autograd.grad((x * self.weight).sum(), [x, self.weight])


def timed(call: Callable[[], Any], pause: float, calls: int, before: Callable[[], Any] | None = None,
          after: Callable[[], Any] | None = None) -> float:
    """The median microseconds of `call`, each made after sleeping `pause` s (0: back to back); `before` and
    `after` run untimed around each (a message to receive, one to drain)."""
    took = []
    for _ in range(calls):
        if before is not None:
            before()
        if pause:
            time.sleep(pause)
        started = time.perf_counter()
        call()
        took.append(time.perf_counter() - started)
        if after is not None:
            after()
    return statistics.median(took) * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pause-ms", type=float, default=25.0,
                        help="the idle pause before each call: a slot of bench/pipeline.py's interleaved idle "
                             "cases by default (%(default)s)")
    parser.add_argument("--calls", type=int, default=200, help="calls a repeat, each timed (%(default)s)")
    add_common_options(parser, "5 ms pauses, 20 calls, 1 repeat")
    args = parser.parse_args(argv)
    if args.quick:
        args.pause_ms, args.calls, args.repeats = 5.0, 20, 1
    torch.set_num_threads(1)
    stage = StageCalls()
    cases: dict[str, tuple[Callable[[], Any], Callable[[], Any] | None, Callable[[], Any] | None]] = {
        "python loop": (python_loop, None, None), "autograd": (stage.autograd, None, None),
        "stage send": (stage.send, None, stage.receive), "stage receive": (stage.receive, stage.send, None)}
    pause = args.pause_ms / 1e3
    found: dict[str, dict[str, list[float]]] = {case: {"cold": [], "warm": []} for case in cases}
    for repeat in range(args.repeats):
        for case, (call, before, after) in cases.items():
            timed(call, 0, 10, before, after)  # every path once through before any timing
            found[case]["warm"].append(timed(call, 0, args.calls, before, after))
            found[case]["cold"].append(timed(call, pause, args.calls, before, after))
        progress(f"  repeat {repeat + 1}/{args.repeats}: " + ", ".join(
            f"{case} {found[case]['cold'][-1]:.1f} / {found[case]['warm'][-1]:.1f} us" for case in cases))
    records = [record(case, stats(times["cold"]), stats(times["warm"]), PEER, "us", "lower", pause_ms=args.pause_ms,
                      calls=args.calls, repeats=args.repeats) for case, times in found.items()]
    print(f"\nmicroseconds a call, median of {args.repeats} repeats of {args.calls} calls: after {args.pause_ms:g} ms "
          "idle / back to back")
    rows = [[r["case"], f"{r['ours']:.1f} [{r['ours_min']:.1f}..{r['ours_max']:.1f}]",
             f"{r['peer']:.1f} [{r['peer_min']:.1f}..{r['peer_max']:.1f}]", f"{r['ratio']:.1f}x"] for r in records]
    print_table(["case", f"after {args.pause_ms:g} ms idle", "back to back", "times"], rows)
    write_json(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
