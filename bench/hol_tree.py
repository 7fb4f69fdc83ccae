"""Head-of-line blocking through a two-level tree: an urgent push_pull behind bulk, worker -> aggregator -> server."""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/hol_tree.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from bench.common import add_common_options, print_table, progress, record, stats, write_json
from testbed.job import emit_result, run_sluice_job
from testbed.netbed import Netbed, ready_for

KIB, MIB = 1 << 10, 1 << 20
URGENT_BYTES = 64 * KIB
TREE = "1: worker-0>aggregator-0 aggregator-0>server"
FIFO_NAME = "one FIFO channel (Sluice with 1 channel, every message in arrival order)"

DESCRIPTION = """\
bench/hol_latency.py's urgent 64 KiB message behind bulk, sent up a two-level tree: a worker, an
aggregator and a server on three testbed hosts, every link shaped to RATE with ToS bands under its
shaper. The worker pushes a TOTAL-byte low-priority tensor (one chunk per CHUNK bytes) through the
aggregator to the server, and while it flows push_pulls a 64 KiB tensor at priority 0, SAMPLES
times spread over the transfer; each sample's delay is the push_pull's round trip (up two hops
carrying the bulk, and back down two hops carrying only the bulk's acknowledgements).

  sluice  Sluice's default transport: 3 channels with ToS marks, at most INFLIGHT bytes
          unacknowledged per channel, the most urgent chunk first at every hop
  fifo    the peer: the same job with one channel and every message in arrival order

The chunk-time is CHUNK bytes at the link rate. Targets: sluice p50 <= 2 chunk-times per congested
hop (two on the way up), and fifo p50 / sluice p50 >= 50.
"""


@dataclass(frozen=True)
class Work:
    total: int
    samples: int
    seconds: float  # the transfer's expected length at the link rate


