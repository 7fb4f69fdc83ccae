"""Hosts that run OpenSSH servers: testbed namespaces, each with an sshd and a key made for the bed.

The launcher runs in the testbed host `launcher`; `h1`, `h2`, ... each run `sshd` on port 22 of
their address, admitting one key generated for the bed, and the launcher's ssh checks their host
keys against a known_hosts file the bed writes (StrictHostKeyChecking=yes: nothing is trusted on
first use). The namespaces share this machine's file system, so the hosts have the project and its
virtual environment at the same paths, as a cluster with a shared home directory does.
Needs root, iproute2 and OpenSSH (client and server): `make test-system-deps` installs them;
`NetbedUnavailable` says what is missing. Tests and benchmarks (bench/curve_cost.py) share it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testbed.netbed import PREFIX, Netbed, NetbedUnavailable, check_available

ROOT = Path(__file__).resolve().parents[1]
SSHD = "/usr/sbin/sshd"
_NOT_HERE = "install them with `apt-get install openssh-server openssh-client` or `make test-system-deps` as root"


def unavailable() -> str:
    """Why this machine cannot run an ssh bed ('' when it can)."""
    try:
        check_available()
    except NetbedUnavailable as exc:
        return str(exc)
    missing = [tool for tool in (SSHD, "ssh", "ssh-keygen") if shutil.which(tool) is None]
    return f"{', '.join(missing)} not found: {_NOT_HERE}" if missing else ""


@dataclass
class SshBed:
    netbed: Netbed
    keys: Path
    #: each ssh host's address, by name
    hosts: dict[str, str] = field(default_factory=dict)
    #: a directory the last ssh host sees as an empty one of its own (ssh_bed's `private`)
    private: Path | None = None
    _daemons: list[subprocess.Popen[Any]] = field(default_factory=list)

    @property
    def identity(self) -> Path:
        return self.keys / "user_key"

    @property
    def known_hosts(self) -> Path:
        return self.keys / "known_hosts"

    def ssh_options(self) -> list[str]:
        """`sluice launch` options that make its ssh use the bed's key and host keys, strictly."""
        return ["--ssh-identity", str(self.identity), "--ssh-option", f"UserKnownHostsFile={self.known_hosts}",
                "--ssh-option", "StrictHostKeyChecking=yes", "--ssh-option", "IdentitiesOnly=yes"]

    def start_sshd(self, name: str, private: Path | None = None) -> None:
        """sshd in host `name`; with `private`, that directory is an empty tmpfs for it and what it starts
        (`ip netns exec` gives each command a mount namespace of its own), so what they write there stays
        on this host, as on a machine without a shared file system."""
        address = self.netbed.hosts[name].address
        argv = [SSHD, "-D", "-e", "-f", "/dev/null", "-h", str(self.keys / "host_key"),
                "-o", f"ListenAddress={address}", "-o", "Port=22",
                "-o", f"AuthorizedKeysFile={self.keys / 'authorized_keys'}", "-o", "PidFile=none",
                "-o", "StrictModes=no", "-o", "UsePAM=no", "-o", "PasswordAuthentication=no",
                "-o", "KbdInteractiveAuthentication=no", "-o", "PermitRootLogin=prohibit-password",
                "-o", "MaxStartups=100:30:200", "-o", "MaxSessions=100"]
        if private is not None:
            argv = ["sh", "-c", 'mount -t tmpfs sluice-private "$0" && exec "$@"', str(private), *argv]
        with open(self.keys / f"sshd-{name}.log", "wb") as log:  # the daemon keeps its own descriptor
            self._daemons.append(self.netbed.run(name, argv, stdout=log, stderr=subprocess.STDOUT))
        self.hosts[name] = address

    def run(self, host: str, argv: Sequence[str], timeout: float, **popen: Any) -> subprocess.CompletedProcess[str]:
        """`argv` in `host`'s namespace from the repository root; killed (its whole group) at `timeout`."""
        process = self.netbed.run(host, list(argv), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, **popen)
        try:
            out, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, 9)
            out, _ = process.communicate()
            raise TimeoutError(f"{' '.join(argv[:6])} ... did not finish within {timeout:g} s; output:\n"
                               f"{out[-4000:]}") from None
        return subprocess.CompletedProcess(process.args, process.returncode, out, "")

    def launch(self, args: Sequence[str], timeout: float = 120.0, **popen: Any) -> subprocess.CompletedProcess[str]:
        """`sluice launch ARGS` run in the `launcher` host, with the bed's ssh options."""
        return self.run("launcher", [sys.executable, "-m", "sluice.launch.cli", "launch", *self.ssh_options(),
                                     *args], timeout, **popen)

    def wait_ready(self, timeout: float = 20.0, only: str | None = None) -> None:
        """Until every sshd (or `only` that host's) admits the bed's key (`ssh HOST true` from the launcher host)."""
        for name, address in self.hosts.items():
            if only is not None and name != only:
                continue
            deadline = time.monotonic() + timeout
            while True:
                probe = self.run("launcher", ["ssh", "-i", str(self.identity), "-o", "BatchMode=yes",
                                              "-o", f"UserKnownHostsFile={self.known_hosts}",
                                              "-o", "StrictHostKeyChecking=yes", "-o", "ConnectTimeout=3",
                                              address, "true"], timeout=10)
                if probe.returncode == 0:
                    break
                if time.monotonic() > deadline:
                    log = (self.keys / f"sshd-{name}.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"sshd on {name} ({address}) did not admit the bed's key within {timeout:g} s: "
                                f"{probe.stdout.strip()}\nsshd log:\n{log}")
                time.sleep(0.2)

    def lose_host(self, host: str, silent: bool = False) -> None:
        """Take `host` away as a power loss would: every process in its namespace SIGKILLed (its sshd and
        sessions too), what they kept in /dev/shm gone with them (the bed's hosts share this machine's),
        then its link down. `silent`: the link down first, so that not even the kernel's closing of the
        killed processes' connections gets out (a peer hears nothing, as from a host whose power went);
        else those connections end at once. `restore_link` brings the link back for the next test."""
        import signal

        from sluice.transport.shm import remove_segments_of

        netns = self.netbed.hosts[host].netns
        if silent:
            subprocess.run(["ip", "netns", "exec", netns, "ip", "link", "set", "eth0", "down"], check=True, timeout=10)
        pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True,
                              timeout=10).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        for pid in pids:
            deadline = time.monotonic() + 5
            while _running(int(pid)) and time.monotonic() < deadline:
                time.sleep(0.02)
            remove_segments_of(int(pid))
        if not silent:
            subprocess.run(["ip", "netns", "exec", netns, "ip", "link", "set", "eth0", "down"], check=True, timeout=10)

    def restore_link(self, host: str) -> None:
        """`host` back after lose_host: its link up and, on an ssh host, a new sshd (the old one was killed)."""
        subprocess.run(["ip", "netns", "exec", self.netbed.hosts[host].netns, "ip", "link", "set", "eth0", "up"],
                       timeout=10)
        if host in self.hosts:
            last = max(self.hosts, key=lambda name: int(name[1:]))
            self.start_sshd(host, self.private if host == last else None)
            self.wait_ready(only=host)  # another host may still be lost

    def left_on(self, host: str, pattern: re.Pattern[str]) -> list[str]:
        """Processes in `host` whose command line matches `pattern` (all namespaces share the pid space:
        ask `ip netns pids`), as "PID: CMDLINE"."""
        pids = subprocess.run(["ip", "netns", "pids", self.netbed.hosts[host].netns], capture_output=True, text=True,
                              timeout=10).stdout.split()
        left = []
        for pid in pids:
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if pattern.search(cmdline):
                left.append(f"{pid}: {cmdline[:120]}")
        return left

    def close(self) -> None:
        for daemon in self._daemons:
            with contextlib.suppress(ProcessLookupError):
                daemon.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                daemon.wait(5)


