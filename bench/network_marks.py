"""Network marks: latency of one job's urgent messages while another job floods the same bottleneck."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/network_marks.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from bench.common import (
    add_cc_option,
    add_common_options,
    apply_cc_option,
    print_table,
    progress,
    record,
    stats,
    write_json,
)
from bench.hol_latency import DONE_KEY, WARMUP_KEY, connected_sender, wait_event, warm_up
from sluice.transport.base import Handler, Transport, open_transport
from sluice.transport.config import TransportConfig
from sluice.transport.wire import Kind, Message
from testbed.children import Children
from testbed.forked import Delays, announced, start_in
from testbed.netbed import Netbed, ready_for, root_congestion_control

KIB, MIB = 1 << 10, 1 << 20
URGENT_CHANNEL, BULK_CHANNEL = 0, 2
#: one htb class per default mark, in band order; the default class takes what carries no mark
CLASSES = TransportConfig().channel_tos()
_ctx = mp.get_context("fork")

DESCRIPTION = f"""\
Two jobs share one bottleneck. Topology: three testbed hosts on one switch; host r runs the
receiving end of both jobs, and only its link is shaped (RATE both ways, tbf with an htb class per
ToS mark under it: {", ".join(f"{t:#04x}" for t in CLASSES)} in priority order, then a default class).
The senders' hosts a and b are unshaped, so both jobs' packets meet in one queue: the switch's port
towards r, as at a top-of-rack switch's port to a busy server.

  job A  (host a -> r) sends COUNT messages of A_KIB on its urgent channel (channel 0, priority 0)
         every INTERVAL; each one's delay is its arrival at A's receiver minus its send time
  job B  (host b -> r) floods the bottleneck: B_CHUNK chunks queued on its bulk channel (channel 2)
         with a B_INFLIGHT credit, started before A and stopped after it

  alone      A without B
  marks on   A with B, default marks: A's packets in the 0x90 class, B's in the 0x28 class
  marks off  A with B, marks=False in both jobs' configs: both in the 0x00 class, one FIFO

Both jobs use Sluice's transport, so the only difference between the last two is the mark on the
packets. The JSON records' ours is marks on, the peer marks off; the byte counters of the classes on
the bottleneck show where each job's packets went.

How long a queue B keeps at the bottleneck, and so what unmarked urgent packets wait behind, is up
to B's TCP congestion control: bbr (this machine's default) keeps it short (about 0.2 MB was seen
here, under 2 ms at 1 Gbit/s); a loss-based one (--cc reno, which any namespace may choose; cubic
behaves alike, but a namespace may use it only if the root namespace allows it) fills the class's
packet queue until it drops.
"""


@dataclass(frozen=True)
class Setup:
    rate_mbit: float
    a_bytes: int
    interval: float
    count: int
    b_chunk: int
    b_inflight: int
    #: TCP congestion control in the hosts
    cc: str
    marks: bool = True

    @property
    def a_seconds(self) -> float:
        return self.count * self.interval

    @property
    def timeout(self) -> float:
        return self.a_seconds + 30


@dataclass(frozen=True)
class Run(Delays):
    """`delays`: A's messages."""

    b_mbit: float  # B's goodput while A was sending (0 without B)
    classes: dict[int | None, int]  # bytes per class on the bottleneck during the run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate-mbit", type=float, default=1000.0, help="bottleneck rate (default: %(default)s)")
    parser.add_argument("--a-kib", type=int, default=16, help="size of A's messages (default: %(default)s)")
    parser.add_argument("--interval-ms", type=float, default=10.0,
                        help="A sends one message every this long (default: %(default)s)")
    parser.add_argument("--count", type=int, default=200, help="A's messages per run (default: %(default)s)")
    parser.add_argument("--b-chunk-kib", type=int, default=1024, help="B's chunk size (default: %(default)s)")
    parser.add_argument("--b-inflight-mib", type=int, default=16,
                        help="B's in-flight bound per channel, the transport's default (default: %(default)s)")
    add_cc_option(parser)
    add_common_options(parser, quick="40 messages of A, 1 repeat (overrides those options)", repeats=3)
    args = parser.parse_args(argv)
    if args.quick:
        args.count, args.repeats = 40, 1
    if min(args.a_kib, args.count, args.b_chunk_kib, args.b_inflight_mib, args.repeats) < 1:
        parser.error("sizes, counts and repeats must be positive")
    if args.rate_mbit <= 0 or args.interval_ms <= 0 or args.b_chunk_kib < 4:
        parser.error("the rate and interval must be positive, B's chunks at least 4 KiB")
    return args