def worker_main(spec: str) -> int:
    from sluice.worker.node import WorkerNode

    work = Work(**json.loads(spec))
    node = WorkerNode()
    client = node.ps
    names = [f"urgent{i}" for i in range(work.samples)]
    client.declare([("bulk", (work.total // 4,), "float32", None),
                    *((name, (URGENT_BYTES // 4,), "float32", None) for name in names)])
    client.set_priorities({"bulk": 1, **dict.fromkeys(names, 0)})
    urgent = np.ones(URGENT_BYTES // 4, np.float32)
    outs = [np.empty(URGENT_BYTES // 4, np.float32) for _ in names]
    deadline = time.monotonic() + 30
    while client._router.epoch < 1 and time.monotonic() < deadline:  # warm up until the tree is in force
        client.push_pull(names[0], urgent, outs[0]).wait()
    bulk = client.alloc((work.total // 4,), "float32")
    started = time.perf_counter()
    handle = client.push("bulk", bulk)
    delays = [0.0] * work.samples
    waiters = []

    def waiter(i: int, sent: float, urgent_handle: Any) -> None:
        urgent_handle.wait()
        delays[i] = (time.perf_counter() - sent) * 1e3

    for i, name in enumerate(names):  # each sent at its moment, whatever the earlier ones wait for
        at = started + work.seconds * (0.1 + 0.8 * i / max(work.samples - 1, 1))
        time.sleep(max(0.0, at - time.perf_counter()))
        sent = time.perf_counter()
        thread = threading.Thread(target=waiter, args=(i, sent, client.push_pull(name, urgent, outs[i])))
        thread.start()
        waiters.append(thread)
    during = not handle.done()
    for thread in waiters:
        thread.join()
    handle.wait()
    elapsed = time.perf_counter() - started
    routed, epoch = client._router.routed, client._router.epoch
    node.close()
    emit_result({"delays_ms": delays, "bulk_s": elapsed, "during": during, "routed": routed, "epoch": epoch})
    return 0


def run(bed: Netbed, args: argparse.Namespace, fifo: bool) -> dict[str, Any]:
    seconds = args.total_mib * MIB * 8 / (args.rate_mbit * 1e6 * 0.957)
    work = Work(args.total_mib * MIB, args.samples, seconds)
    transport: dict[str, Any] = {"chunk_bytes": args.chunk_kib * KIB, "inflight_bytes": args.inflight_kib * KIB}
    if fifo:
        transport.update(channels=1, aging_ms=0.001)
    config = {"transport": transport, "aggregation": {"mode": "static", "trees": [TREE]}}
    argv = [sys.executable, "-m", "bench.hol_tree", "--worker", json.dumps(asdict(work))]
    (result,) = run_sluice_job(bed, "sched", ["s"], ["w"], config, argv, aggregators=["a"], timeout=4 * seconds + 60,
                               echo=args.verbose)
    if result["epoch"] < 1 or result["routed"] == 0:
        raise RuntimeError(f"the tree never came into force: {result}")
    out: dict[str, Any] = result
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate-mbit", type=float, default=200.0, help="every link's rate (default: %(default)s)")
    parser.add_argument("--total-mib", type=int, default=64, help="size of the bulk tensor (default: %(default)s)")
    parser.add_argument("--chunk-kib", type=int, default=256, help="chunk size (default: %(default)s)")
    parser.add_argument("--inflight-kib", type=int, default=512,
                        help="unacknowledged bytes per channel and peer (default: %(default)s)")
    parser.add_argument("--samples", type=int, default=20, help="urgent messages per run (default: %(default)s)")
    parser.add_argument("--verbose", action="store_true", help="echo every process's output")
    parser.add_argument("--worker", metavar="JSON", help=argparse.SUPPRESS)
    add_common_options(parser, "16 MiB of bulk, 5 samples, 1 repeat", repeats=3)
    args = parser.parse_args(argv)
    if args.quick:
        args.total_mib, args.samples, args.repeats = 16, 5, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args.worker)
    if not ready_for("hol_tree"):
        return 0
    chunk_ms = args.chunk_kib * KIB * 8 / (args.rate_mbit * 1e6) * 1e3
    delays: dict[str, list[float]] = {"sluice": [], "fifo": []}
    with Netbed() as bed:
        for host in ("w", "a", "s"):
            bed.host(host, args.rate_mbit, tos_bands=True)
        bed.host("sched")
        for repeat in range(args.repeats):
            for name in ("sluice", "fifo"):
                result = run(bed, args, fifo=name == "fifo")
                delays[name] += result["delays_ms"]
                progress(f"  repeat {repeat + 1}/{args.repeats} {name:6} p50 {np.median(result['delays_ms']):8.2f} ms"
                         f"  bulk {args.total_mib * MIB * 8 / result['bulk_s'] / 1e6:.0f} Mbit/s")
    ours, peer = stats(delays["sluice"]), stats(delays["fifo"])
    per_hop = ours.median / 2 / chunk_ms  # two congested hops on the way up
    rows = [[name, f"{np.median(d):.2f}", f"{np.percentile(d, 99):.2f}", f"{np.median(d) / 2 / chunk_ms:.2f}"]
            for name, d in delays.items()]
    progress(f"\nurgent push_pull round trip through worker -> aggregator -> server at {args.rate_mbit:g} Mbit/s "
             f"(chunk-time {chunk_ms:.1f} ms)")
    print_table(["case", "p50 ms", "p99 ms", "p50 chunk-times per hop"], rows)
    speedup = peer.median / ours.median
    progress(f"per hop {per_hop:.2f} chunk-times (target <= 2: {'PASS' if per_hop <= 2 else 'FAIL'}); fifo / sluice "
             f"{speedup:.0f}x (target >= 50: {'PASS' if speedup >= 50 else 'FAIL'})")
    write_json(args.json, [{**record("tree-p50", ours, peer, FIFO_NAME, "ms"), "better": "lower",
                            "speedup": speedup, "chunk_times_per_hop": per_hop, "chunk_ms": chunk_ms}])
    return 0


if __name__ == "__main__":
    sys.exit(main())
