"""Security across hosts, over real OpenSSH (testbed/ssh.py): strangers, sniffers and the files a job leaves.

A job runs on h1 and h2, launched over ssh from the `launcher` host. Checked: a stranger on another
testbed host (no job secret) that registers as worker 0, pushes to the servers or only listens, with
random CURVE keys, with none or with a ticket of a guessed secret, hears nothing, is counted as refused
by the scheduler and the servers, and the job trains on to the end; a capture of h2's link carries no
tensor name with security on (data connections sealed, CURVE to the scheduler) and does with it off
(the control that shows the check can fail), and no 64-digit hex string (the header that holds the
secret travels inside ssh); every file the job makes in /tmp and /dev/shm is private.
One job with security on serves all three (`curve_job`): the stranger probes it while h2's link is
captured and its files are watched; a second, smaller job with it off is the capture's control.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sluice.scheduler.jobs_registry import registry_dir
from testbed.netbed import NetbedUnavailable
from testbed.ssh import ROOT, SshBed, ssh_bed

SCRIPT = "tests/integration/scripts/cluster_train.py"
#: the tensors cluster_train.py declares: plaintext that travels in every job (broadcasts, tables)
TENSOR_NAMES = (b"0.weight", b"0.bias", b"2.weight", b"2.bias")
HEX_SECRET = re.compile(rb"[0-9a-f]{64}")
PROBE_SECONDS = 2.0
GREETING_BYTES = 64  # all a stranger may read from a raw TCP connection: at most ZeroMQ's greeting
#: the shared job's most steps, and how often worker 0 reports them. The job trains until the test,
#: once worker 0 reported steps after the probe, creates its --until-file (a fixed count raced the
#: probe on fast machines); it then ends by itself (a job stopped by a signal does not print its
#: roles' "stopped (... connections refused)" lines). Its workers negotiate every 2.5 ms at most
#: (collective.cycle_ms; a step takes about 5 rounds), so SHARED_STEPS is minutes on any machine.
SHARED_STEPS, METRICS_EVERY, CYCLE_MS = 50_000, 50, 2.5
TRAINING = r"^\[worker 0\] .*transport, steps \d+-\d+:"


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshBed]:
    try:
        with ssh_bed(tmp_path_factory.mktemp("ssh"), ssh_hosts=2, extra_hosts=("stranger",)) as made:
            yield made
    except NetbedUnavailable as exc:
        pytest.skip(str(exc))


class Job:
    """`sluice launch ARGS` in the launcher host; a thread collects its output so every wait has a deadline."""

    def __init__(self, bed: SshBed, args: list[str]) -> None:
        self.started = time.time()
        self.proc = bed.netbed.run("launcher", [sys.executable, "-m", "sluice.launch.cli", "launch",
                                                *bed.ssh_options(), *args],
                                   cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    def wait_line(self, pattern: str, timeout: float, after: int = 0) -> re.Match[str]:
        """The first line from index `after` on that matches; fails at `timeout` or when the output ends."""
        regex, deadline = re.compile(pattern), time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines[after:]:
                    if match := regex.search(line):
                        return match
                after = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0 or not self._reader.is_alive():
                    tail = "\n".join(self.lines[-60:])
                    raise AssertionError(f"no line matching {pattern!r} within {timeout:g} s; last lines:\n{tail}")
                self._cond.wait(min(left, 0.5))

    def finish(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the job still ran after {timeout:g} s:\n{self.text[-4000:]}") from None
        self._reader.join(10)
        return code

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


def _job_args(bed: SshBed, steps: int, *extra: str, slots: int = 2) -> list[str]:
    hosts = ",".join(f"{address}:{slots}" for address in bed.hosts.values())
    return ["-H", hosts, "-s", "2", *extra, "--", sys.executable, SCRIPT, "--steps", str(steps)]


# ---------------------------------------------------------------------------- the stranger
class Stranger:
    """The stranger's probe (stranger_helpers.probe) in its host, started before the job so that its
    imports are done by the time the job trains: it waits for the endpoints on its stdin."""

    CODE = ("import json, sys; from tests.integration.stranger_helpers import probe; "
            "scheduler, servers, seconds = json.loads(sys.stdin.readline()); "
            "print('PROBE', json.dumps(probe(scheduler, servers, seconds)))")

    def __init__(self, bed: SshBed) -> None:
        self.proc = bed.netbed.run("stranger", [sys.executable, "-c", self.CODE], cwd=ROOT, stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def probe(self, scheduler: str, servers: list[str]) -> dict[str, Any]:
        try:
            out, _ = self.proc.communicate(json.dumps([scheduler, servers, PROBE_SECONDS]) + "\n", timeout=60)
        except subprocess.TimeoutExpired:
            self.close()
            raise AssertionError("the stranger's probe did not finish within 60 s") from None
        found = re.search(r"^PROBE (.*)$", out, re.M)
        assert self.proc.returncode == 0 and found, f"the stranger's probe failed:\n{out[-3000:]}"
        return dict(json.loads(found.group(1)))

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


@pytest.mark.timeout(300)
def test_ssh_stranger_on_another_host_hears_nothing_and_the_job_trains_on(curve_job: CurveJob) -> None:
    # the probe ran once worker 0 trained, and the job outlived it (it trains until told, --until-file)
    assert curve_job.probed is not None, curve_job.probe_failed
    probed, servers = curve_job.probed, curve_job.servers
    assert curve_job.alive_after_probe, f"the job ended during the probe:\n{curve_job.text[-4000:]}"
    # worker 0 still reports new steps after the stranger is done
    assert not curve_job.trained_on_failed, curve_job.trained_on_failed
    out = curve_job.text
    assert curve_job.code == 0, out[-5000:]
    assert probed["heard"] == 0, probed
    endpoints = sum(len(e) for e in servers)
    assert probed["sockets"] == 3 * (1 + endpoints + 1 + endpoints), probed  # register, push, listen; x3
    assert all(n <= GREETING_BYTES for n in probed["raw_bytes"]), probed
    results = [json.loads(m) for m in re.findall(r"^\[worker \d\] CLUSTER_RESULT (.*)$", out, re.M)]
    assert sorted(r["rank"] for r in results) == [0, 1, 2, 3]
    assert all(r["params"] == results[0]["params"] for r in results), "the workers ended with different parameters"
    # 6 ZeroMQ strangers at the scheduler, 6 at each server's TCP endpoint (its Unix sockets are not in the
    # stranger's host): a DEALER whose handshake fails tries again, so each is counted at least once
    scheduler = re.search(r"scheduler stopped \(\d+ messages rejected, (\d+) connections refused\)", out)
    assert scheduler and int(scheduler.group(1)) >= 6, out[-3000:]
    for rank in (0, 1):
        server = re.search(rf"server {rank} stopped \(\d+ messages rejected, (\d+) connections refused\)", out)
        network = [e for e in servers[rank] if e.startswith("tcp://")]
        assert server and int(server.group(1)) >= 6 * len(network), out[-3000:]


# ---------------------------------------------------------------------------- the sniffer
@contextlib.contextmanager
def _tcpdump(bed: SshBed, pcap: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Everything on h2's link into `pcap` while the block runs (tcpdump listening before it starts)."""
    said = pcap.with_suffix(".err")
    with open(said, "wb") as err:  # -Z root: it would write as user tcpdump, who cannot enter tmp_path
        tcpdump = bed.netbed.run("h2", ["tcpdump", "-i", "eth0", "-U", "-Z", "root", "-w", str(pcap)],
                                 stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 20
        while b"listening on" not in said.read_bytes():
            assert tcpdump.poll() is None and time.monotonic() < deadline, f"tcpdump: {said.read_text()}"
            time.sleep(0.05)
        yield tcpdump
    finally:
        tcpdump.send_signal(signal.SIGINT)
        try:
            tcpdump.wait(20)
        except subprocess.TimeoutExpired:
            tcpdump.kill()
            tcpdump.wait(10)


def _capture(bed: SshBed, pcap: Path, curve: bool) -> bytes:
    """Everything on h2's link while a short job (CURVE on or off; a worker on each host) starts,
    trains and ends."""
    with _tcpdump(bed, pcap):
        job = Job(bed, _job_args(bed, 20, "--set", f"transport.curve={str(curve).lower()}", slots=1))
        try:
            code = job.finish(150)
        finally:
            job.close()
        assert code == 0, job.text[-4000:]
    return _read_capture(pcap)


def _read_capture(pcap: Path) -> bytes:
    data = pcap.read_bytes()
    pcap.unlink()  # tens of MB
    return data


@pytest.mark.timeout(300)
def test_ssh_capture_of_a_hosts_link_shows_no_tensor_name_with_curve(bed: SshBed, curve_job: CurveJob,
                                                                      tmp_path: Path) -> None:
    if shutil.which("tcpdump") is None:
        pytest.skip("tcpdump is not installed: `apt-get install tcpdump` as root")
    assert curve_job.pcap is not None
    assert curve_job.code == 0, curve_job.text[-4000:]
    sealed = _read_capture(curve_job.pcap)  # the shared job, CURVE on
    plain = _capture(bed, tmp_path / "curve-off.pcap", curve=False)
    for data in (sealed, plain):
        assert len(data) > 1 << 20, "the capture holds too little of the job's traffic to mean anything"
        assert b"SSH-2.0-" in data, "the capture missed the ssh sessions that carry the roles' headers"
        assert not HEX_SECRET.search(data), "a 64-digit hex string (a job secret?) crossed the link in clear"
    assert [name for name in TENSOR_NAMES if name in sealed] == [], "a tensor name crossed the link in clear"
    assert [name for name in TENSOR_NAMES if name in plain] != [], "with CURVE off the names should be readable"


# ---------------------------------------------------------------------------- files
def _job_pids(bed: SshBed, others: set[int]) -> set[int]:
    """Processes of the job in the launcher's and the ssh hosts' namespaces (sshd itself, and `others`
    that are not the job's, left out)."""
    pids: set[int] = set()
    for host in ("launcher", *bed.hosts):
        listed = subprocess.run(["ip", "netns", "pids", bed.netbed.hosts[host].netns], capture_output=True,
                                text=True, timeout=10).stdout.split()
        for pid in listed:
            with contextlib.suppress(OSError):
                if b"sshd" not in Path(f"/proc/{pid}/cmdline").read_bytes() and int(pid) not in others:
                    pids.add(int(pid))
    return pids


def _files_of(pids: set[int], registry: Path, since: float) -> set[Path]:
    """Files under /tmp and /dev/shm the job's processes hold open or mapped, its shared-memory
    segments, and the scheduler registry's entries written since the job started."""
    found: set[Path] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    found.add(Path(os.readlink(fd)))
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                if len(fields := line.split(None, 5)) == 6:
                    found.add(Path(fields[5].removesuffix(" (deleted)")))
        found.update(Path("/dev/shm").glob(f"sluice-{pid}-*"))
    with contextlib.suppress(OSError):
        found.update(p for p in registry.iterdir() if p.lstat().st_ctime >= since)
        found.add(registry)
    # the project and its interpreter may themselves live under /tmp (a CI checkout): what they map is
    # installed code, not something the job made
    installed = (str(ROOT) + "/", sys.prefix + "/", sys.base_prefix + "/")
    return {p for p in found if str(p).startswith(("/tmp/", "/dev/shm/")) and not str(p).startswith(installed)}


class FileWatch:
    """The mode of every file of the job (_files_of) seen every 0.3 s, on a thread, until the job ends
    (at most `within` seconds)."""

    def __init__(self, bed: SshBed, job: Job, others: set[int], within: float = 150.0) -> None:
        self.modes: dict[Path, int] = {}
        self._args = bed, job, others, within
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self) -> None:
        self._thread.join(30)

    def _watch(self) -> None:
        bed, job, others, within = self._args
        registry, deadline = registry_dir(), time.monotonic() + within
        while job.proc.poll() is None and time.monotonic() < deadline:
            for path in _files_of(_job_pids(bed, others), registry, job.started):
                with contextlib.suppress(OSError):
                    self.modes[path] = path.lstat().st_mode
            time.sleep(0.3)


