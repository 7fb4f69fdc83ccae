"""Queueing disciplines for netbed links: tbf shaping, pfifo_fast ToS bands or htb ToS classes, counters.

A shaped link's egress is `tbf` (handle 1:) at the link rate. Under it goes one of:

  * pfifo_fast (handle 10:): the kernel's three strict bands, chosen by the socket priority that
    Linux derives from the ToS byte (0x90 -> band 0, 0x00 -> band 1, 0x28 -> band 2). It keeps no
    per-band counters.
  * an htb tree (handle 10:): root class 10:1 at the link rate; leaf class 10:(100+i) for the i-th
    ToS value, htb `prio` i, so the first value is the most urgent; a default leaf 10:1ff, the least
    urgent, for packets no filter matches (ARP, other ToS values). A u32 filter per value matches
    the ToS byte under the mask 0xfc (the two ECN bits are not part of the mark). Every leaf is
    guaranteed only a small rate (1% of the link) and may borrow up to the link rate; spare
    bandwidth is lent by `prio`, so in effect the classes are served in strict priority. Each leaf
    counts its own bytes and packets, which `parse_class_stats` reads from `tc -s class show`.

`change_rate` re-rates a shaped link at run time without rebuilding what is under its tbf.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

#: htb allows priorities 0..7; the default class takes the last one
MAX_TOS_CLASSES = 7
_LEAF_BASE, _DEFAULT_LEAF = 0x100, 0x1FF


@dataclass(frozen=True)
class ClassCounters:
    """What one htb class has sent since it was made."""

    bytes: int
    packets: int


def leaf_ids(tos_classes: Sequence[int]) -> dict[str, int | None]:
    """tc's name of each leaf class ("10:100") -> the ToS it carries (None: the default class)."""
    ids: dict[str, int | None] = {f"10:{_LEAF_BASE + i:x}": tos for i, tos in enumerate(tos_classes)}
    ids[f"10:{_DEFAULT_LEAF:x}"] = None
    return ids


def check_tos_classes(tos_classes: Sequence[int]) -> None:
    """Raise ValueError unless the values can each have a class of their own."""
    if not 1 <= len(tos_classes) <= MAX_TOS_CLASSES:
        raise ValueError(f"tos_classes needs 1..{MAX_TOS_CLASSES} values (htb has 8 priorities, one is the "
                         f"default class's), got {len(tos_classes)}")
    if any(not 0 <= t <= 255 or t & 0x03 for t in tos_classes):
        raise ValueError(f"tos_classes must be ToS bytes with the ECN bits clear, got {[hex(t) for t in tos_classes]}")
    if len(set(tos_classes)) != len(tos_classes):
        raise ValueError(f"tos_classes has a value twice: {[hex(t) for t in tos_classes]}")


def burst_bytes(rate_mbit: float) -> int:
    """About 4 ms of traffic at the rate, at least 16 KiB."""
    return max(int(rate_mbit * 1000 / 8 / 250), 16) * 1024


def _tc(netns: str, *argv: str) -> None:
    command = ["ip", "netns", "exec", netns, "tc", *argv]
    done = subprocess.run(command, capture_output=True, text=True, timeout=20)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()}")


def shape(netns: str, dev: str, rate_mbit: float, tos_bands: bool = False, tos_classes: Sequence[int] = (),
          queue_ms: float = 100.0) -> None:
    """tbf at `rate_mbit` on `dev`'s egress, with pfifo_fast bands or htb ToS classes under it; the tbf
    queues at most `queue_ms` of traffic and drops the rest (a switch port's buffer)."""
    if tos_bands and tos_classes:
        raise ValueError("a link has either tos_bands or tos_classes, not both")
    rate, burst = f"{rate_mbit}mbit", f"{burst_bytes(rate_mbit)}b"
    _tc(netns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf", "rate", rate, "burst", burst,
        "latency", f"{queue_ms:g}ms")
    if tos_bands:
        _tc(netns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "pfifo_fast")
    elif tos_classes:
        _tos_classes(netns, dev, rate_mbit, tos_classes)


