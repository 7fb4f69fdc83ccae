"""A survivor's place in its job re-formed in place: its rank, the job's size, the scheduler and its standby, as a line.

With `sluice launch --elastic --in-place`, a worker whose host is lost, and for which no slot is free,
is not replaced: the job goes on with the survivors in their own processes, numbered again from 0 in
their old order. Each survivor must know its new rank before it joins the re-formed job (its node
name, and so its CURVE keys, come from it), and the new scheduler's endpoint: a port of its own,
where no socket of a survivor's old connection (named by its old rank, which is another survivor's
new one) finds it. A job with a standby scheduler gets a new standby in each generation (on its old
port while its host is up, else on another host), so every survivor is told its place then, also
when a worker was replaced and nothing else changed. The launcher writes a `PLACE` line into a file named by
the survivor's pid in the job's elastic directory on the survivor's host (itself here; on another
host the remote stub does, told the same line on its session), then sends SIGUSR2; the survivor
reads and removes the file as it re-forms (worker/elastic/host.py). No file: its place is unchanged.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from sluice.scheduler.bootstrap import ENV_RANK, ENV_SCHEDULER, ENV_STANDBY, ENV_WORKERS

#: the first word of the line (also the remote stub's command word)
WORD = "PLACE"
#: more workers than this in one job is not a place we could have sent
MAX_WORKERS = 1 << 16
#: "tcp://" and a host name or address and a port
MAX_ENDPOINT = 300


@dataclass(frozen=True)
class Place:
    rank: int
    workers: int
    local_rank: int
    local_size: int
    #: the re-formed job's scheduler ("tcp://HOST:PORT")
    scheduler: str
    #: its standby schedulers' endpoints, comma-separated ("": none), started anew with it
    standby: str = ""

    def line(self) -> str:
        return (f"{WORD} {self.rank} {self.workers} {self.local_rank} {self.local_size} {self.scheduler}"
                + (f" {self.standby}" if self.standby else ""))

    def environ(self) -> dict[str, str]:
        """The variables that give a worker its place: Sluice's, and torchrun's that the launcher also sets."""
        return {ENV_RANK: str(self.rank), ENV_WORKERS: str(self.workers), ENV_SCHEDULER: self.scheduler,
                ENV_STANDBY: self.standby,
                "RANK": str(self.rank),
                "WORLD_SIZE": str(self.workers), "LOCAL_RANK": str(self.local_rank),
                "LOCAL_WORLD_SIZE": str(self.local_size)}


def parse_place(line: str) -> Place:
    """A PLACE line, checked (ValueError saying what is wrong)."""
    words = line.split()
    if len(words) not in (6, 7) or words[0] != WORD or not all(w.isdigit() for w in words[1:5]):
        raise ValueError(f"not a {WORD} line of four numbers and one or two endpoints: {line[:80]!r}")
    for word in [words[5], *(words[6].split(",") if len(words) == 7 else [])]:  # the standbys', comma-separated
        if not (word.startswith("tcp://") and len(word) <= MAX_ENDPOINT and word.isprintable()):
            raise ValueError(f"not a scheduler endpoint: {word[:80]!r}")
    rank, workers, local_rank, local_size = (int(w) for w in words[1:5])
    place = Place(rank, workers, local_rank, local_size, *words[5:])
    if not (place.rank < place.workers <= MAX_WORKERS and place.local_rank < place.local_size <= place.workers):
        raise ValueError(f"a place outside the job: {line[:80]!r}")
    return place


def place_path(directory: str, pid: int) -> str:
    return os.path.join(directory, f"place-{pid}")


def write_place(directory: str, pid: int, place: Place) -> None:
    """Write `place` for process `pid` (whole before it is renamed into view: the reader may look at any time)."""
    path = place_path(directory, pid)
    with open(f"{path}.tmp", "w", encoding="ascii") as stream:
        stream.write(place.line() + "\n")
    os.replace(f"{path}.tmp", path)


def take_place(directory: str, pid: int) -> Place | None:
    """The place written for `pid`, removed as it is read; None when there is none (the place is unchanged)."""
    path = place_path(directory, pid)
    try:
        with open(path, encoding="ascii") as stream:
            text = stream.read(1000)
    except FileNotFoundError:
        return None
    os.unlink(path)
    return parse_place(text)
