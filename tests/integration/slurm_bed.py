"""A one-node SLURM cluster (munged, slurmctld, slurmd from Debian's packages) started and torn down by pytest."""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

DAEMONS = {"munged": "munge", "slurmctld": "slurmctld", "slurmd": "slurmd"}
CLIENTS = {"srun": "slurm-client", "salloc": "slurm-client", "sbatch": "slurm-client", "sinfo": "slurm-client",
           "squeue": "slurm-client", "scancel": "slurm-client"}
CLIENT_ENV_PREFIXES = ("SLURM_", "SLURMD_", "SALLOC_", "SBATCH_", "SRUN_", "SQUEUE_", "SINFO_", "SCANCEL_")
INSTALL_HINT = "apt-get install slurm-wlm munge, or run `make test-system-deps` as root"
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/bin", "/sbin", "/bin"])
# Tasks are not bound to CPUs (task/none), so the node may claim more CPUs than the machine has: tests can
# then ask for several tasks (salloc -n3) on a 2-CPU runner. config_overrides makes slurmd accept the claim.
MIN_CPUS = 8
UP_DEADLINE_S = 30.0
STOP_DEADLINE_S = 10.0
PORT_ATTEMPTS = 3

SLURM_CONF = """\
ClusterName=sluicetest
SlurmctldHost={node}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge.socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
MailProg=/bin/true
# seconds between SIGTERM and SIGKILL when a job is cancelled: short, so that teardown is quick
KillWait=2
NodeName={node} NodeAddr=127.0.0.1 NodeHostname={node} CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def _free_port() -> int:
    """A port free now below the kernel's ephemeral range: an OS-chosen one may meanwhile become the local
    port of some test's outgoing connection, and the daemon then fails with "Address already in use"."""
    low = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket() as probe:
            try:
                probe.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below {low}")


def _ephemeral_low() -> int:
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    return 32768


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"--- {path.name}: missing"
    # slurmd and slurmctld try to load every MPI plugin; the PMIx ones fail here and drown the real errors
    kept = [line for line in text if "pmix" not in line.lower()]
    return f"--- {path.name}:\n" + "\n".join(kept[-lines:])


