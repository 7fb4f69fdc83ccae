"""A shaped-network testbed: hosts in network namespaces on a bridge, links shaped with tbf.

Every host is a namespace `<tag>-<name>` with one interface `eth0` (a veth pair whose other end sits
on a bridge in the switch namespace `<tag>-sw`), an address in 198.18.0.0/15 (the range set aside
for network benchmarks), and optionally a rate limit on both directions of its link (tbf) with the
kernel's three strict ToS bands (pfifo_fast) under it. Nothing touches the root namespace. Deleting
a namespace deletes its interfaces, so `close()` (also run on exceptions and, through `__exit__`,
on Ctrl-C) removes everything; namespaces of a testbed whose process died are removed on the next
start. Needs root and iproute2; `NetbedUnavailable` says why when they are missing.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

PREFIX = "sluicenb"
_SUBNET = "198.18"


class NetbedUnavailable(RuntimeError):
    """This machine cannot build the testbed (not root, no iproute2, namespaces not permitted)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


def _namespaces() -> list[str]:
    listing = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in listing.splitlines() if line.strip()]


def remove_stale() -> int:
    """Delete namespaces left by testbeds whose process is gone; the number removed."""
    removed = 0
    for name in _namespaces():
        match = re.match(rf"^{PREFIX}(\d+)-", name)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            _ip("netns", "del", name, check=False)
            removed += 1
    return removed


@dataclass
class Host:
    name: str
    netns: str
    address: str
    rate_mbit: float | None


@dataclass
class Netbed:
    """Hosts on one switch; `host()` adds one, `run()` starts a command inside a host."""

    tag: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}")
    hosts: dict[str, Host] = field(default_factory=dict)
    _processes: list[subprocess.Popen[Any]] = field(default_factory=list)
    _made: list[str] = field(default_factory=list)

    def __enter__(self) -> Netbed:
        check_available()
        remove_stale()
        try:
            self._netns(f"{self.tag}-sw")
            self._in(f"{self.tag}-sw", "ip", "link", "add", "br0", "type", "bridge")
            self._in(f"{self.tag}-sw", "ip", "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def host(self, name: str, rate_mbit: float | None = None, tos_bands: bool = False) -> Host:
        """A new host on the switch, its link shaped to `rate_mbit` both ways (None: unshaped)."""
        if not re.fullmatch(r"[a-z0-9]{1,8}", name) or name in self.hosts or name == "sw":
            raise ValueError(f"host name {name!r} must be 1-8 lowercase letters or digits, new, and not 'sw'")
        index = len(self.hosts) + 1
        netns, switch = f"{self.tag}-{name}", f"{self.tag}-sw"
        outer = f"h{index}-{name}"  # the switch's port towards this host (at most 15 characters)
        self._netns(netns)
        self._in(netns, "ip", "link", "add", "eth0", "type", "veth", "peer", "name", outer, "netns", switch)
        self._in(switch, "ip", "link", "set", outer, "master", "br0", "up")
        address = f"{_SUBNET}.{index // 250}.{index % 250 + 1}"
        self._in(netns, "ip", "addr", "add", f"{address}/15", "dev", "eth0")
        self._in(netns, "ip", "link", "set", "eth0", "up")
        self._in(netns, "ip", "link", "set", "lo", "up")
        if rate_mbit is not None:
            for ns, dev in ((netns, "eth0"), (switch, outer)):  # host -> switch and switch -> host
                shape(ns, dev, rate_mbit, tos_bands)
        self.hosts[name] = Host(name, netns, address, rate_mbit)
        return self.hosts[name]

    def run(self, host: str, argv: Sequence[str], **popen: Any) -> subprocess.Popen[Any]:
        """Start `argv` inside `host`; the testbed kills it (and its group) on close."""
        process = subprocess.Popen(
            ["ip", "netns", "exec", self.hosts[host].netns, *argv], start_new_session=True, **popen
        )
        self._processes.append(process)
        return process

    def tc_stats(self, host: str) -> str:
        """`tc -s qdisc` of a host's eth0: bytes and packets per qdisc (per ToS band under pfifo_fast)."""
        return self._in(self.hosts[host].netns, "tc", "-s", "qdisc", "show", "dev", "eth0").stdout

    def close(self) -> None:
        for process in self._processes:
            with contextlib.suppress(OSError):
                os.killpg(process.pid, 9)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(5)
        self._processes.clear()
        for netns in reversed(self._made):
            _ip("netns", "del", netns, check=False)
        self._made.clear()

    def _netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)

    @staticmethod
    def _in(netns: str, *argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["ip", "netns", "exec", netns, *argv], capture_output=True, text=True, check=True,
                              timeout=20)


def shape(netns: str, dev: str, rate_mbit: float, tos_bands: bool) -> None:
    """tbf at `rate_mbit` on `dev`'s egress; with `tos_bands`, pfifo_fast's 3 strict ToS bands under it."""
    rate = f"{rate_mbit}mbit"
    burst = f"{max(int(rate_mbit * 1000 / 8 / 250), 16)}kb"  # about 4 ms of traffic, at least 16 KiB
    base = ["ip", "netns", "exec", netns, "tc", "qdisc", "add", "dev", dev]
    subprocess.run([*base, "root", "handle", "1:", "tbf", "rate", rate, "burst", burst, "latency", "100ms"],
                   check=True, capture_output=True, timeout=20)
    if tos_bands:
        subprocess.run([*base, "parent", "1:1", "handle", "10:", "pfifo_fast"], check=True, capture_output=True,
                       timeout=20)


def check_available() -> None:
    """Raise NetbedUnavailable with the reason if this machine cannot build a testbed."""
    if os.geteuid() != 0:
        raise NetbedUnavailable("the testbed needs root (network namespaces, tc)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise NetbedUnavailable(f"{tool} (iproute2) is not installed")
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        raise NetbedUnavailable(f"cannot create a network namespace: {made.stderr.strip()}")
    _ip("netns", "del", probe, check=False)