def _config(setup: Setup, chunk: int, inflight: int, host: str) -> TransportConfig:
    # bare transports, no job: CURVE off (its cost is bench/curve_cost.py's subject)
    return TransportConfig(channels=3, chunk_bytes=chunk, inflight_bytes=inflight, marks=setup.marks, host=host,
                           shm=False, curve=False)


def _replying(holder: list[Transport], arrived: Callable[[str, float, Message], None]) -> Handler:
    """A receiver's handler: answer warm-up messages, hand the others to `arrived` with their arrival time."""
    def handler(peer: str, channel: int, msg: Message) -> None:
        if msg.key >= WARMUP_KEY:
            holder[0].send(peer, channel, Message(Kind.REPLY, key=msg.key))
        else:
            arrived(peer, time.monotonic(), msg)
    return handler


# ---------------------------------------------------------------------------- job A
def _a_receiver(setup: Setup, address: str, announce: Any) -> list[float]:
    done = threading.Event()
    delays: list[float] = []
    holder: list[Transport] = []

    def arrived(peer: str, now: float, msg: Message) -> None:
        delays.append(now - float((msg.meta or {})["t"]))
        if len(delays) == setup.count:
            holder[0].send(peer, URGENT_CHANNEL, Message(Kind.REPLY, key=DONE_KEY))
            done.set()

    holder.append(open_transport("a-receiver", _config(setup, 64 * KIB, 512 * KIB, address),
                                 _replying(holder, arrived)))
    try:
        announce.put(holder[0].listen())
        wait_event(done, setup.timeout, lambda: f"{setup.count - len(delays)} of A's {setup.count} messages")
        return delays
    finally:
        holder[0].close(1.0)


def _a_sender(setup: Setup, endpoints: list[str], stop: Any) -> tuple[float, float]:
    """Send A's messages on schedule; the window they were sent in. Sets `stop` (B may end) when done."""
    config = _config(setup, 64 * KIB, 512 * KIB, "127.0.0.1")
    transport, finished = connected_sender("a-sender", config, "a-receiver", endpoints)
    try:
        payload = np.ones(setup.a_bytes, np.uint8)
        start = time.monotonic()
        for k in range(setup.count):
            time.sleep(max(start + k * setup.interval - time.monotonic(), 0))
            transport.send("a-receiver", URGENT_CHANNEL, Message(
                Kind.PUSH, key=k, priority=0, dtype="uint8", shape=payload.shape, payload=payload,
                meta={"t": time.monotonic()}))
        end = time.monotonic()
        wait_event(finished, setup.timeout, lambda: "A's receiver's reply that every message arrived")
        return start, end
    finally:
        stop.set()
        transport.close(0.5)


# ---------------------------------------------------------------------------- job B
def _b_receiver(setup: Setup, address: str, announce: Any, stop: Any) -> list[tuple[float, int]]:
    """Count B's bulk until `stop`; the arrivals as (time, bytes). Announces once B is flowing."""
    arrivals: list[tuple[float, int]] = []
    holder: list[Transport] = []
    flowing = 16 * MIB
    total = [0]

    def arrived(peer: str, now: float, msg: Message) -> None:
        arrivals.append((now, msg.nbytes))
        total[0] += msg.nbytes
        if total[0] - msg.nbytes < flowing <= total[0]:
            announce.put("flowing")

    holder.append(open_transport("b-receiver", _config(setup, setup.b_chunk, setup.b_inflight, address),
                                 _replying(holder, arrived)))
    try:
        announce.put(holder[0].listen())
        if not stop.wait(setup.timeout + 30):
            raise TimeoutError(f"B's receiver was not told to stop within {setup.timeout + 30:.0f} s")
        return arrivals
    finally:
        holder[0].close(0.2)


