"""Push_pull rounds over oversubscribed racks: planned aggregation trees against flat PS and one tree per rack."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/aggregation.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from bench.aggregation_setup import (
    AUX,
    FLAT,
    ONE_PER_RACK,
    PLANNED,
    Layout,
    aggregates,
    build_testbed,
    job_config,
    predicted_seconds,
)
from bench.common import (
    Stats,
    add_cc_option,
    add_common_options,
    apply_cc_option,
    print_table,
    progress,
    stats,
    write_json,
)
from bench.plot import bar_chart
from sluice.scheduler.hierarchy.config import AggregationConfig
from testbed.job import emit_result, run_sluice_job
from testbed.netbed import Netbed, ready_for

DESCRIPTION = """\
Racks of workers behind oversubscribed uplinks (testbed/racks.py: every host link and every rack
uplink shaped separately), parameter servers in a rack of their own (their links as wide as a
rack's hosts together, so that the servers do not pace flat PS), compute stubbed out: every
worker push_pulls one float32 gradient of --mib MiB per round (numpy client, chunks of --chunk-kib).
For each oversubscription (rack uplink = hosts x link rate / ratio) the same rounds run as

  flat PS        every worker pushes straight to the servers (no aggregators)
  one per rack   one tree: each rack's first worker host aggregates the whole rack (an aggregator
                 process beside that worker), the baseline the issue names
  planned        the network manager's ILP plan (aggregation.mode = "plan") of weighted trees over
                 the worker hosts: each worker host aggregates a slice of every tensor
  planned+aux    the same with one auxiliary host per rack (an aggregator and no worker)

