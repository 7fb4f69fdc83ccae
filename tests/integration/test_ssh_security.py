"""Security across hosts, over real OpenSSH (testbed/ssh.py): strangers, sniffers and the files a job leaves.

A job runs on h1 and h2, launched over ssh from the `launcher` host. Checked: a stranger on another
testbed host (no job secret) that registers as worker 0, pushes to the servers or only listens, with
random CURVE keys or with none, hears nothing, is counted as refused by the scheduler and the servers,
and the job trains on to the end; a capture of h2's link carries no tensor name with CURVE on and does
with it off (the control that shows the check can fail), and no 64-digit hex string (the header that
holds the secret travels inside ssh); every file the job makes in /tmp and /dev/shm is private.
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


def _job_args(bed: SshBed, steps: int, *extra: str) -> list[str]:
    hosts = ",".join(f"{address}:2" for address in bed.hosts.values())
    return ["-H", hosts, "-s", "2", *extra, "--", sys.executable, SCRIPT, "--steps", str(steps)]


# ---------------------------------------------------------------------------- the stranger
def _run_probe(bed: SshBed, scheduler: str, servers: list[str]) -> dict[str, Any]:
    code = ("import json, sys; from tests.integration.stranger_helpers import probe; "
            "print('PROBE', json.dumps(probe(sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3]))))")
    done = bed.run("stranger", [sys.executable, "-c", code, scheduler, json.dumps(servers), str(PROBE_SECONDS)],
                   timeout=60)
    found = re.search(r"^PROBE (.*)$", done.stdout, re.M)
    assert done.returncode == 0 and found, f"the stranger's probe failed:\n{done.stdout[-3000:]}"
    return dict(json.loads(found.group(1)))


@pytest.mark.timeout(300)
def test_ssh_stranger_on_another_host_hears_nothing_and_the_job_trains_on(bed: SshBed) -> None:
    # long enough that the probe ends well before the job does, which then ends by itself: a job
    # stopped by a signal does not print its roles' "stopped (... connections refused)" lines
    job = Job(bed, _job_args(bed, 2500, "--set", "worker.metrics_every=100"))
    try:
        ready = job.wait_line(r"^\[launch\] scheduler ready at (tcp://\S+);", 60)
        servers = [job.wait_line(rf"^\[server {rank}\] .*server {rank} serving on (.*)$", 60).group(1).split()
                   for rank in (0, 1)]
        job.wait_line(r"^\[worker 0\] .*transport, steps \d+-\d+:", 60)  # training
        probed = _run_probe(bed, ready.group(1), [e for endpoints in servers for e in endpoints])
        assert job.proc.poll() is None, f"the job ended during the probe:\n{job.text[-4000:]}"
        # worker 0 still reports new steps after the stranger is done
        job.wait_line(r"^\[worker 0\] .*transport, steps \d+-\d+:", 60, after=len(job.lines))
        code = job.finish(240)
    finally:
        job.close()
    out = job.text
    assert code == 0, out[-5000:]
    assert probed["heard"] == 0, probed
    endpoints = sum(len(e) for e in servers)
    assert probed["sockets"] == 2 * (1 + endpoints + 1 + endpoints), probed  # register, push, listen; x2
    assert all(n <= GREETING_BYTES for n in probed["raw_bytes"]), probed
    results = [json.loads(m) for m in re.findall(r"^\[worker \d\] CLUSTER_RESULT (.*)$", out, re.M)]
    assert sorted(r["rank"] for r in results) == [0, 1, 2, 3]
    assert all(r["params"] == results[0]["params"] for r in results), "the workers ended with different parameters"
    # 4 ZeroMQ strangers at the scheduler, 4 at each server endpoint (3 each): a DEALER whose handshake
    # fails tries again, so each is counted at least once
    scheduler = re.search(r"scheduler stopped \(\d+ messages rejected, (\d+) connections refused\)", out)
    assert scheduler and int(scheduler.group(1)) >= 4, out[-3000:]
    for rank in (0, 1):
        server = re.search(rf"server {rank} stopped \(\d+ messages rejected, (\d+) connections refused\)", out)
        assert server and int(server.group(1)) >= 4 * len(servers[rank]), out[-3000:]


# ---------------------------------------------------------------------------- the sniffer
def _capture(bed: SshBed, pcap: Path, curve: bool) -> bytes:
    """Everything on h2's link while a short job (CURVE on or off) starts, trains and ends."""
    said = pcap.with_suffix(".err")
    with open(said, "wb") as err:  # -Z root: it would write as user tcpdump, who cannot enter tmp_path
        tcpdump = bed.netbed.run("h2", ["tcpdump", "-i", "eth0", "-U", "-Z", "root", "-w", str(pcap)],
                                 stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 20
        while b"listening on" not in said.read_bytes():
            assert tcpdump.poll() is None and time.monotonic() < deadline, f"tcpdump: {said.read_text()}"
            time.sleep(0.05)
        job = Job(bed, _job_args(bed, 200, "--set", f"transport.curve={str(curve).lower()}"))
        try:
            code = job.finish(150)
        finally:
            job.close()
        assert code == 0, job.text[-4000:]
    finally:
        tcpdump.send_signal(signal.SIGINT)
        try:
            tcpdump.wait(20)
        except subprocess.TimeoutExpired:
            tcpdump.kill()
            tcpdump.wait(10)
    data = pcap.read_bytes()
    pcap.unlink()  # tens of MB
    return data


@pytest.mark.timeout(300)
def test_ssh_capture_of_a_hosts_link_shows_no_tensor_name_with_curve(bed: SshBed, tmp_path: Path) -> None:
    if shutil.which("tcpdump") is None:
        pytest.skip("tcpdump is not installed: `apt-get install tcpdump` as root")
    sealed = _capture(bed, tmp_path / "curve-on.pcap", curve=True)
    plain = _capture(bed, tmp_path / "curve-off.pcap", curve=False)
    for data in (sealed, plain):
        assert len(data) > 1 << 20, "the capture holds too little of the job's traffic to mean anything"
        assert b"SSH-2.0-" in data, "the capture missed the ssh sessions that carry the roles' headers"
        assert not HEX_SECRET.search(data), "a 64-digit hex string (a job secret?) crossed the link in clear"
    assert [name for name in TENSOR_NAMES if name in sealed] == [], "a tensor name crossed the link in clear"
    assert [name for name in TENSOR_NAMES if name in plain] != [], "with CURVE off the names should be readable"


# ---------------------------------------------------------------------------- files
def _job_pids(bed: SshBed) -> set[int]:
    """Processes of the job in the launcher's and the ssh hosts' namespaces (sshd itself left out)."""
    pids: set[int] = set()
    for host in ("launcher", *bed.hosts):
        listed = subprocess.run(["ip", "netns", "pids", bed.netbed.hosts[host].netns], capture_output=True,
                                text=True, timeout=10).stdout.split()
        for pid in listed:
            with contextlib.suppress(OSError):
                if b"sshd" not in Path(f"/proc/{pid}/cmdline").read_bytes():
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


@pytest.mark.timeout(200)
def test_ssh_job_files_in_tmp_and_dev_shm_are_not_world_readable(bed: SshBed) -> None:
    registry = registry_dir()
    job = Job(bed, _job_args(bed, 1500, "--set", "worker.metrics_every=100"))
    modes: dict[Path, int] = {}
    try:
        endpoint = job.wait_line(r"^\[launch\] scheduler ready at (tcp://\S+);", 60).group(1)
        job.wait_line(r"^\[worker 0\] .*transport, steps \d+-\d+:", 90)
        deadline = time.monotonic() + 150
        while job.proc.poll() is None and time.monotonic() < deadline:
            for path in _files_of(_job_pids(bed), registry, job.started):
                with contextlib.suppress(OSError):
                    modes[path] = path.lstat().st_mode
            time.sleep(0.3)
        code = job.finish(30)
    finally:
        job.close()
    assert code == 0, job.text[-4000:]
    listing = "\n".join(f"  {stat.filemode(mode)} {path}" for path, mode in sorted(modes.items()))
    assert any(str(p).startswith("/dev/shm/sluice-") for p in modes), f"no segment of the job seen:\n{listing}"
    entry = "".join(c if c.isalnum() else "_" for c in endpoint)  # as jobs_registry names the job's entry
    assert any(p.parent == registry and entry in p.name for p in modes), f"no registry entry seen:\n{listing}"
    readable = [p for p, mode in modes.items() if mode & stat.S_IROTH and not stat.S_ISLNK(mode)]
    assert readable == [], f"world-readable files of the job:\n{listing}"
