"""Head-of-line blocking: delay of urgent messages sent during a bulk transfer, Sluice against one FIFO socket."""

from __future__ import annotations

import argparse
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/hol_latency.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import zmq

from bench.common import add_common_options, print_table, progress, record, stats, write_json
from sluice.transport.base import Transport, open_transport
from sluice.transport.config import TransportConfig
from sluice.transport.wire import Kind, Message
from testbed.children import Children
from testbed.forked import Delays, announced, start_in
from testbed.netbed import Netbed, ready_for

KIB, MIB = 1 << 10, 1 << 20
URGENT_BYTES = 64 * KIB
URGENT_CHANNEL, BULK_CHANNEL = 0, 2
BULK_PRIORITY = 1 << 20  # below anything a real job uses
URGENT_KEY, WARMUP_KEY, DONE_KEY = 1 << 24, 1 << 25, 1 << 26
FIFO_NAME = "one FIFO channel (raw pyzmq DEALER->ROUTER, as ps-lite/BytePS)"

DESCRIPTION = """\
Head-of-line blocking on a shaped link (two testbed hosts, both directions of each link shaped to
RATE with tbf). The sender queues a TOTAL-byte low-priority transfer at once, cut into CHUNK-byte
messages, then sends SAMPLES urgent 64 KiB messages at moments spread over the transfer (10% to 90%
of its expected length). Each urgent message's delay is its arrival at the receiver's handler minus
its send time (both hosts read the same CLOCK_MONOTONIC).

  sluice+bands  Sluice's transport (3 channels, default ToS marks): bulk at the lowest priority on
                channel 2, urgent at priority 0 on channel 0, at most INFLIGHT bytes unacknowledged
                per channel; the link has ToS bands under its shaper (pfifo_fast; --qdisc htb: an htb
                class per mark), so urgent packets also skip the bulk backlog in the kernel
  sluice        the same on a link without bands: priority in the transport only
  fifo          the peer, on the same link as sluice+bands: one raw pyzmq DEALER->ROUTER socket that
                sends the chunks and then each urgent message in order, as one FIFO channel does

With --qdisc htb, expect about half a millisecond more for sluice+bands than with bands: tbf asks
its child for the next packet without taking it (a peek), which htb can only answer by dequeuing one,
so one bulk packet already taken out (up to a 64 KiB GSO segment) leaves before a newer urgent one.

The chunk-time is CHUNK bytes at the link rate measured by the fifo runs (their bulk goodput).
Targets: sluice+bands p50 <= 2 chunk-times, and fifo p50 / sluice+bands p50 >= 50. The JSON
records' peer is fifo; p99 of 20 samples is close to their maximum.
"""

_HEADER = struct.Struct("<Bqd")  # fifo frames: kind, key, send time
_BULK, _URGENT, _WARMUP, _DONE = range(4)


@dataclass(frozen=True)
class Setup:
    chunk: int
    inflight: int
    rate_mbit: float
    total: int
    samples: int
    qdisc: str

    @property
    def seconds(self) -> float:
        """How long the transfer takes at the link rate (tbf gives about 96% of it as goodput)."""
        return self.total * 8 / (self.rate_mbit * 1e6 * 0.96)

    @property
    def timeout(self) -> float:
        return 3 * self.seconds + 30

    def offsets(self) -> list[float]:
        """When each urgent message is sent, in seconds after the transfer was queued."""
        return [self.seconds * (0.1 + 0.8 * (k + 0.5) / self.samples) for k in range(self.samples)]


@dataclass(frozen=True)
class Run(Delays):
    """`delays`: one per urgent message."""

    during: int  # urgent messages sent while the transfer was still under way
    goodput_mbit: float  # of the bulk transfer at the receiver


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunk-kib", type=int, default=256, help="chunk size (default: %(default)s)")
    parser.add_argument("--inflight-kib", type=int, default=512,
                        help="Sluice's in-flight bound per channel (default: %(default)s)")
    parser.add_argument("--rate-mbit", type=float, default=1000.0, help="link rate (default: %(default)s)")
    parser.add_argument("--total-mib", type=int, default=256, help="size of the bulk transfer (default: %(default)s)")
    parser.add_argument("--samples", type=int, default=20,
                        help="urgent messages per transfer (default: %(default)s)")
    parser.add_argument("--qdisc", choices=["bands", "htb"], default="bands",
                        help="ToS priority in the kernel for sluice+bands: pfifo_fast bands or htb classes "
                             "(default: %(default)s)")
    add_common_options(parser, quick="a 64 MiB transfer, 10 samples, 1 repeat (overrides those options)", repeats=3)
    args = parser.parse_args(argv)
    if args.quick:
        args.total_mib, args.samples, args.repeats = 64, 10, 1
    if min(args.chunk_kib, args.inflight_kib, args.total_mib, args.samples, args.repeats) < 1 or args.rate_mbit <= 0:
        parser.error("sizes, rate, samples and repeats must be positive")
    if args.chunk_kib < 4 or args.total_mib * 1024 < args.chunk_kib:
        parser.error("chunks must be at least 4 KiB and no larger than the transfer")
    return args