def _b_sender(setup: Setup, endpoints: list[str], stop: Any) -> None:
    warmed = threading.Semaphore(0)
    transport = open_transport("b-sender", _config(setup, setup.b_chunk, setup.b_inflight, "127.0.0.1"),
                               lambda *_: warmed.release())
    try:
        transport.connect("b-receiver", endpoints)
        warm_up(transport, "b-receiver", 3, warmed)
        # enough for the whole run at the link rate and then some: what is left is dropped at the end;
        # every chunk is the same buffer, which never changes, so it may be in flight many times over
        chunk = np.ones(setup.b_chunk, np.uint8)
        chunks = int(setup.rate_mbit * 1e6 / 8 * (setup.timeout + 10) / setup.b_chunk) + 1
        for key in range(chunks):
            transport.send("b-receiver", BULK_CHANNEL, Message(
                Kind.PUSH, key=key, priority=1 << 20, dtype="uint8", shape=chunk.shape, payload=chunk))
        if not stop.wait(setup.timeout + 30):
            raise TimeoutError(f"B's sender was not told to stop within {setup.timeout + 30:.0f} s")
    finally:
        transport.close(0.1)


# ---------------------------------------------------------------------------- driver
CASES = ("alone", "marks on", "marks off")
SETTLE = 0.3  # seconds B runs at full rate before A starts, so its queue at the bottleneck is built up


def measure(bed: Netbed, case: str, setup: Setup) -> Run:
    setup = replace(setup, marks=case != "marks off")
    with_b = case != "alone"
    before = bed.class_bytes("r", "in")
    with Children() as children:
        stop = _ctx.Event()
        keys = ["a-receiver", "a-sender"]
        if with_b:
            b_announce = children.queue()
            start_in(children, bed, "r", "b-receiver", _b_receiver, setup, bed.hosts["r"].address, b_announce, stop)
            b_endpoints = announced(children, "b-receiver", b_announce, "its endpoints")
            start_in(children, bed, "b", "b-sender", _b_sender, setup, b_endpoints, stop)
            announced(children, "b-receiver", b_announce, "that B's bulk is flowing")
            time.sleep(SETTLE)
            keys += ["b-receiver", "b-sender"]
        a_announce = children.queue()
        start_in(children, bed, "r", "a-receiver", _a_receiver, setup, bed.hosts["r"].address, a_announce)
        a_endpoints = announced(children, "a-receiver", a_announce, "its endpoints")
        start_in(children, bed, "a", "a-sender", _a_sender, setup, a_endpoints, stop)
        results = children.collect(keys, setup.timeout + 30)
    after = bed.class_bytes("r", "in")
    start, end = results["a-sender"]
    b_bytes = sum(n for t, n in results.get("b-receiver", []) if start <= t <= end)
    return Run(results["a-receiver"], b_bytes * 8 / (end - start) / 1e6,
               {tos: after[tos] - before[tos] for tos in after})


def _class_name(tos: int | None) -> str:
    return "unmatched" if tos is None else f"{tos:#04x}"


