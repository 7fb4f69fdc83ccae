"""Packet marks on the wire match the transport's config; the priority benchmarks' quick runs are sane."""

from __future__ import annotations

import json
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sluice.transport.base import Transport, open_transport
from sluice.transport.config import TransportConfig
from sluice.transport.wire import Kind, Message
from testbed.bench_runs import requires_testbed, run_script
from testbed.children import Children
from testbed.forked import announced, percentile, start_in
from testbed.netbed import Direction, Netbed
from testbed.qdisc import ClassCounters, parse_class_stats

ROOT = Path(__file__).resolve().parents[2]


#: htb classes on both links: the default marks but 0x00 (unmarked traffic has no class of its own, so it
#: lands in the default class), the explicit marks of the `tos=` case, and network control (a node's
#: connection to its scheduler: scheduler.control_tos)
CLASSES = (0x90, 0x28, 0xB8, 0x68, 0x30, 0xC0)
EXPLICIT = (0xB8, 0x68, 0x30)
CHUNK = 128 * 1024
#: channel c carries (c + 1) * PER_CHANNEL payload bytes, so each class's share is told apart
PER_CHANNEL = 8 * CHUNK
DONE = 1 << 20


# ---------------------------------------------------------------------------- pure
TC_OUTPUT = """\
class tbf 1:1 parent 1: leaf 10:

class htb 10:101 parent 10:1 prio 1 rate 10Mbit ceil 1Gbit burst 1600b cburst 500Kb
 Sent 52279252 bytes 34560 pkt (dropped 0, overlimits 0 requeues 0)
 backlog 0b 0p requeues 0
 lended: 0 borrowed: 0 giants: 0

class htb 10:1ff parent 10:1 prio 7 rate 10Mbit ceil 1Gbit burst 1600b cburst 500Kb
 Sent 176 bytes 2 pkt (dropped 0, overlimits 0 requeues 0)
 backlog 0b 0p requeues 0
"""


@pytest.mark.timeout(10)
def test_class_counters_are_parsed_from_tc_output() -> None:
    assert parse_class_stats(TC_OUTPUT) == {
        "10:101": ClassCounters(52279252, 34560), "10:1ff": ClassCounters(176, 2),
    }
    assert parse_class_stats("") == {}


@pytest.mark.timeout(10)
def test_percentile_interpolates_between_ranks() -> None:
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0], 50) == 1.5
    assert percentile([5.0], 99) == 5.0
    with pytest.raises(ValueError):
        percentile([], 50)


# ---------------------------------------------------------------------------- marks on the wire
def _receiver(config: TransportConfig, expected: int, announce: Any) -> list[int]:
    """Payload bytes per channel, once `expected` bytes arrived (then the sender is told)."""
    holder: list[Transport] = []
    got = [0] * config.channels
    done = threading.Event()

    def handler(peer: str, channel: int, msg: Message) -> None:
        got[channel] += msg.nbytes
        if sum(got) >= expected and not done.is_set():
            holder[0].send(peer, 0, Message(Kind.REPLY, key=DONE))
            done.set()

    holder.append(open_transport("receiver", config, handler))
    try:
        announce.put(holder[0].listen())
        if not done.wait(20):
            raise TimeoutError(f"received {got} bytes per channel of {expected} in all within 20 s")
        return got
    finally:
        holder[0].close(1.0)


