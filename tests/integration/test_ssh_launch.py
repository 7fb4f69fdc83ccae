"""`sluice launch -H` over real OpenSSH: hosts are testbed namespaces running sshd (testbed/ssh.py).

The launcher runs in its own testbed host and starts every server and worker on h1 and h2 through
ssh. Checked: the job trains to the parameters of the same job on one machine; Horovod's local and
cross ranks and torchrun's variables are right on every host; the timeline's parts reach the launcher
over the job's connections, h2's from a directory only h2 sees; output keeps its [role rank] prefix;
a refused or lost host is named with what to do; Ctrl-C leaves no process on any host; the job
secret is in no command line or environment; a stranger on another testbed host gets nothing.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testbed.netbed import NetbedUnavailable
from testbed.qdisc import shape
from testbed.ssh import ROOT, SshBed, ssh_bed
from tests.integration.cluster_reference import cluster_train_params
from tests.integration.elastic_dirs import assert_state_dir_removed

SCRIPT = "tests/integration/scripts/cluster_train.py"
#: a worker without a framework, for the tests of the launcher alone (a torch worker costs ten times its start)
PLAIN = "tests/integration/scripts/plain_train.py"
#: what a role started over ssh looks like in `ps` on its host
_REMOTE = re.compile(r"sluice\.launch\.remote|(cluster|elastic|pipeline|plain)_train\.py|"
                     r"sluice\.launch\.cli (server|aggregator)")


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshBed]:
    try:
        with ssh_bed(tmp_path_factory.mktemp("ssh"), ssh_hosts=2, extra_hosts=("h3", "stranger"),
                     private=tmp_path_factory.mktemp("h2-only")) as made:
            yield made
    except NetbedUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(autouse=True)
def no_segment_left() -> Iterator[None]:
    """Every test here leaves no shared-memory segment of the job's processes on any host (the
    namespaces share this machine's /dev/shm)."""
    before = set(Path("/dev/shm").glob("sluice-[0-9]*"))
    yield
    deadline = time.monotonic() + 10
    while left := set(Path("/dev/shm").glob("sluice-[0-9]*")) - before:
        if time.monotonic() > deadline:
            pytest.fail(f"shared-memory segments left behind: {sorted(map(str, left))}")
        time.sleep(0.2)


def _hosts(bed: SshBed, slots: int = 2) -> str:
    return ",".join(f"{address}:{slots}" for address in bed.hosts.values())


def _results(output: str) -> list[dict[str, Any]]:
    found = [json.loads(m.group(1)) for m in re.finditer(r"^\[worker \d+\] CLUSTER_RESULT (.*)$", output, re.M)]
    return sorted(found, key=lambda r: r["rank"])


def _left_on(bed: SshBed, host: str) -> list[str]:
    """The job's processes still running in `host`."""
    return bed.left_on(host, _REMOTE)


def _lines_until(job: subprocess.Popen[str], pattern: str, timeout: float) -> str:
    """`job`'s output up to and with its first line that matches `pattern` (the rest is left to read);
    fails when the output ends first or at `timeout`."""
    regex, seen, found = re.compile(pattern), [], threading.Event()

    def read() -> None:
        assert job.stdout is not None
        for line in iter(job.stdout.readline, ""):
            seen.append(line)
            if regex.search(line):
                found.set()
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    if not found.is_set():
        job.kill()
        reader.join(10)
        pytest.fail(f"no line matching {pattern!r} within {timeout:g} s:\n{''.join(seen)[-3000:]}")
    return "".join(seen)


def _nothing_left(bed: SshBed, within: float = 15.0) -> None:
    deadline = time.monotonic() + within
    while any(left := [p for host in bed.hosts for p in _left_on(bed, host)]):
        if time.monotonic() > deadline:
            pytest.fail(f"processes of the job still run {within:g} s after the launcher ended: {left}")
        time.sleep(0.2)


def _summed_in_local_groups(result: dict[str, Any], host_index: int, steps: int, small_too: bool = False,
                            local_group: str = "sluice") -> None:
    """Two workers a host: every step's gradients were summed in the host, then each local rank's share
    across the hosts (worker/hierarchy.py, or with local_group "torch" worker/torch/device_hierarchy.py), and
    so were Horovod's allreduces of a large tensor (and of the script's small one where `small_too`:
    collective.tree_below_bytes = 0)."""
    local, cross, groups = result["hierarchy"]
    assert local == ([0, 1] if host_index == 0 else [2, 3])
    assert cross == ([0, 2] if result["rank"] % 2 == 0 else [1, 3])
    assert groups >= steps
    assert (result["device_resident"] >= steps) == (local_group == "torch"), result["device_resident"]
    assert result["large"] == [True, True, True]  # Horovod's allreduce of a large tensor: sum, max, average
    assert result["groups_after_large"] == groups + 3 + small_too


