"""A shaped-network testbed: hosts in network namespaces on a bridge, links shaped with tbf.

Every host is a namespace `<tag>-<name>` with one interface `eth0` (a veth pair whose other end, the
host's port, sits on a bridge in the switch namespace `<tag>-sw`), an address in 198.18.0.0/15 (the
range set aside for network benchmarks), and optionally a rate limit on both directions of its link
(tbf) with either the kernel's three strict ToS bands (pfifo_fast) or an htb class per ToS value
under it (see qdisc.py). pfifo_fast picks a band from a packet's skb->priority, which Linux derives
from the ToS only for packets a host makes itself: on the switch's side of a link (a host's "in"
direction, an uplink) forwarded packets all land in one band, so the bands order only a host's own
egress; `tos_classes` (matched on the ToS byte) order both, as a switch does.
Nothing touches the root namespace. Deleting a namespace deletes its
interfaces and their qdiscs, so `close()` (also run on exceptions and, through `__exit__`, on
Ctrl-C) removes everything; namespaces of a testbed whose process died are removed on the next
start. Needs root and iproute2; `NetbedUnavailable` says why when they are missing.

Racks make oversubscription a parameter: `rack()` adds a rack switch, a bridge `br-<rack>` in the
switch namespace joined to the core bridge br0 by a veth pair, the uplink, shaped on its own (both
directions, same tbf / ToS bands / htb classes as host links; racks.py). A host given `rack=` gets
its port on that rack's bridge, others stay on br0. `set_rate` and `set_uplink` re-rate a shaped
link at run time, keeping what is under its tbf; `uplink_tc_stats` and `uplink_class_bytes` read an
uplink's counters like `tc_stats` and `class_bytes` read a host link's.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from testbed.qdisc import ClassCounters, change_rate, check_tos_classes, choke, leaf_ids, parse_class_stats, shape
from testbed.racks import CORE, Rack, UplinkDirection, build_rack

__all__ = ["PREFIX", "ClassCounters", "Direction", "Host", "Netbed", "NetbedUnavailable", "Rack", "UplinkDirection",
           "check_available", "remove_stale", "shape"]

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
    #: the rack whose bridge has this host's port (None: the core bridge br0)
    rack: str | None = None


@dataclass
class Netbed:
    """Hosts on a switch, or on racks joined to it; `host()` adds one, `run()` starts a command inside a host."""

    tag: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}")
    hosts: dict[str, Host] = field(default_factory=dict)
    racks: dict[str, Rack] = field(default_factory=dict)
    #: how much traffic (in ms at the link's rate) a shaped link queues before it drops
    queue_ms: float = 100.0
    _processes: list[subprocess.Popen[Any]] = field(default_factory=list)
    _made: list[str] = field(default_factory=list)

    def __enter__(self) -> Netbed:
        check_available()
        remove_stale()
        try:
            self._netns(f"{self.tag}-sw")
            self._in(f"{self.tag}-sw", "ip", "link", "add", CORE, "type", "bridge")
            self._in(f"{self.tag}-sw", "ip", "link", "set", CORE, "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def rack(
        self, name: str, uplink_mbit: float | None = None, tos_bands: bool = False, tos_classes: Sequence[int] = ()
    ) -> Rack:
        """A new rack switch joined to the core switch by an uplink shaped to `uplink_mbit` both ways
        (None: unshaped), with ToS bands or htb classes under the shaper as on a host link."""
        _check_link("rack", name, self.racks, uplink_mbit, tos_bands, tos_classes)
        self.racks[name] = build_rack(f"{self.tag}-sw", name, uplink_mbit, tos_bands, tos_classes,
                                      self.queue_ms)
        return self.racks[name]

    def host(
        self, name: str, rate_mbit: float | None = None, tos_bands: bool = False, tos_classes: Sequence[int] = (),
        *, rack: str | None = None,
    ) -> Host:
        """A new host on the core switch, or on `rack`'s, its link shaped to `rate_mbit` both ways (None: unshaped).

        Under the shaper go pfifo_fast's three ToS bands (`tos_bands`) or an htb class per value of
        `tos_classes`, the first value the most urgent (qdisc.py); either needs a rate.
        """
        _check_link("host", name, self.hosts, rate_mbit, tos_bands, tos_classes)
        if rack is not None and rack not in self.racks:
            raise ValueError(f"no rack {rack!r} (racks: {', '.join(self.racks) or 'none'}): add it with rack() first")
        index = len(self.hosts) + 1
        netns, switch = f"{self.tag}-{name}", f"{self.tag}-sw"
        outer = f"h{index}-{name}"  # the switch's port towards this host (at most 15 characters)
        self._netns(netns)
        self._in(netns, "ip", "link", "add", "eth0", "type", "veth", "peer", "name", outer, "netns", switch)
        self._in(switch, "ip", "link", "set", outer, "master", CORE if rack is None else self.racks[rack].bridge, "up")
        address = f"{_SUBNET}.{index // 250}.{index % 250 + 1}"
        self._in(netns, "ip", "addr", "add", f"{address}/15", "dev", "eth0")
        self._in(netns, "ip", "link", "set", "eth0", "up")
        self._in(netns, "ip", "link", "set", "lo", "up")
        if rate_mbit is not None:
            for ns, dev in ((netns, "eth0"), (switch, outer)):  # host -> switch and switch -> host
                shape(ns, dev, rate_mbit, tos_bands, tos_classes, self.queue_ms)
        self.hosts[name] = Host(name, netns, address, rate_mbit, outer, tuple(tos_classes), rack)
        return self.hosts[name]

    def set_rate(self, host: str, mbit: float) -> None:
        """Re-rate `host`'s shaped link to `mbit`, both directions, keeping its ToS bands or classes."""
        record = self.hosts[host]
        if record.rate_mbit is None:
            raise ValueError(f"host {host!r}'s link is not shaped: give host() a rate_mbit to change it later")
        _check_rate(mbit)
        change_rate(record.netns, "eth0", mbit, record.tos_classes, self.queue_ms)
        change_rate(f"{self.tag}-sw", record.port, mbit, record.tos_classes, self.queue_ms)
        record.rate_mbit = mbit

    def choke(self, host: str, towards: str) -> None:
        """Stall what `host` sends to host `towards` (8 kbit/s; `host`'s link unshaped), everything else as it was."""
        if self.hosts[host].rate_mbit is not None:
            raise ValueError(f"host {host!r}'s link is shaped: choke() takes an unshaped one")
        choke(self.hosts[host].netns, "eth0", self.hosts[towards].address)

    def set_uplink(self, rack: str, mbit: float) -> None:
        """Re-rate `rack`'s shaped uplink to `mbit`, both directions, keeping its ToS bands or classes."""
        record = self.racks[rack]
        if record.uplink_mbit is None:
            raise ValueError(f"rack {rack!r}'s uplink is not shaped: give rack() an uplink_mbit to change it later")
        _check_rate(mbit)
        for port in (record.uplink_port_up, record.uplink_port_down):
            change_rate(f"{self.tag}-sw", port, mbit, record.tos_classes, self.queue_ms)
        record.uplink_mbit = mbit

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
                hint = (f" (congestion controls a namespace may choose: {allowed}; as root, allow another with "
                        f"sysctl -w net.ipv4.tcp_allowed_congestion_control='{allowed} {value}')")
            raise ValueError(f"cannot set {name}={value} in host {host!r}: {done.stderr.strip()}{hint}")

    def congestion_control(self, name: str = "") -> str:
        """Give every host so far TCP congestion control `name` (empty: keep the root namespace's, which each
        namespace starts with); the one in force. ValueError, saying how to allow it, where a namespace may
        not choose it."""
        for host in self.hosts if name else ():
            self.sysctl(host, "net.ipv4.tcp_congestion_control", name)
        return name or root_congestion_control()

    def link_bytes(self, host: str) -> tuple[int, int]:
        """Bytes `host` has sent and received on its link so far (its eth0's counters)."""
        shown = json.loads(self._in(self.hosts[host].netns, "ip", "-s", "-j", "link", "show", "eth0").stdout)
        stats = shown[0]["stats64"]
        return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])

    def tc_stats(self, host: str, direction: Direction = "out") -> str:
        """`tc -s qdisc` of one direction of a host's link: bytes and packets per qdisc."""
        return self._tc_show(*self._host_end(host, direction), "qdisc")

    def class_stats(self, host: str, direction: Direction = "out") -> dict[int | None, ClassCounters]:
        """Counters of the htb ToS classes of one direction of a host's link, by ToS (None: the
        default class, for packets whose ToS has no class)."""
        return self._classes(f"host {host!r}'s link ({direction})", self.hosts[host].tos_classes,
                             *self._host_end(host, direction))

    def class_bytes(self, host: str, direction: Direction = "out") -> dict[int | None, int]:
        """Bytes sent so far by each htb ToS class of one direction of a host's link, by ToS."""
        return {tos: counters.bytes for tos, counters in self.class_stats(host, direction).items()}

    def uplink_tc_stats(self, rack: str, direction: UplinkDirection = "up") -> str:
        """`tc -s qdisc` of one direction of a rack's uplink: bytes and packets per qdisc."""
        return self._tc_show(*self._uplink_end(rack, direction), "qdisc")

    def uplink_class_bytes(self, rack: str, direction: UplinkDirection = "up") -> dict[int | None, int]:
        """Bytes sent so far by each htb ToS class of one direction of a rack's uplink, by ToS."""
        found = self._classes(f"rack {rack!r}'s uplink ({direction})", self.racks[rack].tos_classes,
                              *self._uplink_end(rack, direction))
        return {tos: counters.bytes for tos, counters in found.items()}

    def _host_end(self, host: str, direction: Direction) -> tuple[str, str]:
        """(namespace, interface) whose egress carries `direction`'s traffic of `host`'s link."""
        record = self.hosts[host]
        return (record.netns, "eth0") if direction == "out" else (f"{self.tag}-sw", record.port)

    def _uplink_end(self, rack: str, direction: UplinkDirection) -> tuple[str, str]:
        return f"{self.tag}-sw", self.racks[rack].uplink_port(direction)

    def _tc_show(self, netns: str, dev: str, what: str) -> str:
        return self._in(netns, "tc", "-s", what, "show", "dev", dev).stdout

    def _classes(self, link: str, tos_classes: tuple[int, ...], netns: str,
                 dev: str) -> dict[int | None, ClassCounters]:
        if not tos_classes:
            raise ValueError(f"{link} has no htb ToS classes: shape it with tos_classes to count by class")
        found = parse_class_stats(self._tc_show(netns, dev, "class"))
        ids = leaf_ids(tos_classes)
        missing = sorted(set(ids) - set(found))
        if missing:
            raise RuntimeError(f"tc shows no class {', '.join(missing)} on {link}")
        return {tos: found[classid] for classid, tos in ids.items()}

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