def _result(delays: list[float], sent: list[float], first: float, last: float, setup: Setup) -> dict[str, Any]:
    """What a receiver reports: the delays, how many urgent messages were sent before the last bulk
    chunk arrived (so the transfer was under way), and the bulk goodput from first to last chunk."""
    return {"delays": delays, "during": sum(t < last for t in sent),
            "goodput": (setup.total - setup.chunk) * 8 / max(last - first, 1e-9) / 1e6}


def wait_event(event: threading.Event, timeout: float, missing: Callable[[], str]) -> None:
    """Wait for `event`; after `timeout` s raise TimeoutError with `missing()`, which says what did not come."""
    if not event.wait(timeout):
        raise TimeoutError(f"after {timeout:.0f} s, still missing: {missing()}")


def warm_up(transport: Transport, peer: str, channels: int, replies: threading.Semaphore) -> None:
    """One message per channel, each answered (the receiver replies to keys >= WARMUP_KEY): every
    connection is up and the receiver knows us before anything is timed."""
    for channel in range(channels):
        transport.send(peer, channel, Message(Kind.PUSH, key=WARMUP_KEY + channel))
    deadline = time.monotonic() + 20
    for got in range(channels):
        if not replies.acquire(timeout=max(deadline - time.monotonic(), 0)):
            raise TimeoutError(f"only {got} of {channels} warm-up replies came back from {peer} within 20 s")


# ---------------------------------------------------------------------------- sluice
def _config(setup: Setup, host: str) -> TransportConfig:
    # bare transports, no job: CURVE off in both arms (its cost is bench/curve_cost.py's subject)
    return TransportConfig(channels=3, chunk_bytes=setup.chunk, inflight_bytes=setup.inflight, host=host, shm=False,
                           curve=False)


def _sluice_receiver(setup: Setup, address: str, announce: Any) -> dict[str, Any]:
    transport: Transport
    done = threading.Event()
    delays: list[float] = []
    sent: list[float] = []
    state = {"bulk": 0, "first": 0.0, "last": 0.0}

    def handler(peer: str, channel: int, msg: Message) -> None:
        now = time.monotonic()
        if msg.key >= WARMUP_KEY:
            transport.send(peer, channel, Message(Kind.REPLY, key=msg.key))
            return
        if msg.key >= URGENT_KEY:
            sent.append(float((msg.meta or {})["t"]))
            delays.append(now - sent[-1])
        else:
            state["first"] = state["first"] or now
            state["last"] = now
            state["bulk"] += msg.nbytes
        if len(delays) == setup.samples and state["bulk"] >= setup.total and not done.is_set():
            transport.send(peer, URGENT_CHANNEL, Message(Kind.REPLY, key=DONE_KEY))
            done.set()

    transport = open_transport("receiver", _config(setup, address), handler)
    try:
        announce.put(transport.listen())
        wait_event(done, setup.timeout,
              lambda: f"{setup.samples - len(delays)} of {setup.samples} urgent messages, "
                      f"{(setup.total - state['bulk']) / MIB:.1f} of {setup.total / MIB:.0f} MiB of the transfer")
        return _result(delays, sent, state["first"], state["last"], setup)
    finally:
        transport.close(1.0)


def connected_sender(
    name: str, config: TransportConfig, peer: str, endpoints: list[str]
) -> tuple[Transport, threading.Event]:
    """A transport connected to `peer` and warmed up on its 3 channels, and the event the peer sets by
    replying DONE_KEY (everything arrived). The caller closes the transport."""
    warmed, finished = threading.Semaphore(0), threading.Event()

    def handler(source: str, channel: int, msg: Message) -> None:
        if msg.key == DONE_KEY:
            finished.set()
        else:
            warmed.release()

    transport = open_transport(name, config, handler)
    try:
        transport.connect(peer, endpoints)
        warm_up(transport, peer, 3, warmed)
    except BaseException:
        transport.close(0.5)
        raise
    return transport, finished