@dataclass
class SlurmBed:
    """A running cluster: clients run with `env` reach it; `root` holds its config, state and logs."""

    root: Path
    node: str
    cpus: int
    env: dict[str, str]
    daemons: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    def logs(self) -> str:
        """The tails of the daemons' logs: SlurmdLogFile also has slurmstepd's; stderr alone has early errors."""
        tails = []
        for name in DAEMONS:
            log = self.root / f"{name}.log"
            tails.append(_tail(log if log.exists() and log.stat().st_size else self.root / f"{name}.out"))
        return "\n".join(tails)

    def run(self, argv: Sequence[str], timeout: float, input: str | None = None,
            check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a client command against the cluster; with check, a non-zero exit fails with the daemons' logs."""
        done = subprocess.run(list(argv), env=self.env, input=input, capture_output=True, text=True,
                              timeout=timeout, stdin=None if input is not None else subprocess.DEVNULL)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {done.returncode}\nstdout: {done.stdout[-2000:]}\n"
                                 f"stderr: {done.stderr[-2000:]}\n{self.logs()}")
        return done

    def start(self, name: str, argv: list[str]) -> None:
        log = (self.root / f"{name}.out").open("wb")
        # own session: a Ctrl-C at the terminal reaches pytest, which then tears the bed down in order
        self.daemons[name] = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                              env=self.env, cwd=self.root, start_new_session=True)
        log.close()

    def wait_for(self, what: str, ready: Callable[[], bool], deadline_s: float) -> None:
        """Poll ready() until true; a daemon that exits or a deadline that passes fails the test with the logs."""
        if not self.up(ready, deadline_s):
            why = ", ".join(self._dead()) or f"not within {deadline_s:.0f} s"
            pytest.fail(f"SLURM test bed: {what}: {why}\n{self.logs()}", pytrace=False)

    def up(self, ready: Callable[[], bool], deadline_s: float) -> bool:
        """Poll ready() until true (True), or until a daemon exits or the deadline passes (False)."""
        deadline = time.monotonic() + deadline_s
        while not ready():
            if self._dead() or time.monotonic() > deadline:
                return False
            time.sleep(0.2)
        return True

    def _dead(self) -> list[str]:
        return [f"{name} exited {code}" for name, proc in self.daemons.items() if (code := proc.poll()) is not None]

    def idle(self) -> bool:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.run(["sinfo", "-h", "-o", "%T"], timeout=5, check=False).stdout.strip() == "idle"
        return False

    def stop(self) -> None:
        """Cancel every job, stop the daemons (SIGTERM, then SIGKILL), then kill anything left that they started."""
        if "slurmctld" in self.daemons and self.daemons["slurmctld"].poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.run(["scancel", "--user=root"], timeout=10, check=False)
                deadline = time.monotonic() + STOP_DEADLINE_S
                while self.run(["squeue", "-h"], timeout=5, check=False).stdout.strip():
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.2)
        self.stop_daemons(("slurmd", "slurmctld", "munged"))
        # slurmstepd, slurmscriptd and the tasks are not our children; all of them carry this bed's SLURM_CONF
        marker = f"SLURM_CONF={self.conf}".encode() + b"\0"
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != os.getpid():
                with contextlib.suppress(OSError):
                    if marker in (entry / "environ").read_bytes():
                        os.kill(int(entry.name), signal.SIGKILL)

    def stop_daemons(self, names: Sequence[str]) -> None:
        """SIGTERM each of these daemons still running, then SIGKILL it after STOP_DEADLINE_S."""
        for name in names:
            proc = self.daemons.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(STOP_DEADLINE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(STOP_DEADLINE_S)


def _node_name(slurmd: str) -> str:
    out = subprocess.run([slurmd, "-C"], capture_output=True, text=True, timeout=30).stdout
    found = re.search(r"NodeName=(\S+)", out)
    return found.group(1) if found else socket.gethostname().split(".")[0]


@pytest.fixture(scope="session")
def slurm() -> Iterator[SlurmBed]:
    """A one-node SLURM cluster for the whole session; skipped without root or without the packages."""
    if os.geteuid() != 0:
        pytest.skip("the SLURM test bed starts munged, slurmctld and slurmd, which needs root")
    found = {name: shutil.which(name, path=SEARCH_PATH) for name in [*DAEMONS, *CLIENTS]}
    missing = sorted({f"{name} ({(DAEMONS | CLIENTS)[name]})" for name, path in found.items() if path is None})
    if missing:
        pytest.skip(f"the SLURM test bed needs {', '.join(missing)}: {INSTALL_HINT}")
    exe = {name: str(path) for name, path in found.items()}
    # munged refuses a socket below a folder that not everyone may enter, which a private TMPDIR may be
    root = Path(tempfile.mkdtemp(prefix="sluice-slurm-", dir="/tmp" if os.path.isdir("/tmp") else None))
    root.chmod(0o755)
    for sub in ("state", "spool"):
        (root / sub).mkdir()
    node, cpus = _node_name(exe["slurmd"]), max(os.cpu_count() or 1, MIN_CPUS)
    bin_dirs = os.pathsep.join(dict.fromkeys(str(Path(exe[n]).parent) for n in CLIENTS))
    # a pytest run inside a real SLURM job inherits its SLURM_JOB_ID and the like: srun would look for that job here
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(CLIENT_ENV_PREFIXES)}
    env = {**inherited, "SLURM_CONF": str(root / "slurm.conf"), "PATH": f"{bin_dirs}{os.pathsep}{SEARCH_PATH}"}
    bed = SlurmBed(root=root, node=node, cpus=cpus, env=env)
    try:
        key = os.open(root / "munge.key", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        os.write(key, os.urandom(128))
        os.close(key)
        bed.start("munged", [exe["munged"], "-F", f"--socket={root}/munge.socket", f"--key-file={root}/munge.key",
                             f"--pid-file={root}/munged.pid", f"--seed-file={root}/munged.seed"])
        bed.wait_for("munged's socket", (root / "munge.socket").exists, 10.0)
        for attempt in range(PORT_ATTEMPTS):
            bed.conf.write_text(SLURM_CONF.format(node=node, cpus=cpus, root=root, ctld_port=_free_port(),
                                                  slurmd_port=_free_port()))
            bed.start("slurmctld", [exe["slurmctld"], "-D", "-f", str(bed.conf)])
            bed.start("slurmd", [exe["slurmd"], "-D", "-f", str(bed.conf)])
            # a port taken between its choice and the daemon's bind: stop both and choose others
            if attempt + 1 < PORT_ATTEMPTS and not bed.up(bed.idle, UP_DEADLINE_S) and "already in use" in bed.logs():
                bed.stop_daemons(("slurmd", "slurmctld"))
                for name in ("slurmctld", "slurmd"):
                    for log in (root / f"{name}.log", root / f"{name}.out"):
                        log.unlink(missing_ok=True)
                continue
            break
        bed.wait_for(f"node {node} idle in sinfo", bed.idle, UP_DEADLINE_S)
        yield bed
    finally:
        try:
            bed.stop()
        finally:
            shutil.rmtree(root, ignore_errors=True)