@pytest.mark.timeout(240)
@pytest.mark.parametrize("local_group", ["sluice", "torch"])
def test_ssh_job_trains_across_hosts_as_on_one_machine_summing_in_local_groups(bed: SshBed, local_group: str) -> None:
    """Two workers a host: each step's weights go through the servers (each local rank's share a key of its own,
    declared by its cross set) and its biases by allreduce, both summed in the host first, by Sluice's shared
    memory or by torch's gloo group with the gradients in buffers of their own and the share alone copied out
    (the device-resident path CUDA gradients take: worker/torch/device_hierarchy.py); the job ends as the same
    job on one machine."""
    assert bed.private is not None
    timeline = bed.private / "trace.json"  # on h2, this directory is a tmpfs of h2's own
    # the ring's sizes from 0 bytes: the small model's groups take the hierarchy by allreduce too
    done = bed.launch(["-H", _hosts(bed), "-s", "2", "--timeline", str(timeline), "--set",
                       "collective.tree_below_bytes=0", "--set", f"collective.local_group={local_group}",
                       "--set", "collective.ps_patterns=*.weight", "--set", "collective.allreduce_patterns=*.bias",
                       "--", sys.executable, SCRIPT, "--steps", "12", "--optimizer", "adam"], timeout=150)
    assert done.returncode == 0, done.stdout[-5000:]
    # workers 2 and 3 and server 1 ran on h2 and wrote their parts where only h2 sees them: sent, they arrived
    for process in ("worker 2", "worker 3", "server 1"):
        assert re.search(rf"timeline: the part of {process} \(.*\) arrived", done.stdout), process
    events = json.loads(timeline.read_text())
    names = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert names == {"worker 0", "worker 1", "worker 2", "worker 3", "server 0", "server 1"}
    assert len({e["pid"] for e in events if e.get("name") == "process_name"}) == 6  # a row each
    assert list(bed.private.iterdir()) == [timeline]  # merged, and every part removed
    # the weights' shares through the servers (a key a server), every step; the biases by allreduce
    rows = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    spans = Counter((rows[e["pid"]], e["name"]) for e in events if e.get("ph") != "M")
    assert spans[("server 0", "SUM")] == spans[("server 1", "SUM")] == 12, (spans, done.stdout[-3000:])
    assert all(spans[(f"worker {r}", "PUSH")] == spans[(f"worker {r}", "PULL")] == 12 for r in range(4)), spans
    assert all(spans[(f"worker {r}", "ALLREDUCE")] >= 12 for r in range(4)), spans
    # each device-resident group's share out to the host and back, on every worker's row (READY marks backward)
    copies = {(e["name"], e["pid"]) for e in events if e.get("name") in ("D2H", "H2D")}
    workers = {e["pid"] for e in events if e.get("name") == "process_name" and "worker" in e["args"]["name"]}
    assert copies == ({(kind, pid) for kind in ("D2H", "H2D") for pid in workers} if local_group == "torch" else set())
    h1, h2 = bed.hosts["h1"], bed.hosts["h2"]
    assert re.search(rf"\[launch\]   {re.escape(h1)} \({re.escape(h1)}\): workers 0,1, server 0", done.stdout)
    assert re.search(rf"\[launch\]   {re.escape(h2)} \({re.escape(h2)}\): workers 2,3, server 1", done.stdout)
    results = _results(done.stdout)
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    for r in results:
        host_index = r["rank"] // 2
        assert r["listens_on"] == (h1, h2)[host_index]
        assert (r["local_rank"], r["local_size"], r["cross_rank"], r["cross_size"]) == (r["rank"] % 2, 2,
                                                                                        host_index, 2)
        assert r["env"] == {"RANK": str(r["rank"]), "WORLD_SIZE": "4", "LOCAL_RANK": str(r["rank"] % 2),
                            "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": h1}
        assert not r["secret_in_env"]
        assert r["params"] == results[0]["params"]
        _summed_in_local_groups(r, host_index, 12, small_too=True, local_group=local_group)
    reference = cluster_train_params(12, "adam", workers=4)  # the same job on one machine
    assert max(abs(a - b) for a, b in zip(results[0]["params"], reference, strict=True)) < 1e-6
    _nothing_left(bed)