def _sluice_sender(setup: Setup, endpoints: list[str]) -> None:
    transport, finished = connected_sender("sender", _config(setup, "127.0.0.1"), "receiver", endpoints)
    try:
        data, urgent = np.ones(setup.total, np.uint8), np.ones(URGENT_BYTES, np.uint8)
        for key, at in enumerate(range(0, setup.total, setup.chunk)):
            part = data[at : at + setup.chunk]
            transport.send("receiver", BULK_CHANNEL, Message(Kind.PUSH, key=key, priority=BULK_PRIORITY,
                                                             dtype="uint8", shape=part.shape, payload=part))
        start = time.monotonic()
        for k, offset in enumerate(setup.offsets()):
            time.sleep(max(start + offset - time.monotonic(), 0))
            transport.send("receiver", URGENT_CHANNEL, Message(
                Kind.PUSH, key=URGENT_KEY + k, priority=0, dtype="uint8", shape=urgent.shape, payload=urgent,
                meta={"t": time.monotonic()}))
        wait_event(finished, setup.timeout, lambda: "the receiver's reply that everything arrived")
    finally:
        transport.close(0.5)


# ---------------------------------------------------------------------------- one FIFO socket
def _fifo_receiver(setup: Setup, address: str, announce: Any) -> dict[str, Any]:
    context = zmq.Context()
    try:
        sock = context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.bind(f"tcp://{address}:0")
        announce.put([sock.getsockopt_string(zmq.LAST_ENDPOINT)])
        delays: list[float] = []
        sent: list[float] = []
        bulk, first, last = 0, 0.0, 0.0
        deadline = time.monotonic() + setup.timeout
        while len(delays) < setup.samples or bulk < setup.total:
            if not sock.poll(max(int((deadline - time.monotonic()) * 1000), 0)):
                raise TimeoutError(f"after {setup.timeout:.0f} s, still missing: {setup.samples - len(delays)} of "
                                   f"{setup.samples} urgent messages, {(setup.total - bulk) / MIB:.1f} MiB")
            ident, header, *payload = sock.recv_multipart(copy=False)
            now = time.monotonic()
            kind, key, when = _HEADER.unpack(header.bytes)
            if kind == _WARMUP:
                sock.send_multipart([ident, _HEADER.pack(_WARMUP, key, now)])
            elif kind == _URGENT:
                sent.append(when)
                delays.append(now - when)
            else:
                first, last = first or now, now
                bulk += len(payload[0])
        sock.send_multipart([ident, _HEADER.pack(_DONE, 0, 0.0)])
        return _result(delays, sent, first, last, setup)
    finally:
        context.destroy(linger=2000)


def _fifo_sender(setup: Setup, endpoints: list[str]) -> None:
    context = zmq.Context()
    try:
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.SNDHWM, 0)  # the whole transfer is queued at once, as for Sluice
        sock.connect(endpoints[0])
        sock.send_multipart([_HEADER.pack(_WARMUP, 0, 0.0)])
        if not sock.poll(20_000):
            raise TimeoutError("no warm-up reply from the fifo receiver within 20 s")
        sock.recv_multipart()
        data, urgent = np.ones(setup.total, np.uint8), np.ones(URGENT_BYTES, np.uint8)
        view, urgent_view = data.data.cast("B"), urgent.data.cast("B")
        for key, at in enumerate(range(0, setup.total, setup.chunk)):
            sock.send_multipart([_HEADER.pack(_BULK, key, 0.0), view[at : at + setup.chunk]], copy=False)
        start = time.monotonic()
        for k, offset in enumerate(setup.offsets()):
            time.sleep(max(start + offset - time.monotonic(), 0))
            sock.send_multipart([_HEADER.pack(_URGENT, k, time.monotonic()), urgent_view], copy=False)
        if not sock.poll(int(setup.timeout * 1000)):
            raise TimeoutError(f"no reply from the fifo receiver that everything arrived within {setup.timeout:.0f} s")
    finally:
        context.destroy(linger=0)


# ---------------------------------------------------------------------------- driver
CASES = ("sluice+bands", "sluice", "fifo")
#: which testbed hosts carry each case: sluice runs on the link without ToS bands
HOSTS = {"sluice+bands": ("snd1", "rcv1"), "sluice": ("snd2", "rcv2"), "fifo": ("snd1", "rcv1")}


def measure(bed: Netbed, case: str, setup: Setup) -> Run:
    sender, receiver = HOSTS[case]
    receive, send = (_fifo_receiver, _fifo_sender) if case == "fifo" else (_sluice_receiver, _sluice_sender)
    with Children() as children:
        announce = children.queue()
        start_in(children, bed, receiver, "receiver", receive, setup, bed.hosts[receiver].address, announce)
        endpoints = announced(children, "receiver", announce, "its endpoints")
        start_in(children, bed, sender, "sender", send, setup, endpoints)
        result = children.collect(["receiver", "sender"], setup.timeout + 30)["receiver"]
    return Run(result["delays"], result["during"], result["goodput"])


