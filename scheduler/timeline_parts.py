"""Timeline parts gathered over the job's own connections: each process streams its part to the scheduler at its end.

Why every process sends, not only those on other hosts: one path is tested by every timeline job, a
process cannot tell whether the launcher's host sees its files (a shared home directory or not), and a
part crosses loopback in well under a second at the end of a job. A process sends its part as TIMELINE
messages to the scheduler (`send_part`: chunks of CHUNK_BYTES, at most WINDOW unacknowledged, every
wait bounded), a worker before its goodbye, a server after the scheduler's SHUTDOWN; the scheduler
(`Gatherer`) checks each chunk before it keeps it (its sequence, its size, every line an event object
of the trace's shape, the job's total under `timeline.gather_mib`), writes it to disk at once, and
answers TIMELINE_ACK, or TIMELINE_ACK with `refused`, after which the sender keeps its part where it
wrote it and says so. The scheduler runs on the launcher's host, where `merge` finds the parts.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from sluice.errors import SluiceError
from sluice.scheduler.members import Node
from sluice.scheduler.node import ControlClient
from sluice.transport.timeline import gathered_path
from sluice.transport.wire import Kind, Message, WireError, brief, meta_field

log = logging.getLogger("sluice.timeline")

CHUNK_BYTES = 256 << 10
#: chunks a sender may have unacknowledged: bounds the memory either side holds for a part
WINDOW = 4
#: how long a sender waits for each acknowledgement, and the scheduler for the servers' parts at the end
TIMEOUT_S = 30.0
#: a line of a part (one event) longer than this is refused: our events are well under 4 KiB
MAX_LINE_BYTES = 64 << 10

Out = tuple[str, Message]


def send_part(control: ControlClient, part: Path) -> str | None:
    """Stream `part` to the scheduler and remove it once the scheduler kept all of it; None then, else why
    not (the part stays where it is)."""
    try:
        file = part.open("rb")
    except OSError as exc:
        return f"cannot read {part}: {exc.strerror}"
    seq = acked = 0
    with file:
        try:
            while True:
                data = file.read(CHUNK_BYTES)
                last = len(data) < CHUNK_BYTES
                control.send(Kind.TIMELINE, seq=seq, data=data, last=last)
                seq += 1
                while seq - acked > WINDOW or (last and acked < seq):
                    ack = control.wait_for((Kind.TIMELINE_ACK, acked), TIMEOUT_S,
                                           f"the scheduler to take chunk {acked} of this process's timeline part")
                    refused = (ack.meta or {}).get("refused")
                    if refused is not None:
                        return f"the scheduler refused it: {refused}"
                    acked += 1
                if last:
                    break
        except (OSError, SluiceError) as exc:
            return str(exc)
    part.unlink(missing_ok=True)
    return None


def check_lines(lines: list[bytes]) -> str | None:
    """None when every line is a trace's line ('[', ']', blank, or an event object, a comma after it);
    else what is wrong with the first that is not."""
    for number, raw in enumerate(lines):
        line = raw.strip().rstrip(b",")
        if line in (b"", b"[", b"]"):
            continue
        try:
            event = json.loads(line)
        except ValueError:
            return f"line {number} of a chunk is not JSON"
        if (type(event) is not dict or type(event.get("ph")) is not str or type(event.get("pid")) is not int
                or type(event.get("name", "")) is not str or type(event.get("ts", 0.0)) not in (int, float)):
            return f"line {number} of a chunk is not a trace event (an object with ph, pid, name, ts)"
    return None


@dataclass
class _Incoming:
    file: BinaryIO
    tmp: Path
    final: Path
    seq: int = 0
    size: int = 0
    rest: bytes = b""


class Gatherer:
    """The scheduler's side: parts in, validated, on disk as `gathered_path`, acknowledged."""

    def __init__(self, path: str, limit_mib: int) -> None:
        self.path, self.limit = path, limit_mib << 20
        self.total = 0
        self._incoming: dict[str, _Incoming] = {}
        #: nodes whose part is complete or was refused: nothing more is taken from them
        self.finished: set[str] = set()

    def take(self, node: Node | None, msg: Message) -> list[Out]:
        """A TIMELINE chunk from `node` (None: not registered: WireError); the acknowledgement to send."""
        if node is None:
            raise WireError("TIMELINE from a node that is not registered")
        seq, data = meta_field(msg, "seq", int), meta_field(msg, "data", bytes)
        last = meta_field(msg, "last", bool)
        if node.name in self.finished:
            raise WireError(f"TIMELINE chunk {seq} from {node.describe()}, whose part is already finished")
        problem = self._problem(node, seq, data, last)
        if problem is None:
            problem = self._keep(node, seq, data, last)
        if problem is not None:
            self._drop(node.name)
            self.finished.add(node.name)
            log.warning("timeline: the part of %s is refused: %s", node.describe(), problem)
            return [(node.name, Message(Kind.TIMELINE_ACK, sender=0, meta={"seq": seq, "refused": problem}))]
        return [(node.name, Message(Kind.TIMELINE_ACK, sender=0, meta={"seq": seq}))]

    def _keep(self, node: Node, seq: int, data: bytes, last: bool) -> str | None:
        """Write a checked chunk; at the last, put the part in place. None, or why the disk refused it."""
        incoming = self._incoming[node.name]
        try:
            incoming.file.write(data)
            if last:
                incoming.file.close()
                incoming.tmp.replace(incoming.final)
        except OSError as exc:
            return f"the scheduler cannot write {incoming.tmp}: {exc.strerror}"
        incoming.seq, incoming.size = seq + 1, incoming.size + len(data)
        self.total += len(data)
        if last:
            del self._incoming[node.name]
            self.finished.add(node.name)
            log.info("timeline: the part of %s arrived (%d bytes): %s", node.describe(), incoming.size, incoming.final)
        return None

    def _problem(self, node: Node, seq: int, data: bytes, last: bool) -> str | None:
        """Why this chunk is refused (None: it is kept); opens the part's file at its first chunk."""
        incoming = self._incoming.get(node.name)
        expected = incoming.seq if incoming is not None else 0
        if seq != expected:
            return f"chunk {brief(seq)} came where chunk {expected} was due"
        if len(data) > CHUNK_BYTES:
            return f"a chunk of {len(data)} bytes is over the {CHUNK_BYTES} a chunk may hold"
        if self.total + len(data) > self.limit:
            return (f"the job's parts would pass timeline.gather_mib = {self.limit >> 20} MiB; raise it to "
                    f"gather more")
        lines = ((incoming.rest if incoming is not None else b"") + data).split(b"\n")
        rest = b"" if last else lines.pop()
        if len(rest) > MAX_LINE_BYTES or any(len(line) > MAX_LINE_BYTES for line in lines):
            return f"a line is longer than {MAX_LINE_BYTES} bytes"
        problem = check_lines(lines)
        if problem is not None:
            return problem
        if incoming is None:
            final = gathered_path(self.path, node.role, node.rank, node.pid)
            tmp = final.with_suffix(".tmp")
            try:
                tmp.parent.mkdir(parents=True, exist_ok=True)
                incoming = self._incoming[node.name] = _Incoming(tmp.open("wb"), tmp, final)
            except OSError as exc:
                return f"the scheduler cannot write {tmp}: {exc.strerror}"
        incoming.rest = rest
        return None

    def _drop(self, name: str) -> None:
        incoming = self._incoming.pop(name, None)
        if incoming is not None:
            incoming.file.close()
            incoming.tmp.unlink(missing_ok=True)

    def close(self) -> None:
        """The scheduler stops: parts still incoming are incomplete, and removed."""
        for name in list(self._incoming):
            self._drop(name)

