"""What a ps.replicas MIRROR costs per chunk and round: sending the committed state against sending the sum.

Two ways to keep a holder's copy of a shard bit-identical (ps/mirror.py uses both: the sum with an
optimizer on the servers, the state otherwise and to bring a holder up to date): (state) the primary sends
the committed state (value and optimizer arrays: 1x the chunk without an optimizer, 2x with momentum,
3x with Adam) and the holder copies it into its file; (sum) the primary sends the round's averaged
gradient (1x) and the holder runs the same optimizer step (ps/optim.py) and then copies the result
into its file. Per chunk of --length float32 values: bytes on the wire, and CPU time (median of
--repeats) on the primary (making the payload) and on the holder (taking it). The holder side is
where the two differ: a copy against an optimizer step plus a copy.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/mirror_cost.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from bench.common import Stats, add_common_options, print_table, progress, record, stats, write_json
from sluice.ps.mirror import mirror_messages
from sluice.ps.mirror_holder import MirrorHolder
from sluice.ps.plan import optimizer_of
from sluice.ps.snapshot import state_tag
from sluice.ps.store import Chunk
from sluice.transport.wire import Message

OPTIMIZERS: dict[str, dict[str, object] | None] = {
    "none": None, "momentum": {"name": "sgd", "lr": 0.1, "momentum": 0.9}, "adam": {"name": "adam", "lr": 0.01}}


def _timed_us(run: Callable[[], object], repeats: int) -> Stats:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1e6)
    return stats(times)


def measure(name: str, length: int, repeats: int, directory: str) -> dict[str, Stats]:
    opt = OPTIMIZERS[name]
    optimizer = optimizer_of(opt, "float32", name)
    rng = np.random.default_rng(0)
    holder = MirrorHolder(state_tag(b"b" * 32), 1, node_id=2, workers=2, directory=directory)
    holder.hold(0, "server-0", 1)
    holder.add_plan(0, [[1, "w", "float32", opt, [[0, length]]]])
    chunk = holder.primaries["server-0"].chunks[(1, 0)]
    grad = rng.standard_normal(length).astype(np.float32)
    primary = Chunk(1, 0, "w", "float32", rng.standard_normal(length).astype(np.float32), chunk.sum, optimizer)
    if optimizer is not None:
        optimizer.step(primary.value, grad, primary.opt_state)  # the state arrays exist from the first step
    rounds = iter(range(1, 1 << 30))

    def state_payload() -> list[Message]:
        return mirror_messages(primary, 1, False)

    pieces = mirror_messages(primary, 1, False)  # made once: this times the holder's side alone

    def state_take() -> None:
        for piece in pieces:
            piece.round = chunk.round + 1
            holder.take("server-0", piece)

    def sum_take() -> None:  # what a holder would do with the sum: the step, then the same commit
        if optimizer is not None:
            optimizer.step(chunk.value, grad, chunk.opt_state)
        chunk.round = next(rounds) + 10
        holder.primaries["server-0"].state.commit(chunk)

    state_bytes = float(sum(m.nbytes for m in state_payload()))
    make = _timed_us(state_payload, repeats)
    take = _timed_us(state_take, repeats)
    chunk.value = chunk.value.copy()  # the sum case steps the holder's own arrays
    chunk.opt_state = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in chunk.opt_state.items()}
    sum_copy = _timed_us(lambda: grad.copy(), repeats)
    sum_holder = _timed_us(sum_take, repeats)
    holder.close(remove=True)
    return {"state_bytes": stats([state_bytes]), "sum_bytes": stats([float(grad.nbytes)]), "state_primary_us": make,
            "state_holder_us": take, "sum_primary_us": sum_copy, "sum_holder_us": sum_holder}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=262_144, help="float32 values per chunk (default: 1 MiB)")
    add_common_options(parser, quick="16384 values a chunk, 5 repetitions", repeats=50)
    args = parser.parse_args(argv)
    if args.quick:
        args.length, args.repeats = 16_384, 5
    if args.length < 1 or args.repeats < 1:
        parser.error("--length and --repeats must be positive")
    peer = "the round's gradient (the holder steps the optimizer)"
    records, rows = [], []
    with tempfile.TemporaryDirectory(dir="/dev/shm") as directory:
        progress(f"chunk of {args.length} float32 ({args.length * 4 / 2**20:.2f} MiB), median of {args.repeats}; "
                 "ours: the committed state (ps/mirror.py sends it without an optimizer, or to bring a holder up "
                 "to date; the gradient otherwise)")
        for name in OPTIMIZERS:
            r = measure(name, args.length, args.repeats, directory)
            for side, unit in (("bytes", "bytes"), ("primary_us", "us"), ("holder_us", "us")):
                ours, theirs = r[f"state_{side}"], r[f"sum_{side}"]
                case = f"{name}-{side.replace('_us', '')}"
                records.append(record(case, ours, theirs, peer, unit, better="lower", length=args.length))
                rows.append([case, ours.brief(0), theirs.brief(0), unit])
    print_table(["case", "the state (ours)", "the gradient", "unit"], rows)
    write_json(args.json, records)


if __name__ == "__main__":
    main()