def _check_link(kind: str, name: str, taken: dict[str, Any], rate_mbit: float | None, tos_bands: bool,
                tos_classes: Sequence[int]) -> None:
    """Raise ValueError unless a new host or rack (`kind`) may have this name and link shaping."""
    # a name goes into namespace and interface names, which the kernel caps at 15 characters
    if not re.fullmatch(r"[a-z0-9]{1,8}", name) or name in taken or name == "sw":
        raise ValueError(f"{kind} name {name!r} must be 1-8 lowercase letters or digits, new, and not 'sw'")
    if (tos_bands or tos_classes) and rate_mbit is None:
        raise ValueError(f"ToS bands or classes sit under a link's shaper: give the {kind} a rate "
                         f"({'rate_mbit' if kind == 'host' else 'uplink_mbit'})")
    if tos_bands and tos_classes:
        raise ValueError("a link has either tos_bands or tos_classes, not both")
    if tos_classes:
        check_tos_classes(tos_classes)
    if rate_mbit is not None:
        _check_rate(rate_mbit)


def _check_rate(mbit: float) -> None:
    if not mbit > 0:
        raise ValueError(f"a link's rate must be a positive number of Mbit/s, got {mbit!r}")


def root_congestion_control() -> str:
    """This machine's TCP congestion control, which every new namespace starts with."""
    return _sysctl_value("net.ipv4.tcp_congestion_control")


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