def _keygen(path: Path) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True, timeout=30)
    return (path.with_suffix(".pub") if path.suffix else Path(f"{path}.pub")).read_text().strip()


@contextlib.contextmanager
def ssh_bed(keys: Path, ssh_hosts: int = 2, extra_hosts: Sequence[str] = (),
            rates: Sequence[float | None] = (), tos_bands: bool = False, second: bool = False,
            private: Path | None = None) -> Iterator[SshBed]:
    """A testbed with a `launcher` host and `ssh_hosts` hosts h1, h2, ... running sshd (host hI's link
    shaped to rates[I-1] Mbit/s where given, with the kernel's ToS bands under the shaper if
    `tos_bands`); `extra_hosts` are more namespaces without sshd. `second`: another bed of this
    process is up (its namespaces get other names). `private`: a directory the last ssh host sees as
    its own empty one (SshBed.start_sshd)."""
    if reason := unavailable():
        raise NetbedUnavailable(reason)
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
    keys.mkdir(parents=True, exist_ok=True)
    host_public = _keygen(keys / "host_key")
    (keys / "authorized_keys").write_text(_keygen(keys / "user_key") + "\n")
    with (Netbed(tag=f"{PREFIX}{os.getpid()}-2") if second else Netbed()) as netbed:
        bed = SshBed(netbed, keys, private=private)
        try:
            netbed.host("launcher")
            for index in range(1, ssh_hosts + 1):
                rate = rates[index - 1] if index <= len(rates) else None
                netbed.host(f"h{index}", rate, tos_bands=tos_bands and rate is not None)
                bed.start_sshd(f"h{index}", private if index == ssh_hosts else None)
            for name in extra_hosts:
                netbed.host(name)
            bed.known_hosts.write_text("".join(f"{address} {host_public}\n" for address in bed.hosts.values()))
            bed.wait_ready()
            yield bed
        finally:
            bed.close()


def _running(pid: int) -> bool:
    """Whether process `pid` still runs: a zombie has exited (one the bed started, its sshd, waits for the bed's
    wait, and must not hold up a host's loss)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