@pytest.mark.timeout(120)
def test_ssh_refused_host_is_named_with_what_to_do(bed: SshBed) -> None:
    h3 = bed.netbed.hosts["h3"].address  # a host with no ssh server: the connection is refused
    started = time.monotonic()
    done = bed.launch(["-H", f"{bed.hosts['h1']}:1,{h3}:1", "-s", "1", "--", sys.executable, PLAIN],
                      timeout=90)
    assert done.returncode != 0
    assert time.monotonic() - started < 45, "a refused host must end the job promptly"
    assert re.search(rf"on {re.escape(h3)}, whose ssh session failed \(exit 255: the host is down or unreachable, "
                     rf"or refused the login; check that `ssh {re.escape(h3)} true` works", done.stdout), done.stdout
    assert "Connection refused" in done.stdout
    _nothing_left(bed)


@pytest.mark.timeout(150)
def test_ssh_lost_host_is_named_and_the_rest_stopped(bed: SshBed) -> None:
    """h2's link goes down mid-run: the launcher names what was lost and stops the job; nothing is left.
    Heartbeats every 0.5 s, missed for 3 (1 and 8 by default), name the silent worker sooner."""
    job = bed.netbed.run("launcher", [sys.executable, "-m", "sluice.launch.cli", "launch", *bed.ssh_options(),
                                      "-H", _hosts(bed, 1), "-s", "1", "--set", "scheduler.heartbeat_interval=0.5",
                                      "--set", "scheduler.heartbeat_timeout=3", "--", sys.executable, PLAIN,
                                      "--steps", "100000"],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    h2 = bed.netbed.hosts["h2"]
    try:
        # registered and training: worker 0 reports its first steps
        seen = _lines_until(job, r"^\[worker 0\] PLAIN_STEP \d+", timeout=60)
        assert job.poll() is None, seen[-3000:]
        subprocess.run(["ip", "netns", "exec", h2.netns, "ip", "link", "set", "eth0", "down"], check=True, timeout=10)
        out, _ = job.communicate(timeout=60)
        out = seen + out
    finally:
        subprocess.run(["ip", "netns", "exec", h2.netns, "ip", "link", "set", "eth0", "up"], timeout=10)
        if job.poll() is None:
            job.kill()
    assert job.returncode != 0
    assert re.search(r"sluice launch: .*(worker 1|server 0).*(silent|lost|on " + re.escape(h2.address) + ")", out), out
    _nothing_left(bed, within=40.0)  # h2's roles end once they hear nothing from the scheduler


@pytest.mark.timeout(120)
def test_ssh_ctrl_c_leaves_no_process_on_any_host(bed: SshBed) -> None:
    job = bed.netbed.run("launcher", [sys.executable, "-m", "sluice.launch.cli", "launch", *bed.ssh_options(),
                                      "-H", _hosts(bed), "-s", "2", "--", sys.executable, PLAIN,
                                      "--steps", "100000"],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 40
        while len([p for host in bed.hosts for p in _left_on(bed, host)]) < 6:  # 4 workers, 2 servers (+ stubs)
            assert job.poll() is None and time.monotonic() < deadline, "the job did not start on both hosts"
            time.sleep(0.2)
        secrets = _hex_secrets_in_command_lines()
        job.send_signal(signal.SIGINT)
        out, _ = job.communicate(timeout=40)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 130, out[-3000:]
    assert "received SIGINT; stopping the job" in out
    assert secrets == []
    _nothing_left(bed)


def _hex_secrets_in_command_lines() -> list[str]:
    """Command lines on this machine (every namespace) holding a 64-digit hex string: a leaked job secret."""
    leaked = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if re.search(r"\b[0-9a-f]{64}\b", cmdline):
                leaked.append(cmdline[:200])
    return leaked


def test_ssh_bad_hostfile_line_is_named(tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1 slots=2\nnode2 slot=2\n")
    done = subprocess.run([sys.executable, "-m", "sluice.launch.cli", "launch", "--hostfile", str(hostfile), "-s",
                           "1", "--", "true"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert f"{hostfile}, line 2: 'slot=2' is not slots=N or rack=LABEL" in done.stderr


@pytest.mark.timeout(240)
def test_ssh_recovery_restarts_a_killed_server_on_its_host(bed: SshBed) -> None:
    """ps.recover across hosts: server 0 (on h1) is killed in step 5 and restarted there over ssh.
    The in-flight bound is set (to what a calibration chooses here), so no calibration runs: in 4 KiB
    chunks it takes seconds."""
    done = bed.launch(["-H", _hosts(bed, 1), "-s", "2", "--set", "ps.recover=true", "--set", "collective.mode=ps",
                       "--set", "worker.optimizer_on=server", "--set", "transport.chunk_bytes=4096",
                       "--set", "transport.inflight_bytes=16777216", "--",
                       sys.executable, SCRIPT, "--steps", "12", "--hidden", "256", "--kill-server-at", "5"],
                      timeout=200)
    assert done.returncode == 0, done.stdout[-5000:]
    assert re.search(r"server 0 on \S+ was killed by SIGKILL; restarting it \(1 of at most 3 restarts\)",
                     done.stdout), done.stdout[-3000:]
    results = _results(done.stdout)
    assert len(results) == 2 and results[0]["params"] == results[1]["params"]
    _nothing_left(bed)
    # this job's files only: other tests running beside it may hold theirs
    tag = re.search(r"/dev/shm/sluice-state-([0-9a-f]+)-server-0-like files", done.stdout)
    assert tag is not None, done.stdout[:3000]
    left = list(Path("/dev/shm").glob(f"sluice-state-{tag.group(1)}-*"))
    assert not left, f"state files outlived the job: {left}"


@pytest.mark.timeout(240)
def test_ssh_elastic_job_drops_a_worker_of_another_host(bed: SshBed) -> None:
    h1, h2 = bed.hosts["h1"], bed.hosts["h2"]
    done = bed.launch(["-H", f"{h1}:2,{h2}:1", "-s", "1", "--elastic", "--min-workers", "2", "--", sys.executable,
                       "tests/integration/scripts/elastic_train.py", "--steps", "12", "--die-at", "5",
                       "--die-rank", "2"], timeout=200)
    assert done.returncode == 0, done.stdout[-5000:]
    assert "dropping worker 2 and re-forming the job (--elastic)" in done.stdout
    assert "[launch] re-forming the job: generation 1 with 2 workers" in done.stdout
    sizes = [json.loads(m.group(1))["size"] for m in re.finditer(r"ELASTIC_RESULT (.*)$", done.stdout, re.M)]
    assert sizes == [2, 2]
    _nothing_left(bed)
    assert_state_dir_removed(done.stdout)


@pytest.mark.timeout(150)
def test_ssh_pipeline_compresses_activations_only_between_hosts(bed: SshBed) -> None:
    """A 2-stage pipeline, each stage on its own host: `compress=auto` encodes what
    crosses between hosts (ReLU activations: about half zeros) and the job trains as one process."""
    from tests.integration.pipeline_helpers import check_matches, reference

    h1, h2 = bed.hosts["h1"], bed.hosts["h2"]
    done = bed.launch(["-H", f"{h1}:1,{h2}:1", "-s", "0", "--", sys.executable,
                       "tests/integration/scripts/pipeline_train.py", "--stages", "2", "--steps", "10"], timeout=140)
    assert done.returncode == 0, done.stdout[-5000:]
    results = sorted((json.loads(m.group(1)) for m in re.finditer(r"PIPELINE_RESULT (.*)$", done.stdout, re.M)),
                     key=lambda r: r["rank"])
    assert [r["stage"] for r in results] == [0, 1]
    assert results[0]["ratio"]["forward"] > 1.2, results[0]["ratio"]
    check_matches(results, 2, reference(10, 16))
    _nothing_left(bed)


@contextlib.contextmanager
def _slow_egress(bed: SshBed, host: str, mbit: float) -> Iterator[None]:
    """`host`'s outgoing traffic shaped to `mbit` Mbit/s (tbf, as a netbed link's) until the block ends."""
    netns = bed.netbed.hosts[host].netns
    shape(netns, "eth0", mbit)
    try:
        yield
    finally:
        subprocess.run(["ip", "netns", "exec", netns, "tc", "qdisc", "del", "dev", "eth0", "root"], timeout=20)


@pytest.mark.timeout(150)
def test_ssh_pipeline_on_a_slow_link_delivers_the_last_gradients_before_leaving(bed: SshBed) -> None:
    """The last stage's final gradients (8 MiB) take 4 s on a 16 Mbit/s link, longer than a closing
    transport flushes: the stage stays until the stage before confirms it has them (PipelineStage.close).
    One hidden layer 8192 wide: big activations, little compute. The last stage runs on h2, whose
    outgoing traffic (those gradients) is shaped; the activations come to it at full speed."""
    h1, h2 = bed.hosts["h1"], bed.hosts["h2"]
    with _slow_egress(bed, "h2", 16.0):
        done = bed.launch(["-H", f"{h1}:1,{h2}:1", "-s", "0", "--", sys.executable,
                           "tests/integration/scripts/pipeline_train.py", "--stages", "2", "--steps", "1",
                           "--micro", "1", "--layers", "2", "--width", "8192", "--batch", "256",
                           "--compress", "off"], timeout=120)
        assert done.returncode == 0, done.stdout[-5000:]
        assert len(re.findall(r"^\[worker \d\] PIPELINE_RESULT", done.stdout, re.M)) == 2
        _nothing_left(bed)