def build(bed: Netbed, setup: Setup) -> None:
    priority: dict[str, Any] = ({"tos_bands": True} if setup.qdisc == "bands"
                                else {"tos_classes": TransportConfig().channel_tos()})
    for name in ("snd1", "rcv1"):
        bed.host(name, rate_mbit=setup.rate_mbit, **priority)
    for name in ("snd2", "rcv2"):
        bed.host(name, rate_mbit=setup.rate_mbit)


def report(setup: Setup, runs: dict[str, list[Run]], repeats: int) -> list[dict[str, Any]]:
    link = stats([r.goodput_mbit for r in runs["fifo"]])
    chunk_ms = setup.chunk * 8 / (link.median * 1e6) * 1e3
    p50 = {case: stats([r.p50_ms for r in runs[case]]) for case in CASES}
    p99 = {case: stats([r.p99_ms for r in runs[case]]) for case in CASES}
    rows = []
    for case in CASES:
        during = sum(r.during for r in runs[case])
        rows.append([
            case, p50[case].brief(2), p99[case].brief(2), f"{p50[case].median / chunk_ms:.2f}",
            f"{during}/{setup.samples * len(runs[case])}", stats([r.goodput_mbit for r in runs[case]]).brief(0),
            f"{p50['fifo'].median / p50[case].median:.0f}x",
        ])
    progress(f"\ndelay of {setup.samples} urgent 64 KiB messages per run, in ms, median [min..max] of {repeats} "
             f"repeats; {setup.total // MIB} MiB in {setup.chunk // KIB} KiB chunks, {setup.rate_mbit:g} Mbit/s link")
    headers = ["case", "p50 ms", "p99 ms", "p50 chunk-times", "sent during transfer", "bulk Mbit/s", "fifo p50 / p50"]
    print_table(headers, rows)
    ours, ratio = p50["sluice+bands"].median, p50["fifo"].median / p50["sluice+bands"].median
    print(f"chunk-time: {chunk_ms:.3f} ms ({setup.chunk // KIB} KiB at the {link.median:.0f} Mbit/s the fifo runs "
          f"measured)")
    print(f"target sluice+bands p50 <= 2 chunk-times: {ours / chunk_ms:.2f} chunk-times "
          f"({'met' if ours <= 2 * chunk_ms else 'MISSED'})")
    print(f"target fifo p50 / sluice+bands p50 >= 50: {ratio:.0f}x ({'met' if ratio >= 50 else 'MISSED'})", flush=True)
    common: dict[str, Any] = {
              "chunk_kib": setup.chunk // KIB, "inflight_kib": setup.inflight // KIB, "rate_mbit": setup.rate_mbit,
              "total_mib": setup.total // MIB, "samples": setup.samples, "repeats": repeats, "qdisc": setup.qdisc,
              "chunk_time_ms": chunk_ms, "link_mbit": link.median}
    records = []
    for label, case in (("bands", "sluice+bands"), ("nobands", "sluice")):
        for name, table in (("p50", p50), ("p99", p99)):
            records.append(record(
                f"hol-{name}-{label}", table[case], table["fifo"], FIFO_NAME, "ms", **common,
                ours_chunk_times=table[case].median / chunk_ms, speedup=table["fifo"].median / table[case].median,
                during=sum(r.during for r in runs[case]),
            ))
    return records


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not ready_for("hol_latency"):
        return 0
    setup = Setup(args.chunk_kib * KIB, args.inflight_kib * KIB, args.rate_mbit, args.total_mib * MIB, args.samples,
                  args.qdisc)
    progress(f"hol_latency: {setup.total // MIB} MiB bulk in {setup.chunk // KIB} KiB chunks on a "
             f"{setup.rate_mbit:g} Mbit/s link (about {setup.seconds:.1f} s), {setup.samples} urgent messages, "
             f"{args.repeats} repeats, kernel priority: {setup.qdisc}")
    runs: dict[str, list[Run]] = {case: [] for case in CASES}
    started = time.perf_counter()
    with Netbed() as bed:
        build(bed, setup)
        for rep in range(args.repeats):
            for case in CASES:
                t0 = time.perf_counter()
                run = measure(bed, case, setup)
                runs[case].append(run)
                progress(f"  repeat {rep + 1}/{args.repeats} {case:<12} p50 {run.p50_ms:9.2f} ms  p99 "
                         f"{run.p99_ms:9.2f} ms  {run.during}/{setup.samples} sent during the transfer  bulk "
                         f"{run.goodput_mbit:.0f} Mbit/s  ({time.perf_counter() - t0:.1f} s)")
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
