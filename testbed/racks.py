"""Racks for the netbed testbed: a bridge per rack in the switch namespace, joined to the core by a shaped uplink."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from testbed.qdisc import shape

#: "up": rack -> core (the uplink's rack-side end's egress); "down": core -> rack (its core-side end's egress)
UplinkDirection = Literal["up", "down"]

#: the core bridge, where hosts without a rack and every rack's uplink are ports
CORE = "br0"


@dataclass
class Rack:
    name: str
    uplink_mbit: float | None
    #: the uplink's rack-side end, a port of the rack's bridge: its egress carries rack -> core traffic
    uplink_port_up: str = ""
    #: the uplink's core-side end, a port of br0: its egress carries core -> rack traffic
    uplink_port_down: str = ""
    #: the ToS values that have an htb class on the uplink, most urgent first
    tos_classes: tuple[int, ...] = ()
    #: the rack's bridge (in the switch namespace), where its hosts' ports are
    bridge: str = ""

    def uplink_port(self, direction: UplinkDirection) -> str:
        """The interface whose egress carries `direction`'s traffic."""
        if direction not in ("up", "down"):
            raise ValueError(f"an uplink's direction is 'up' (rack -> core) or 'down' (core -> rack), "
                             f"not {direction!r}")
        return self.uplink_port_up if direction == "up" else self.uplink_port_down


def build_rack(switch: str, name: str, uplink_mbit: float | None, tos_bands: bool = False,
               tos_classes: Sequence[int] = (), queue_ms: float = 100.0) -> Rack:
    """Make rack `name`'s bridge in namespace `switch` and its uplink to br0, shaped both ways if
    `uplink_mbit` is given; the caller validates the arguments. Deleting `switch` deletes it all."""
    # names at most 15 characters: a rack's name has at most 8 (and no '-', so "br-0" is not "br0")
    rack = Rack(name, uplink_mbit, f"up-{name}", f"dn-{name}", tuple(tos_classes), f"br-{name}")
    _sw(switch, "ip", "link", "add", rack.bridge, "type", "bridge")
    _sw(switch, "ip", "link", "set", rack.bridge, "up")
    _sw(switch, "ip", "link", "add", rack.uplink_port_up, "type", "veth", "peer", "name", rack.uplink_port_down)
    _sw(switch, "ip", "link", "set", rack.uplink_port_up, "master", rack.bridge, "up")
    _sw(switch, "ip", "link", "set", rack.uplink_port_down, "master", CORE, "up")
    if uplink_mbit is not None:
        for port in (rack.uplink_port_up, rack.uplink_port_down):  # rack -> core and core -> rack
            shape(switch, port, uplink_mbit, tos_bands, tos_classes, queue_ms)
    return rack


def _sw(netns: str, *argv: str) -> None:
    done = subprocess.run(["ip", "netns", "exec", netns, *argv], capture_output=True, text=True, timeout=20)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} in namespace {netns} failed: {done.stderr.strip()}")
