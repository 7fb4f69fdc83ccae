"""How the launcher reaches hosts and plans a multi-host job (pure parts, literal tables)."""

from __future__ import annotations

import io
import subprocess

import pytest

from sluice.launch.cluster import plan_cluster, read_hosts
from sluice.launch.config import SluiceConfig, load_config
from sluice.launch.hosts import Host, HostsError
from sluice.launch.reach import Reach, forwarded_env, header_line, stub_argv
from sluice.launch.remote import parse_header
from sluice.launch.takeover import with_replicas
from sluice.scheduler.recovery import chosen_mirror_every


def test_ssh_command_carries_no_secret_and_keeps_the_session_alive_checks() -> None:
    reach = Reach("ssh", 2222, "/k/id", ("UserKnownHostsFile=/k/known", "ServerAliveInterval=1"))
    argv = stub_argv(reach, "node1", "/venv/bin/python", "/work dir")
    assert argv == [
        "ssh", "-T", "-o", "UserKnownHostsFile=/k/known", "-o", "ServerAliveInterval=1", "-o", "BatchMode=yes",
        "-o", "ConnectTimeout=10", "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3", "-p", "2222",
        "-i", "/k/id", "node1", "cd '/work dir' && exec /venv/bin/python -m sluice.launch.remote"]
    # ssh takes the first value of an option: the user's --ssh-option overrides the launcher's default
    shown = subprocess.run([argv[0], "-G", *argv[2:-2]], capture_output=True, text=True, timeout=10)
    if shown.returncode == 0:  # ssh installed
        assert "serveraliveinterval 1" in shown.stdout.splitlines()


def test_srun_command_starts_one_task_on_the_named_node() -> None:
    assert stub_argv(Reach("srun"), "gpu07", "/venv/bin/python", "/work") == [
        "srun", "--nodes=1", "--ntasks=1", "--nodelist=gpu07", "--overlap", "--kill-on-bad-exit=1", "--quiet",
        "--chdir=/work",
        "/venv/bin/python", "-m", "sluice.launch.remote"]