@pytest.mark.timeout(200)
def test_ssh_job_files_in_tmp_and_dev_shm_are_not_world_readable(curve_job: CurveJob) -> None:
    registry = registry_dir()
    endpoint, modes = curve_job.endpoint, curve_job.modes  # seen from its first steps to its end
    assert curve_job.code == 0, curve_job.text[-4000:]
    listing = "\n".join(f"  {stat.filemode(mode)} {path}" for path, mode in sorted(modes.items()))
    assert any(str(p).startswith("/dev/shm/sluice-") for p in modes), f"no segment of the job seen:\n{listing}"
    entry = "".join(c if c.isalnum() else "_" for c in endpoint)  # as jobs_registry names the job's entry
    assert any(p.parent == registry and entry in p.name for p in modes), f"no registry entry seen:\n{listing}"
    readable = [p for p, mode in modes.items() if mode & stat.S_IROTH and not stat.S_ISLNK(mode)]
    assert readable == [], f"world-readable files of the job:\n{listing}"


# ---------------------------------------------------------------------------- the job they share
@dataclass
class CurveJob:
    """What the shared job (CURVE on, 2 workers and a server on each of h1 and h2) showed."""

    code: int
    text: str
    #: the scheduler's endpoint, and each server's
    endpoint: str
    servers: list[list[str]]
    #: what the stranger heard (None: the probe failed, saying why in probe_failed)
    probed: dict[str, Any] | None
    probe_failed: str
    alive_after_probe: bool
    #: why worker 0 reported no new steps after the probe ('' when it did)
    trained_on_failed: str
    #: the modes of the job's files in /tmp and /dev/shm, from its first steps to its end
    modes: dict[Path, int]
    #: h2's link from before the job started to its end (None: no tcpdump)
    pcap: Path | None