Every host runs with net.ipv4.tcp_slow_start_after_idle = 0 (else each round restarts TCP's slow start,
and one worker's push_pull took 1.67x its bound instead of 1.06x) and links buffer 1 s of traffic
(a 100 ms buffer dropped hundreds of segments a round on a shared uplink). Every case prints the
round time the model predicts (busiest link's bytes / rate, gather and
broadcast overlapped through chunk pipelining, 95.7% of a link's rate left to TCP payload) beside
the measurement. Records: ours = a case's round time, peer = flat PS's (or one tree per rack's),
speedup = peer / ours; `predicted` and `measured_vs_predicted` per case.
"""

#: switch buffers deep enough that no segment is dropped: the model has no loss, and the tbf default
#: (100 ms) made TCP retransmit hundreds of segments a round on a shared uplink (measured: 1.37x the
#: predicted flat round, against 1.19x with this)
QUEUE_MS = 1000.0
TARGETS = {"planned": 2.0, "planned+aux": 2.3}  # >= x flat PS at 4:1 (the targets)
ALL_CASES = (FLAT, ONE_PER_RACK, PLANNED, AUX)
#: --quick: the baseline and the planned trees with their auxiliary hosts (the ILP plan, aggregators beside
#: workers and on hosts of their own): a job of 11 s each here, where all four took 50 s
QUICK_CASES = (FLAT, AUX)


@dataclass(frozen=True)
class Work:
    floats: int
    warmup: int
    rounds: int
    wait_epoch: bool  # time only once the aggregation trees are in force


def worker_main(spec: str) -> int:
    from sluice.worker.node import WorkerNode

    work = Work(**json.loads(spec))
    node = WorkerNode()
    client = node.ps
    client.declare([("grad", (work.floats,), "float32", None), ("ready", (1,), "int32", None)])
    data = client.alloc((work.floats,), "float32")
    data[:] = client.rank + 1
    out = np.empty(work.floats, np.float32)
    deadline = time.monotonic() + 60
    done, ready = 0, np.zeros(1, np.int32)
    # every worker must run the same rounds: they agree through a vote that the trees are in force on all
    while done < work.warmup or (work.wait_epoch and ready[0] < client.size):
        client.push_pull("grad", data, out).wait()
        vote = client._router.epoch >= 1 or time.monotonic() > deadline  # (run_case names a plan that never came)
        client.push_pull("ready", np.array([vote], np.int32), ready).wait()
        done += 1
    node.barrier("timed")
    seconds = []
    for _ in range(work.rounds):
        started = time.perf_counter()
        client.push_pull("grad", data, out).wait()
        seconds.append(time.perf_counter() - started)
    want = client.size * (client.size + 1) / 2
    if not np.all(out == want):
        raise SystemExit(f"worker {client.rank}: the round summed {out[0]}, not {want}")
    epoch, routed = client._router.epoch, client._router.routed
    node.close()
    emit_result({"rank": client.rank, "seconds": seconds, "epoch": epoch, "routed": routed})
    return 0


def run_case(bed: Netbed, layout: Layout, case: str, args: argparse.Namespace) -> list[float]:
    """One job; the round times (the slowest worker's, round by round)."""
    work = Work(args.mib << 18, args.warmup, args.rounds, case != FLAT)
    argv = [sys.executable, "-m", "bench.aggregation", "--worker", json.dumps(asdict(work))]
    aggregators = layout.aggregator_hosts(case)
    results = run_sluice_job(bed, "sched", layout.server_hosts, layout.worker_hosts,
                             job_config(layout, case, args.chunk_kib, bed), argv, aggregators=aggregators,
                             timeout=args.timeout, echo=args.verbose)
    if case != FLAT and any(r["epoch"] < 1 or (aggregates(layout, case) and r["routed"] == 0) for r in results):
        raise RuntimeError(f"{case}: the aggregation trees never came into force ({results[0]})")
    return [max(r["seconds"][i] for r in results) for i in range(args.rounds)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--racks", type=int, default=4, help="racks of workers (default: %(default)s)")
    parser.add_argument("--per-rack", type=int, default=4, help="worker hosts per rack (default: %(default)s)")
    parser.add_argument("--servers", type=int, default=4, help="server hosts, in a rack of their own "
                        "(default: %(default)s)")
    parser.add_argument("--link-mbit", type=float, default=10.0, help="every host's link, Mbit/s each way "
                        "(default: %(default)s)")
    parser.add_argument("--server-mbit", type=float, default=0.0, help="the servers' links, Mbit/s each way "
                        "(default: a rack's hosts together, per-rack x link-mbit)")
    parser.add_argument("--ratios", default="4,2,1", help="oversubscriptions to run, comma-separated "
                        "(default: %(default)s)")
    parser.add_argument("--cases", default=None,
                        help=f"configurations to run (default: {','.join(ALL_CASES)}; --quick: "
                             f"{','.join(QUICK_CASES)})")
    parser.add_argument("--mib", type=int, default=1, help="gradient MiB per worker per round (default: %(default)s)")
    parser.add_argument("--chunk-kib", type=int, default=16, help="chunk size in KiB; one chunk in flight per "
                        "peer, so the links' FIFO queues stay short and the tree pipelines chunk by chunk "
                        "(default: %(default)s)")
    parser.add_argument("--fanout-share", type=float, default=AggregationConfig.fanout_share, metavar="F",
                        help="aggregation.fanout_share of the planned cases: the share of an aggregator's link its "
                             "fan-out may take in the plan (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=8, help="timed rounds per job (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a job may take (default: %(default)s)")
    parser.add_argument("--plot", metavar="SVG", help="write a bar chart of the round times to SVG")
    parser.add_argument("--verbose", action="store_true", help="echo every process's output")
    parser.add_argument("--worker", metavar="JSON", help=argparse.SUPPRESS)
    add_cc_option(parser)
    add_common_options(parser, "2 racks x 2 workers, 2 servers, 40 Mbit/s links, ratio 4:1, 1 MiB, 1 warm-up + 3 "
                       "rounds, flat PS and planned+aux only (unless --cases names others)", repeats=1)
    args = parser.parse_args(argv)
    if args.quick:
        args.racks, args.per_rack, args.servers, args.ratios, args.mib, args.rounds = 2, 2, 2, "4", 1, 3
        args.link_mbit, args.warmup = 40.0, 1
    if args.cases is None:
        args.cases = ",".join(QUICK_CASES if args.quick else ALL_CASES)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args.worker)
    if not ready_for("aggregation"):
        return 0
    cases = args.cases.split(",")
    measured: dict[tuple[str, str], Stats] = {}
    predicted: dict[tuple[str, str], float] = {}
    rows, records = [], []
    for ratio in (int(r) for r in args.ratios.split(",")):
        over = f"{ratio}:1"
        layout = Layout(args.racks, args.per_rack, args.servers, args.link_mbit, ratio, args.server_mbit,
                        args.fanout_share)
        with Netbed(queue_ms=QUEUE_MS) as bed:
            build_testbed(bed, layout)
            cc = apply_cc_option(bed, args.cc, "aggregation")
            if cc is None:
                return 2
            for case in cases:
                progress(f"{over} {case}: {len(layout.worker_hosts)} workers, predicted "
                         f"{predicted_seconds(layout, case, args.mib << 20) * 1e3:.0f} ms a round ...")
                rounds = []
                for _ in range(args.repeats):
                    rounds += run_case(bed, layout, case, args)
                measured[(over, case)] = stats(rounds)
                predicted[(over, case)] = predicted_seconds(layout, case, args.mib << 20)
        for case in cases:
            got, want = measured[(over, case)], predicted[(over, case)]
            rows.append([over, case, f"{got.median * 1e3:.0f} [{got.low * 1e3:.0f}..{got.high * 1e3:.0f}]",
                         f"{want * 1e3:.0f}", f"{got.median / want:.2f}"])
            for peer in (FLAT, ONE_PER_RACK):
                if case in (FLAT, peer) or (over, peer) not in measured:
                    continue
                base = measured[(over, peer)]
                speedup = base.median / got.median
                target = TARGETS.get(case) if peer == FLAT and ratio == 4 else None
                records.append({
                    "case": f"{over} {case}" + (" aux" if case == AUX else ""), "ours": got.median,
                    "peer": base.median, "peer_name": "flat PS" if peer == FLAT else "one tree per rack",
                    "unit": "s per round", "better": "lower", "ratio": got.median / base.median,
                    "speedup": speedup, "oversubscription": over, "aux": case == AUX,
                    "predicted": want, "measured_vs_predicted": got.median / want,
                    "peer_predicted": predicted[(over, peer)], "ours_min": got.low, "ours_max": got.high,
                    "target": target, "met": None if target is None else speedup >= target, "cc": cc,
                    "fanout_share": args.fanout_share,
                })
    progress("\nround time in ms, median [min..max] of the rounds; predicted: the model's bound")
    print_table(["over", "case", "measured", "predicted", "measured/predicted"], rows)
    if records:
        print_table(["case", "speedup", "vs", "target"],
                    [[r["case"], f"{r['speedup']:.2f}x", r["peer_name"],
                      "" if r["target"] is None else f">= {r['target']}x {'PASS' if r['met'] else 'FAIL'}"]
                     for r in records])
    if args.plot:
        groups = sorted({over for over, _ in measured}, key=lambda o: -int(o.split(":")[0]))
        values = {(over, case): s.median for (over, case), s in measured.items()}
        ranges = {(over, case): (s.low, s.high) for (over, case), s in measured.items()}
        Path(args.plot).write_text(bar_chart(groups, cases, values, ranges=ranges, ylabel="seconds per round",
                                             title=f"push_pull of {args.mib} MiB per worker, "
                                                   f"{len(layout.worker_hosts)} workers in {args.racks} racks"))
    write_json(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