def choke(netns: str, dev: str, destination: str) -> None:
    """Hold back what `dev` sends to `destination` (an address) at 8 kbit/s, the rest unshaped: a path that stalls
    before its host is lost. `dev` must have no root qdisc of the bed's (an unshaped link)."""
    _tc(netns, "qdisc", "add", "dev", dev, "root", "handle", "2:", "htb", "default", "1", "r2q", "1")
    _tc(netns, "class", "add", "dev", dev, "parent", "2:", "classid", "2:1", "htb", "rate", "10gbit")
    _tc(netns, "class", "add", "dev", dev, "parent", "2:", "classid", "2:2", "htb", "rate", "8kbit", "ceil", "8kbit")
    _tc(netns, "filter", "add", "dev", dev, "parent", "2:", "protocol", "ip", "u32", "match", "ip", "dst",
        f"{destination}/32", "flowid", "2:2")


def change_rate(netns: str, dev: str, rate_mbit: float, tos_classes: Sequence[int] = (),
                queue_ms: float = 100.0) -> None:
    """Set the rate of a link shaped by `shape` in place, keeping the bands or classes under its tbf.

    For htb ToS classes the root class and every leaf's ceiling (and 1% floor) follow, so the classes
    still share exactly the new link rate; `tos_classes` must be those the link was shaped with.
    """
    rate, burst = f"{rate_mbit}mbit", f"{burst_bytes(rate_mbit)}b"
    # `change` (not replace) keeps tbf's child qdisc and what is queued in it
    _tc(netns, "qdisc", "change", "dev", dev, "root", "handle", "1:", "tbf", "rate", rate, "burst", burst,
        "latency", f"{queue_ms:g}ms")
    if tos_classes:
        _tc(netns, "class", "change", "dev", dev, "parent", "10:", "classid", "10:1", "htb", "rate", rate,
            "ceil", rate, "burst", burst, "cburst", burst)
        for classid, prio in _leaves(tos_classes):
            _tc(netns, "class", "change", "dev", dev, "parent", "10:1", "classid", classid, "htb", "rate",
                f"{rate_mbit / 100}mbit", "ceil", rate, "cburst", burst, "prio", str(prio))


def _leaves(tos_classes: Sequence[int]) -> list[tuple[str, int]]:
    """(class id, htb prio) of each leaf: one per ToS value in order, then the default class, last."""
    return [*((f"10:{_LEAF_BASE + i:x}", i) for i in range(len(tos_classes))), (f"10:{_DEFAULT_LEAF:x}", 7)]


def _tos_classes(netns: str, dev: str, rate_mbit: float, tos_classes: Sequence[int]) -> None:
    check_tos_classes(tos_classes)
    rate, burst = f"{rate_mbit}mbit", f"{burst_bytes(rate_mbit)}b"
    floor = f"{rate_mbit / 100}mbit"
    _tc(netns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "htb", "default", f"{_DEFAULT_LEAF:x}")
    _tc(netns, "class", "add", "dev", dev, "parent", "10:", "classid", "10:1", "htb", "rate", rate, "ceil", rate,
        "burst", burst, "cburst", burst)
    for classid, prio in _leaves(tos_classes):
        _tc(netns, "class", "add", "dev", dev, "parent", "10:1", "classid", classid, "htb", "rate", floor,
            "ceil", rate, "cburst", burst, "prio", str(prio))
    for i, tos in enumerate(tos_classes):
        _tc(netns, "filter", "add", "dev", dev, "parent", "10:", "protocol", "ip", "prio", "1", "u32",
            "match", "ip", "tos", f"{tos:#04x}", "0xfc", "flowid", f"10:{_LEAF_BASE + i:x}")


_CLASS = re.compile(r"^class (\S+) (\S+) .*?\n\s*Sent (\d+) bytes (\d+) pkt", re.MULTILINE)


def parse_class_stats(text: str) -> dict[str, ClassCounters]:
    """The htb classes of `tc -s class show dev X` output, by class id: their byte and packet counters."""
    return {m.group(2): ClassCounters(int(m.group(3)), int(m.group(4)))
            for m in _CLASS.finditer(text) if m.group(1) == "htb"}