@pytest.fixture(scope="module")
def curve_job(bed: SshBed, tmp_path_factory: pytest.TempPathFactory) -> CurveJob:
    """One job for the three tests: h2's link captured from before it starts to its end; once worker 0
    trains, its files are watched and the stranger probes it; it then trains on and ends by itself."""
    pcap = tmp_path_factory.mktemp("capture") / "curve-on.pcap" if shutil.which("tcpdump") else None
    with contextlib.ExitStack() as stack:
        tcpdump = stack.enter_context(_tcpdump(bed, pcap)) if pcap is not None else None
        stranger = Stranger(bed)
        stack.callback(stranger.close)
        until = tmp_path_factory.mktemp("until") / "stop"
        job = Job(bed, [*_job_args(bed, SHARED_STEPS, "--set", "transport.curve=true",
                                   "--set", f"worker.metrics_every={METRICS_EVERY}",
                                   "--set", f"collective.cycle_ms={CYCLE_MS}"), "--until-file", str(until)])
        stack.callback(job.close)
        stack.callback(until.touch)  # whatever failed: the job ends by itself
        ready = job.wait_line(r"^\[launch\] scheduler ready at (tcp://\S+);", 60)
        servers = [job.wait_line(rf"^\[server {rank}\] .*server {rank} serving on (.*)$", 60).group(1).split()
                   for rank in (0, 1)]
        job.wait_line(TRAINING, 90)  # training
        watch = FileWatch(bed, job, {tcpdump.pid} if tcpdump else set())  # tcpdump runs in h2: not the job's
        watch.start()
        probed, probe_failed = None, ""
        try:
            probed = stranger.probe(ready.group(1), [e for endpoints in servers for e in endpoints])
        except AssertionError as exc:
            probe_failed = str(exc)
        alive_after_probe = job.proc.poll() is None
        trained_on_failed = ""
        try:
            job.wait_line(TRAINING, 60, after=len(job.lines))
        except AssertionError as exc:
            trained_on_failed = str(exc)
        until.touch()
        code = job.finish(240)
        watch.join()
    return CurveJob(code, job.text, ready.group(1), servers, probed, probe_failed, alive_after_probe,
                    trained_on_failed, watch.modes, pcap)
