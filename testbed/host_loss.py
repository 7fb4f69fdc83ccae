"""A job launched in the ssh testbed loses a whole host mid-training: the harness tests and benchmarks share.

`lose_host_in_job` runs `sluice launch ARGS` in the `launcher` host, reads its output on a thread all
along (a launcher whose stdout nobody reads stalls), waits until a line says the job trains, takes
the host away (SshBed.lose_host: every process in it killed, its link down), waits for the job (or
for a condition, when the launcher's own host is the one lost) and brings the host back for the next
job. `wait_gone` waits until no process of the job is left on the hosts named; `host_bed` builds the
bed for a benchmark, or says why it cannot.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from tempfile import TemporaryDirectory

from testbed.ssh import ROOT, SshBed, ssh_bed
from testbed.ssh import unavailable as ssh_unavailable


@dataclass(frozen=True)
class HostLoss:
    #: the launcher's output (stdout and stderr), whole
    out: str
    #: the launcher's exit status; None when it still ran when `ended()` held
    returncode: int | None
    #: time.time() when the host was taken away
    lost_at: float


def lose_host_in_job(bed: SshBed, args: Sequence[str], host: str, trains: str, *, start_s: float = 60.0,
                     settle_s: float = 0.0, before: Callable[[str], None] | None = None,
                     ended: Callable[[], bool] | None = None, end_s: float = 60.0, silent: bool = False,
                     then: Sequence[tuple[str, str, Callable[[], None] | None]] = ()) -> HostLoss:
    """`sluice launch ARGS` (with the bed's ssh options) in the launcher host; once a line matches the regular
    expression `trains` (within `start_s`), `before(output so far)` is called, `settle_s` waited, and `host` lost.
    For each (pattern, host, before) of `then`, once a later line matches the pattern, `before()` is called (if
    given), `settle_s` waited, and that host lost too. Then
    until the launcher exits (or, given `ended`, until `ended()` holds: the launcher may be on the lost host),
    within `end_s`; the hosts come back in any case. `silent`: see SshBed.lose_host. A job
    that does not train or does not end raises AssertionError with its output."""
    argv = [sys.executable, "-m", "sluice.launch.cli", "launch", *bed.ssh_options(), *args]
    job = bed.netbed.run("launcher", argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    training = threading.Event()
    pattern = re.compile(trains)

    def read() -> None:
        assert job.stdout is not None
        for line in iter(job.stdout.readline, ""):
            lines.append(line)
            if pattern.search(line):
                training.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    lost: list[str] = []
    try:
        if not training.wait(start_s) or job.poll() is not None:
            raise AssertionError(f"the job did not train within {start_s:g} s:\n" + "".join(lines)[-3000:])
        if before is not None:
            before("".join(lines))
        time.sleep(settle_s)
        lost_at, seen = time.time(), len(lines)  # what follows may be read while the host is being taken away
        lost.append(host)
        bed.lose_host(host, silent)
        deadline = time.monotonic() + end_s
        for after, next_host, prepare in then:
            pattern_after = re.compile(after)
            while not any(pattern_after.search(line) for line in lines[seen:]):
                if time.monotonic() > deadline or job.poll() is not None:
                    raise AssertionError(f"no line matched {after!r} before {next_host} was to be lost:\n"
                                         + "".join(lines)[-6000:])
                time.sleep(0.05)
            if prepare is not None:
                prepare()
            time.sleep(settle_s)
            seen = len(lines)
            lost.append(next_host)
            bed.lose_host(next_host, silent)
        while not (ended() if ended is not None else job.poll() is not None):
            if time.monotonic() > deadline:
                raise AssertionError(f"the job did not end within {end_s:g} s of the loss:\n" + "".join(lines)[-6000:])
            time.sleep(0.1)
        if job.poll() is not None:
            reader.join(10)
    finally:
        for each in lost:
            bed.restore_link(each)
        if job.poll() is None:
            job.kill()
    return HostLoss("".join(lines), job.returncode, lost_at)


def wait_gone(bed: SshBed, hosts: Sequence[str], pattern: re.Pattern[str], within_s: float = 15.0) -> None:
    """Until no process matching `pattern` runs on `hosts`; AssertionError naming them after `within_s`."""
    deadline = time.monotonic() + within_s
    while left := [p for host in hosts for p in bed.left_on(host, pattern)]:
        if time.monotonic() > deadline:
            raise AssertionError(f"processes of the job still run {within_s:g} s after it ended: {left}")
        time.sleep(0.2)


@contextlib.contextmanager
def host_bed(label: str) -> Iterator[SshBed | None]:
    """The ssh testbed (the launcher, h1 and h2), or None with the reason printed, as `label`'s, when it cannot
    be built."""
    if reason := ssh_unavailable():
        print(f"{label}: skipped, the ssh testbed is unavailable here: {reason}", file=sys.stderr)
        yield None
        return
    with TemporaryDirectory(prefix=f"{label}-ssh-") as keys, ssh_bed(Path(keys), ssh_hosts=2) as bed:
        yield bed