def _sender(config: TransportConfig, endpoints: list[str], control_tos: int | None) -> None:
    finished = threading.Event()
    transport = open_transport("sender", config, lambda *_: finished.set())
    try:
        if control_tos is None:
            transport.connect("receiver", endpoints)
        else:  # as a node dials its scheduler
            transport.connect("receiver", endpoints, control=True, tos=control_tos)
        chunk = np.ones(CHUNK, np.uint8)
        for channel in range(config.channels):
            for key in range((channel + 1) * PER_CHANNEL // CHUNK):
                transport.send("receiver", channel, Message(Kind.PUSH, key=key, dtype="uint8", shape=chunk.shape,
                                                            payload=chunk))
        if not finished.wait(20):
            raise TimeoutError("no reply from the receiver that every chunk arrived within 20 s")
    finally:
        transport.close(0.5)


def _send_through(bed: Netbed, config: TransportConfig, control_tos: int | None) -> list[int]:
    expected = sum((c + 1) * PER_CHANNEL for c in range(config.channels))
    with Children() as children:
        announce = children.queue()
        receiver = replace(config, host=bed.hosts["r"].address)
        start_in(children, bed, "r", "receiver", _receiver, receiver, expected, announce)
        endpoints = announced(children, "receiver", announce, "its endpoints", timeout=20)
        start_in(children, bed, "s", "sender", _sender, config, endpoints, control_tos)
        got: list[int] = children.collect(["receiver", "sender"], 40)["receiver"]
    return got


@requires_testbed
@pytest.mark.timeout(60)
@pytest.mark.parametrize(("settings", "control_tos", "marks"), [
    ({}, None, (0x90, None, 0x28)),
    ({"tos": EXPLICIT}, None, EXPLICIT),
    ({"marks": False}, None, (None, None, None)),
    ({}, 0xC0, (0xC0, 0xC0, 0xC0)),
    ({"marks": False}, 0xC0, (None, None, None)),
], ids=["default-marks", "explicit-tos", "marks-off", "control", "control-marks-off"])
def test_each_channel_lands_in_the_class_of_its_mark(settings: dict[str, Any], control_tos: int | None,
                                                     marks: tuple[int | None, ...]) -> None:
    """Bytes counted by the htb class of each ToS, on the sender's link out and the receiver's link in,
    match what was sent on the channels carrying that mark (None: no mark, the default class). A connection
    made with a ToS of its own (a node's to its scheduler) carries it on every channel, where packets are
    marked at all."""
    # two bare transports, no job: CURVE is off (its cost is bench/curve_cost.py's subject)
    config = TransportConfig(channels=3, chunk_bytes=CHUNK, inflight_bytes=4 * CHUNK, shm=False, curve=False,
                             **settings)
    with Netbed() as bed:
        bed.host("s", rate_mbit=1000, tos_classes=CLASSES)
        bed.host("r", rate_mbit=1000, tos_classes=CLASSES)
        before = {"out": bed.class_bytes("s", "out"), "in": bed.class_bytes("r", "in")}
        got = _send_through(bed, config, control_tos)
        assert got == [(c + 1) * PER_CHANNEL for c in range(3)]
        sides: list[tuple[Direction, str]] = [("out", "s"), ("in", "r")]
        for direction, host in sides:
            after = bed.class_bytes(host, direction)
            for tos in after:
                counted = after[tos] - before[direction][tos]
                sent = sum((c + 1) * PER_CHANNEL for c, mark in enumerate(marks) if mark == tos)
                # headers add about 4% (TCP/IP per 1448-byte segment, ZeroMQ and msgpack per message) and
                # a loaded machine retransmits a few segments more (CI counted +11% once); a class with nothing
                # sent sees at most a few small control packets. A wrong mark moves whole MiB between classes
                # (channel c carries c + 1 MiB), far beyond this slack.
                assert sent <= counted <= sent * 1.2 + 64 * 1024, (direction, hex(tos or 0), tos, counted, sent)


# ---------------------------------------------------------------------------- the benchmarks' quick runs
def _bench(script: str, out: Path, *extra: str, timeout: float = 50) -> str:
    """Run a benchmark's --quick setting, bounded in time; it must succeed."""
    result = run_script([script, "--quick", "--json", str(out), *extra], timeout)
    assert result.returncode == 0, result.stdout[-3000:]
    return str(result.stdout)


def _records(path: Path) -> dict[str, dict[str, Any]]:
    records = json.loads(path.read_text())
    for rec in records:
        assert rec["ours"] > 0 and rec["peer"] > 0 and rec["unit"] == "ms" and rec["peer_name"], rec
        assert rec["ratio"] == pytest.approx(rec["ours"] / rec["peer"], rel=1e-12), rec
    return {rec["case"]: rec for rec in records}


@requires_testbed
@pytest.mark.slow
@pytest.mark.timeout(60)
def test_hol_latency_quick_run_is_sane(tmp_path: Path) -> None:
    stdout = _bench("bench/hol_latency.py", tmp_path / "hol.json")
    records = _records(tmp_path / "hol.json")
    assert set(records) == {"hol-p50-bands", "hol-p99-bands", "hol-p50-nobands", "hol-p99-nobands"}
    bands = records["hol-p50-bands"]
    # the FIFO's p50 is about half the transfer (~0.28 s): far above what a loaded machine adds to ours
    assert bands["speedup"] > 10, bands
    assert records["hol-p50-nobands"]["speedup"] > 5, records["hol-p50-nobands"]
    assert bands["during"] == bands["samples"], "every urgent message must be sent during the transfer"
    assert 1.0 < bands["chunk_time_ms"] < 6.0, bands  # 256 KiB at somewhat under 1 Gbit/s
    assert "chunk-time" in stdout and "target" in stdout


@requires_testbed
@pytest.mark.slow
@pytest.mark.timeout(60)
def test_network_marks_quick_run_is_sane(tmp_path: Path) -> None:
    # reno (always allowed in a namespace) fills the bottleneck's queue, so unmarked urgent packets wait
    # tens of ms behind B's; bbr, often the default, keeps that queue short and the gap small
    _bench("bench/network_marks.py", tmp_path / "marks.json", "--cc", "reno")
    records = _records(tmp_path / "marks.json")
    assert set(records) == {"marks-p50", "marks-p99"}
    p50 = records["marks-p50"]
    assert p50["cc"] == "reno"
    assert p50["ours"] * 3 < p50["peer"], p50
    on, off = p50["class_bytes_on"], p50["class_bytes_off"]
    a_bytes = p50["count"] * p50["a_kib"] * 1024
    assert a_bytes <= on["0x90"] < a_bytes * 1.2 + 64 * 1024, on  # A's messages alone in the urgent class
    assert on["0x28"] > 10 * 2**20 and on["0x00"] < 64 * 1024, on  # B's bulk in the bulk class
    assert off["0x00"] > 10 * 2**20 and off["0x90"] < 64 * 1024 and off["0x28"] < 64 * 1024, off
    # B did load the bottleneck; unmarked, its goodput over A's short window falls when the two cores are busy
    # (CI ran 260 Mbit/s with a 233 ms queue in front of A): the queue A waited behind is asserted above
    assert p50["b_mbit_on"] > 300 and p50["b_mbit_off"] > 100, p50
