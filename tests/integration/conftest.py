"""Fixtures shared by the integration tests: launched jobs that are always stopped, no segment left behind."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq

from sluice.transport.shm_peers import SEGMENT_NAME, SHM_DIR
from testbed.launch import Launch
from tests.integration.node_procs import Node
from tests.integration.slurm_bed import slurm  # noqa: F401 - the one-node SLURM bed, one per session

#: how long the processes that clean up after a dead one (its launcher, the remote stub, a janitor) get
SEGMENT_DEADLINE_S = 10.0


def _segments() -> dict[str, int]:
    """/dev/shm/sluice-PID-* segment names and the pid that made each."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return {}
    return {name: int(match.group(1)) for name in names if (match := SEGMENT_NAME.fullmatch(name))}


def _dead(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process, alive
        pass
    return False


@pytest.fixture(autouse=True)
def no_segment_of_a_dead_process_left() -> Iterator[None]:
    """Fail a test after which a process it started is gone but its 64 MiB segments are not. Only
    segments made during the test by processes no longer running count: other tests' live processes
    (or a suite running beside this one) may own segments now, and a live process still unlinks its own."""
    before = set(_segments())
    yield
    deadline = time.monotonic() + SEGMENT_DEADLINE_S
    while left := sorted(name for name, pid in _segments().items() if name not in before and _dead(pid)):
        if time.monotonic() > deadline:
            for name in left:  # 64 MiB each: not left to fill /dev/shm for the tests that follow
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(SHM_DIR, name))
            pytest.fail(f"shared-memory segments of dead processes left behind in {SHM_DIR}: {left}; whoever "
                        "stops those processes must remove them (transport.shm.remove_segments_of)", pytrace=False)
        time.sleep(0.2)


@pytest.fixture
def launch() -> Iterator[type[Launch]]:
    started: list[Launch] = []

    class Tracked(Launch):
        def __init__(self, args: list[str], **kwargs: Any) -> None:
            super().__init__(args, **kwargs)
            started.append(self)

    try:
        yield Tracked
    finally:
        for job in started:
            job.close()


@pytest.fixture
def nodes() -> Iterator[list[Node]]:
    """The `sluice node` processes a test starts (node_procs.py), each killed with its group at the end."""
    started: list[Node] = []
    try:
        yield started
    finally:
        for index, node in enumerate(started):
            node.kill()
            # shown by pytest only when the test failed: every node's side of the story, not only the one asserted on
            print(f"--- node {index} (pid {node.proc.pid}, exit {node.proc.returncode}) ---\n{node.output()[-6000:]}")


@pytest.fixture
def raw_sockets() -> Iterator[Callable[[int], zmq.Socket[bytes]]]:
    """Raw ZeroMQ sockets for misbehaving peers; all closed at the end."""
    ctx = zmq.Context()
    made: list[zmq.Socket[bytes]] = []

    def make(kind: int) -> zmq.Socket[bytes]:
        sock = ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        made.append(sock)
        return sock

    yield make
    for sock in made:
        sock.close(linger=0)
    ctx.term()