def report(setup: Setup, runs: dict[str, list[Run]], repeats: int) -> list[dict[str, Any]]:
    p50 = {case: stats([r.p50_ms for r in runs[case]]) for case in CASES}
    p99 = {case: stats([r.p99_ms for r in runs[case]]) for case in CASES}
    b_mbit = {case: stats([r.b_mbit for r in runs[case]]) for case in CASES}
    progress(f"\nA's delay in ms ({setup.count} messages of {setup.a_bytes // KIB} KiB every "
             f"{setup.interval * 1e3:g} ms per run), median [min..max] of {repeats} repeats; bottleneck "
             f"{setup.rate_mbit:g} Mbit/s, TCP congestion control {setup.cc}")
    print_table(["case", "A p50 ms", "A p99 ms", "B Mbit/s meanwhile"],
                [[c, p50[c].brief(2), p99[c].brief(2), b_mbit[c].brief(0) if c != "alone" else "-"] for c in CASES])
    print(f"marks off / marks on: p50 {p50['marks off'].median / p50['marks on'].median:.1f}x, "
          f"p99 {p99['marks off'].median / p99['marks on'].median:.1f}x")
    totals = {case: {tos: sum(r.classes[tos] for r in runs[case]) for tos in runs[case][0].classes} for case in CASES}
    names = list(totals["alone"])
    print(f"\nbytes per htb class on the bottleneck (switch -> r), summed over {repeats} repeats:", flush=True)
    print_table(["case", *(_class_name(t) for t in names)],
                [[case, *(f"{totals[case][t]:,}" for t in names)] for case in CASES])
    common: dict[str, Any] = {
              "rate_mbit": setup.rate_mbit, "a_kib": setup.a_bytes // KIB, "interval_ms": setup.interval * 1e3,
              "count": setup.count, "b_chunk_kib": setup.b_chunk // KIB, "b_inflight_mib": setup.b_inflight // MIB,
              "repeats": repeats, "cc": setup.cc, "b_mbit_on": b_mbit["marks on"].median,
              "b_mbit_off": b_mbit["marks off"].median}
    return [
        record(f"marks-{name}", table["marks on"], table["marks off"], "marks off (both jobs in one class)", "ms",
               alone=table["alone"].median, speedup=table["marks off"].median / table["marks on"].median,
               class_bytes_on={_class_name(t): n for t, n in totals["marks on"].items()},
               class_bytes_off={_class_name(t): n for t, n in totals["marks off"].items()}, **common)
        for name, table in (("p50", p50), ("p99", p99))
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not ready_for("network_marks"):
        return 0
    cc = args.cc or root_congestion_control()  # what namespaces start with
    setup = Setup(args.rate_mbit, args.a_kib * KIB, args.interval_ms / 1e3, args.count, args.b_chunk_kib * KIB,
                  args.b_inflight_mib * MIB, cc)
    progress(f"network_marks: job A {setup.count} x {setup.a_bytes // KIB} KiB every {args.interval_ms:g} ms, job B "
             f"bulk in {setup.b_chunk // KIB} KiB chunks, {setup.rate_mbit:g} Mbit/s bottleneck, TCP congestion "
             f"control {cc}, {args.repeats} repeats")
    runs: dict[str, list[Run]] = {case: [] for case in CASES}
    started = time.perf_counter()
    with Netbed() as bed:
        bed.host("a")
        bed.host("b")
        bed.host("r", rate_mbit=setup.rate_mbit, tos_classes=CLASSES)
        if apply_cc_option(bed, args.cc, "network_marks") is None:
            return 2
        for rep in range(args.repeats):
            for case in CASES:
                t0 = time.perf_counter()
                run = measure(bed, case, setup)
                runs[case].append(run)
                progress(f"  repeat {rep + 1}/{args.repeats} {case:<9}  A p50 {run.p50_ms:7.2f} ms  p99 "
                         f"{run.p99_ms:7.2f} ms  B {run.b_mbit:4.0f} Mbit/s  ({time.perf_counter() - t0:.1f} s)")
    records = report(setup, runs, args.repeats)
    progress(f"({time.perf_counter() - started:.0f} s in all)")
    write_json(args.json, records)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the context managers have removed the testbed and reaped the children
        print("interrupted", file=sys.stderr)
        sys.exit(130)
