"""The hosts of a multi-host job (pure): `-H host1:4,host2:4`, a hostfile, or SLURM's node list, parsed and checked.

Hostfile lines take Horovod's and DeepSpeed's shape, `HOST slots=N`, plus an optional `rack=LABEL`
that the aggregation planner can use; `#` starts a comment; a host without `slots=` has one slot.
Every error names the line (or the item) and says what the right shape is.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

#: RFC 1123 host names (labels of letters, digits and inner hyphens, dot-separated)
_HOST_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"^(?=.{{1,253}}$){_HOST_LABEL}(\.{_HOST_LABEL})*$")
_LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
MAX_SLOTS = 4096
MAX_NODES = 65536
HOSTFILE_SHAPE = "HOST [slots=N] [rack=LABEL], e.g. `node1 slots=4 rack=r1`"


class HostsError(ValueError):
    """A host list, hostfile or node list that cannot be used; the text says what is wrong and where."""


@dataclass(frozen=True)
class Host:
    name: str
    slots: int = 1
    rack: str = ""


def check_name(name: str, where: str) -> str:
    """`name` if it is a host name or an IP address; HostsError naming `where` otherwise."""
    bare = name[1:-1] if name.startswith("[") and name.endswith("]") else name
    try:
        ipaddress.ip_address(bare)
        return bare
    except ValueError:
        pass
    if not _HOSTNAME.match(name):
        raise HostsError(f"{where}: {name!r} is not a host name or an IP address")
    return name


def _slots(text: str, where: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= MAX_SLOTS:
        raise HostsError(f"{where}: slots must be a whole number from 1 to {MAX_SLOTS}, got {text!r}")
    return int(text)


def _unique(hosts: list[Host], where: str) -> list[Host]:
    seen: set[str] = set()
    for host in hosts:
        if host.name in seen:
            raise HostsError(f"{where}: host {host.name!r} is listed twice; give it once, with all its slots")
        seen.add(host.name)
    if not hosts:
        raise HostsError(f"{where}: no hosts")
    return hosts


def parse_host_list(text: str) -> list[Host]:
    """`-H host1:4,host2:4` (a host without `:N` has one slot), as Horovod's and DeepSpeed's."""
    hosts = []
    for item in (part.strip() for part in text.split(",")):
        where = f"-H item {item!r}"
        if not item:
            raise HostsError(f"-H {text!r}: an empty item; the shape is host1:4,host2:4")
        name, colon, slots = item.rpartition(":") if not item.endswith("]") else (item, "", "")
        if not colon or name.endswith(":"):  # no slots given, or a bare IPv6 address
            name, slots = item, "1"
        hosts.append(Host(check_name(name, where), _slots(slots, where)))
    return _unique(hosts, "-H")


def parse_hostfile(text: str, path: str = "hostfile") -> list[Host]:
    """The hosts of a hostfile: one `HOST [slots=N] [rack=LABEL]` a line."""
    hosts = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{path}, line {number}"
        name, *fields = line.split()
        slots, rack = 1, ""
        for field in fields:
            key, equals, value = field.partition("=")
            if not equals or key not in ("slots", "rack") or not value:
                raise HostsError(f"{where}: {field!r} is not slots=N or rack=LABEL; a line is {HOSTFILE_SHAPE}")
            if key == "slots":
                slots = _slots(value, where)
            elif not _LABEL.match(value):
                raise HostsError(f"{where}: rack label {value!r} must be letters, digits, '_', '.' or '-'")
            else:
                rack = value
        hosts.append(Host(check_name(name, where), slots, rack))
    return _unique(hosts, path)


def _split_top(text: str) -> list[str]:
    """`text` split at the commas outside brackets."""
    items, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            items.append(text[start:index])
            start = index + 1
        if depth not in (0, 1):
            raise HostsError(f"node list {text!r}: brackets do not nest")
    if depth:
        raise HostsError(f"node list {text!r}: a bracket is not closed")
    return [*items, text[start:]]


def _expand_ranges(body: str, text: str) -> list[str]:
    values = []
    for part in body.split(","):
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and (not high.isdigit() or int(high) < int(low))):
            raise HostsError(f"node list {text!r}: {part!r} is not N or N-M")
        values += [f"{value:0{len(low)}d}" for value in range(int(low), int(high if dash else low) + 1)]
        if len(values) > MAX_NODES:
            raise HostsError(f"node list {text!r}: more than {MAX_NODES} nodes")
    return values


def expand_nodelist(text: str) -> list[str]:
    """SLURM's compressed node list (`SLURM_JOB_NODELIST`), e.g. `gpu[01-03,07],cpu5` -> gpu01, gpu02,
    gpu03, gpu07, cpu5; several bracket groups multiply (`r[1-2]n[1-2]`); ranges keep their zero
    padding, as `scontrol show hostnames` does."""
    names: list[str] = []
    for item in _split_top(text.strip()):
        expanded = [""]
        for literal, body in re.findall(r"([^\[\]]*)(?:\[([^\]]*)\])?", item):
            choices = _expand_ranges(body, text) if body else [""]
            expanded = [done + literal + choice for done in expanded for choice in choices]
            if len(names) + len(expanded) > MAX_NODES:
                raise HostsError(f"node list {text!r}: more than {MAX_NODES} nodes")
        names += [check_name(name, f"node list {text!r}") for name in expanded if name]
    if not names:
        raise HostsError(f"node list {text!r}: no nodes")
    return names