@pytest.mark.parametrize(("option", "error"), [("BatchMode", "KEY=VALUE"), ("=x", "KEY=VALUE")])
def test_bad_ssh_options_are_refused(option: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        Reach("ssh", ssh_options=(option,))


def test_the_launchers_session_variables_stay_behind() -> None:
    env = {"PATH": "/bin", "PYTHONPATH": "/p", "OMP_NUM_THREADS": "2", "SSH_AUTH_SOCK": "/s", "PWD": "/x",
           "HOSTNAME": "login1", "SLURM_JOB_ID": "7", "SLUICE_SECRET_FD": "5", "SLUICE_TRANSPORT_CURVE": "true",
           "CUDA_VISIBLE_DEVICES": "0", "BASH_FUNC_module%%": "() {}"}
    assert forwarded_env(env) == {"PATH": "/bin", "PYTHONPATH": "/p", "OMP_NUM_THREADS": "2",
                                  "SLUICE_TRANSPORT_CURVE": "true", "CUDA_VISIBLE_DEVICES": "0"}


def test_the_header_is_what_the_remote_stub_reads() -> None:
    line = header_line(["python", "train.py"], {"A": "1"}, "/work", b"\x01\xff" * 16)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    header = parse_header(io.BytesIO(line).readline())
    assert (header.argv, header.env, header.cwd, header.secret) == (("python", "train.py"), {"A": "1"}, "/work",
                                                                   b"\x01\xff" * 16)


def test_host_sources() -> None:
    assert read_hosts("a:2,b", None, {}) == ([Host("a", 2), Host("b", 1)], "-H")
    assert read_hosts(None, None, {}) == ([], "")
    with pytest.raises(HostsError, match="not both"):
        read_hosts("a", "f", {})
    with pytest.raises(HostsError, match="cannot read the hostfile"):
        read_hosts(None, "/nonexistent/hosts", {})


def _config(host: str) -> SluiceConfig:
    return load_config(None, {}, [f"transport.host={host}"])


def test_plan_places_roles_and_listens_on_each_hosts_address() -> None:
    hosts = [Host("127.0.0.1", 2, "r1"), Host("192.0.2.10", 2, "r2")]  # this machine and a documentation address
    plan = plan_cluster(hosts, "-H", None, 2, 0, None, Reach(), _config("192.0.2.1"))
    assert [(p.role, p.rank, p.host, p.local_rank) for p in plan.layout.processes] == [
        ("worker", 0, "127.0.0.1", 0), ("worker", 1, "127.0.0.1", 1), ("worker", 2, "192.0.2.10", 0),
        ("worker", 3, "192.0.2.10", 1), ("server", 0, "127.0.0.1", 0), ("server", 1, "192.0.2.10", 0)]
    assert plan.here == frozenset({"127.0.0.1"})
    assert (plan.is_remote("127.0.0.1"), plan.is_remote("192.0.2.10")) == (False, True)
    assert (plan.address("127.0.0.1"), plan.address("192.0.2.10")) == ("192.0.2.1", "192.0.2.10")
    assert plan.describe().splitlines() == [
        "hosts from -H; the scheduler runs here (192.0.2.1)",
        "  127.0.0.1 (this machine): workers 0,1, server 0",
        "  192.0.2.10 (192.0.2.10): workers 2,3, server 1"]
    racks = plan.with_racks(_config("192.0.2.1"), hosts).aggregation.racks
    assert racks == ("r1: 192.0.2.1", "r2: 192.0.2.10")


def test_a_loopback_launcher_address_cannot_serve_other_hosts() -> None:
    with pytest.raises(HostsError, match=r"transport.host = 127.0.0.2 cannot be reached from the other hosts"):
        plan_cluster([Host("192.0.2.10")], "-H", None, 1, 0, None, Reach(), _config("127.0.0.2"))


def test_under_srun_every_role_goes_through_slurm() -> None:
    plan = plan_cluster([Host("127.0.0.1", 2)], "SLURM job 3", None, 1, 0, None, Reach("srun"), _config("127.0.0.1"))
    assert plan.is_remote("127.0.0.1")
    assert plan.launcher_address == "127.0.0.1"


@pytest.mark.parametrize(("workers", "copies", "every"), [
    (1, 1, 16), (2, 1, 16), (3, 1, 14), (4, 1, 10), (6, 1, 7), (8, 1, 5), (10, 1, 4), (64, 1, 4),
    (4, 2, 16), (8, 2, 10), (8, 3, 15), (16, 2, 5), (64, 3, 4)])
def test_mirror_every_is_chosen_from_the_worker_count_and_the_copies(workers: int, copies: int, every: int) -> None:
    assert chosen_mirror_every(workers, copies) == every  # ceil(40 C / W), 4..16


def _replicas(hosts: list[Host], sets: list[str], servers: int = 2, aggregators: int = 0,
              elastic: bool = False) -> tuple[int, bool, int, str]:
    config = load_config(None, {}, ["transport.host=192.0.2.1", *sets])
    plan = plan_cluster(hosts, "-H", None, servers, aggregators, None, Reach(), config)
    chosen, said = with_replicas(config, plan, elastic, 4)
    return chosen.ps.replicas, chosen.ps.recover, chosen.ps.mirror_every, said


def test_replicas_are_chosen_when_the_servers_span_hosts_and_recovery_can_run() -> None:
    two = [Host("127.0.0.1", 2), Host("192.0.2.10", 2)]
    on = _replicas(two, [])
    assert on[:3] == (1, True, 10) and on[3].startswith("ps.replicas: each server's committed state is mirrored on "
                                                        "another host (its servers span 2 hosts)"), on
    assert on[3].endswith("ps.mirror_every = 10 (from 4 workers: each worker keeps that many copies of its "
                          "gradients to replay)")
    assert _replicas(two, [], servers=1) == (0, False, 10, "ps.replicas: off (the servers run on one host)")
    assert _replicas(two, [], aggregators=1)[:3] == (1, True, 10)  # one lost with a server host starts elsewhere
    assert _replicas(two, ["ps.replicas=0"], aggregators=1)[:2] == (0, False)  # asked: kept
    assert _replicas(two, ["ps.sync=false"])[3] == "ps.replicas: off (ps.sync = false is not covered)"
    assert _replicas(two, [], elastic=True)[3] == ("ps.replicas: off (--elastic restarts every process of a "
                                                   "generation)")
    assert _replicas(two, ["ps.replicas=0"]) == (0, False, 10, "")  # said so: nothing to say
    assert _replicas(two, ["ps.recover=true", "ps.replicas=1", "ps.mirror_every=3"]) == (1, True, 3, "")
    assert _replicas(two, ["ps.recover=true", "ps.replicas=1"])[3] == (
        "ps.replicas: ps.mirror_every = 10 (from 4 workers: each worker keeps that many copies of its gradients to "
        "replay)")
    assert _replicas([Host("127.0.0.1", 4)], [], servers=2) == (0, False, 10, "")  # one machine: nothing to say
    # more copies than the servers' other hosts: said, and each server keeps what there is room for
    more = _replicas(two, ["ps.recover=true", "ps.replicas=2"])
    assert more[:2] == (2, True) and more[3].startswith(
        "ps.replicas = 2, but the servers span 2 hosts: each server's state is mirrored on 1 other host(s); "
        "ps.mirror_every = 10"), more
    # two copies where three server hosts hold them: twice the bytes, so twice the rounds between mirrors
    three = [Host("127.0.0.1", 2), Host("192.0.2.10", 2), Host("192.0.2.11", 2)]
    assert _replicas(three, ["ps.recover=true", "ps.replicas=2"], servers=3)[2:] == (16, (
        "ps.replicas: ps.mirror_every = 16 (from 4 workers and 2 copies: each worker keeps that many copies of its "
        "gradients to replay)"))
