"""A shaped-network testbed: hosts in network namespaces on a bridge, links shaped with tbf.

Every host is a namespace `<tag>-<name>` with one interface `eth0` (a veth pair whose other end, the
host's port, sits on a bridge in the switch namespace `<tag>-sw`), an address in 198.18.0.0/15 (the
range set aside for network benchmarks), and optionally a rate limit on both directions of its link
(tbf) with either the kernel's three strict ToS bands (pfifo_fast) or an htb class per ToS value
under it (see qdisc.py). Nothing touches the root namespace. Deleting a namespace deletes its
interfaces and their qdiscs, so `close()` (also run on exceptions and, through `__exit__`, on
Ctrl-C) removes everything; namespaces of a testbed whose process died are removed on the next
start. Needs root and iproute2; `NetbedUnavailable` says why when they are missing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from bench.netbed.qdisc import ClassCounters, check_tos_classes, leaf_ids, parse_class_stats, shape

__all__ = ["PREFIX", "ClassCounters", "Direction", "Host", "Netbed", "NetbedUnavailable", "check_available",
           "remove_stale", "shape"]

PREFIX = "sluicenb"
_SUBNET = "198.18"
_CLONE_NEWNET, _PR_SET_PDEATHSIG = 0x40000000, 1

#: "out": the host's eth0 egress (host -> switch); "in": its switch port's egress (switch -> host)
Direction = Literal["out", "in"]


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
    #: the switch's interface towards this host (in the switch namespace)
    port: str = ""
    #: the ToS values that have an htb class on this host's link, most urgent first
    tos_classes: tuple[int, ...] = ()


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

    def host(
        self, name: str, rate_mbit: float | None = None, tos_bands: bool = False, tos_classes: Sequence[int] = ()
    ) -> Host:
        """A new host on the switch, its link shaped to `rate_mbit` both ways (None: unshaped).

        Under the shaper go pfifo_fast's three ToS bands (`tos_bands`) or an htb class per value of
        `tos_classes`, the first value the most urgent (qdisc.py); either needs a rate.
        """
        if not re.fullmatch(r"[a-z0-9]{1,8}", name) or name in self.hosts or name == "sw":
            raise ValueError(f"host name {name!r} must be 1-8 lowercase letters or digits, new, and not 'sw'")
        if (tos_bands or tos_classes) and rate_mbit is None:
            raise ValueError("ToS bands or classes sit under a link's shaper: give the link a rate_mbit")
        if tos_bands and tos_classes:
            raise ValueError("a link has either tos_bands or tos_classes, not both")
        if tos_classes:
            check_tos_classes(tos_classes)
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
                shape(ns, dev, rate_mbit, tos_bands, tos_classes)
        self.hosts[name] = Host(name, netns, address, rate_mbit, outer, tuple(tos_classes))
        return self.hosts[name]

    def run(self, host: str, argv: Sequence[str], **popen: Any) -> subprocess.Popen[Any]:
        """Start `argv` inside `host`; the testbed kills it (and its group) on close."""
        process = subprocess.Popen(
            ["ip", "netns", "exec", self.hosts[host].netns, *argv], start_new_session=True, **popen
        )
        self._processes.append(process)
        return process

    def enter(self, host: str) -> None:
        """Move the calling process into `host`'s network namespace, tied to its parent's life.

        For a child forked from the testbed's process: call it before the child starts any thread
        (a namespace is a per-thread attribute; threads started later inherit it). The child is
        killed when its parent dies, so a killed benchmark leaves nothing running in a namespace.
        """
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        fd = os.open(f"/run/netns/{self.hosts[host].netns}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            if libc.setns(fd, _CLONE_NEWNET) != 0:
                errno = ctypes.get_errno()
                raise OSError(errno, f"setns into {self.hosts[host].netns}: {os.strerror(errno)}")
        finally:
            os.close(fd)

    def sysctl(self, host: str, name: str, value: str) -> None:
        """Set a network sysctl of `host` (e.g. net.ipv4.tcp_congestion_control): each namespace has its own.

        Outside the root namespace the kernel refuses a congestion control that is not in the root's
        net.ipv4.tcp_allowed_congestion_control; the error says so.
        """
        argv = ["ip", "netns", "exec", self.hosts[host].netns, "sysctl", "-q", "-w", f"{name}={value}"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=20)
        if done.returncode != 0:
            hint = ""
            if name == "net.ipv4.tcp_congestion_control":
                allowed = _sysctl_value("net.ipv4.tcp_allowed_congestion_control")
                hint = f" (congestion controls a namespace may choose: {allowed})"
            raise ValueError(f"cannot set {name}={value} in host {host!r}: {done.stderr.strip()}{hint}")

    def tc_stats(self, host: str, direction: Direction = "out") -> str:
        """`tc -s qdisc` of one direction of a host's link: bytes and packets per qdisc."""
        return self._tc_show(host, direction, "qdisc")

    def class_stats(self, host: str, direction: Direction = "out") -> dict[int | None, ClassCounters]:
        """Counters of the htb ToS classes of one direction of a host's link, by ToS (None: the
        default class, for packets whose ToS has no class)."""
        found = parse_class_stats(self._tc_show(host, direction, "class"))
        ids = leaf_ids(self.hosts[host].tos_classes)
        missing = sorted(set(ids) - set(found))
        if not self.hosts[host].tos_classes:
            raise ValueError(f"host {host!r} has no htb ToS classes on its link")
        if missing:
            raise RuntimeError(f"tc shows no class {', '.join(missing)} on host {host!r}'s link ({direction})")
        return {tos: found[classid] for classid, tos in ids.items()}

    def class_bytes(self, host: str, direction: Direction = "out") -> dict[int | None, int]:
        """Bytes sent so far by each htb ToS class of one direction of a host's link, by ToS."""
        return {tos: counters.bytes for tos, counters in self.class_stats(host, direction).items()}

    def _tc_show(self, host: str, direction: Direction, what: str) -> str:
        record = self.hosts[host]
        netns, dev = (record.netns, "eth0") if direction == "out" else (f"{self.tag}-sw", record.port)
        return self._in(netns, "tc", "-s", what, "show", "dev", dev).stdout

    def close(self) -> None:
        for process in self._processes:
            if process.poll() is not None:  # reaped: its pid (and group id) may belong to someone else now
                continue
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


def _sysctl_value(name: str) -> str:
    with contextlib.suppress(OSError), open(f"/proc/sys/{name.replace('.', '/')}") as file:
        return file.read().strip()
    return "unknown"


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


def ready_for(benchmark: str) -> bool:
    """Whether `benchmark` can build a testbed here; if not, print why (it is then skipped, exit 0).
    When it can, SIGTERM unwinds the program like Ctrl-C, so the testbed is removed either way."""
    try:
        check_available()
    except NetbedUnavailable as exc:
        print(f"{benchmark}: skipped, the shaped-network testbed is unavailable here: {exc}", flush=True)
        return False
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    return True
