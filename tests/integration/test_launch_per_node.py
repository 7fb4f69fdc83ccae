"""torchrun's multi-machine command line, `--nnodes 3 --rdzv-endpoint ... --nproc-per-node 1 train.py` run once per
machine without ranks (three network namespaces as the machines) or `--nnodes 2 --node-rank K --master-addr ...` (two
launchers on 127.0.0.1): one job, and a failure on one machine ends both launchers, naming the worker, as does a
machine's launcher killed outright."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testbed.bench_runs import requires_testbed
from testbed.netbed import Netbed

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "integration" / "scripts" / "per_node.py"
#: the elastic range's worker: no framework, so each of its starts costs no torch import
ELASTIC = ROOT / "tests" / "integration" / "scripts" / "elastic_machines.py"
pytestmark = pytest.mark.slow
#: the workers forked from one process of each machine that imported torch (the netbed test starts them afresh)
PRELOAD = ["--preload", "torch,sluice.torch"]


def _secret(tmp_path: Path) -> Path:
    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)
    return secret


def _command(rank: int, master: str, port: int, secret: Path, *script_args: str,
             launch_args: tuple[str, ...] | list[str] = ()) -> list[str]:
    return [sys.executable, "-m", "sluice.launch.cli", "launch", "--nnodes", "2", "--node-rank", str(rank),
            "--master-addr", master, "--master-port", str(port), "--nproc-per-node", "2", "--secret-file",
            str(secret), *launch_args, str(SCRIPT), *script_args]


def _machine(launcher: subprocess.Popen[str]) -> str:
    args = list(launcher.args)  # type: ignore[arg-type]
    return str(args[args.index("--node-rank") + 1])


def _finish(launchers: list[subprocess.Popen[str]], timeout: float) -> list[tuple[int, str, str]]:
    """Each launcher's (exit code, stdout, stderr), each given `timeout` seconds to end; one still running then fails
    the test with what every launcher printed (the late ones killed first), so that it says which machine hung."""
    ended, late = [], []
    for launcher in launchers:
        try:
            out, err = launcher.communicate(timeout=0.1 if late else timeout)
        except subprocess.TimeoutExpired:
            late.append(_machine(launcher))
            launcher.kill()
            out, err = launcher.communicate()
        ended.append((launcher.returncode, out, err))
    if late:
        told = "".join(f"\n--- machine {_machine(launcher)} (exit {code}):\n{out[-2000:]}{err[-2000:]}"
                       for launcher, (code, out, err) in zip(launchers, ended, strict=True))
        pytest.fail(f"the launcher of machine {', '.join(late)} did not end within {timeout} s:{told}")
    return ended


@requires_testbed
@pytest.mark.timeout(90)
def test_three_machines_launched_apart_without_ranks_run_one_job_with_torchruns_variables(tmp_path: Path) -> None:
    """Three hosts of their own addresses (network namespaces), torchrun's c10d command line as `srun` runs it, with
    no --node-rank: machine 0 is the one with the rendezvous address, the others ask it for their ranks; each
    machine's processes listen on the address that reaches machine 0, the scheduler on the rendezvous port."""
    secret = _secret(tmp_path)
    with Netbed() as bed:
        for name in ("m0", "m1", "m2"):
            bed.host(name)
        master = bed.hosts["m0"].address
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0"}  # torch's gloo: the hostname resolves to no address here
        command = [sys.executable, "-m", "sluice.launch.cli", "launch", "--nnodes", "3", "--nproc-per-node", "1",
                   "--rdzv-backend", "c10d", "--rdzv-id", "7", "--rdzv-endpoint", f"{master}:29400", "--secret-file",
                   str(secret), str(SCRIPT)]
        launchers = [bed.run(name, command, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE) for name in ("m2", "m1", "m0")]  # any may start first
        ended = _finish(launchers, 60)
    outputs = {name: out + err for name, (_, out, err) in zip(("m2", "m1", "m0"), ended, strict=True)}
    assert all(code == 0 for code, _, _ in ended), "".join(text[-3000:] for text in outputs.values())
    results = sorted(line.split("RESULT ")[1] for text in outputs.values() for line in text.splitlines()
                     if "RESULT " in line)
    # rank, size, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK (machine), Sluice's sum, torch.distributed's sum
    assert results == ["0 3 0 1 0 3.0 3.0 0", "1 3 0 1 1 3.0 3.0 0", "2 3 0 1 2 3.0 3.0 0"]
    assert "[worker 0] RESULT" in outputs["m0"]
    assert f"[scheduler] SLUICE_SCHEDULER_READY tcp://{master}:29400" in outputs["m0"]
    for name in ("m1", "m2"):  # each asked machine 0, got a rank of its own and ran that worker
        assert "[scheduler]" not in outputs[name]
        assert f"[launch] asking machine 0 at {master}:29403 for this machine's rank" in outputs[name]
        rank = int(outputs[name].split("[launch] machine ")[1][0])
        assert f"[worker {rank}] RESULT" in outputs[name]
        assert f"machine {rank} of 3: worker {rank}; the scheduler at {master}:29400" in outputs[name]
    assert outputs["m0"].count(" of 3: ") == 3  # machine 0's own line, and one for each machine it gave a rank


def _elastic(bed: Netbed, name: str, master: str, secret: Path, size: int, restart: int) -> subprocess.Popen[str]:
    """Machine `name`'s launcher of torchrun's elastic line as Kubeflow's PyTorchJob runs it (PET_* variables, no
    rank), a round closing two seconds after its second machine joined; its workers finish in a job of `size` ranks
    in its restart `restart`, and wait in any other."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0", "PET_NNODES": "2:3", "PET_NPROC_PER_NODE": "1",
           "PET_RDZV_BACKEND": "c10d", "PET_RDZV_ENDPOINT": f"{master}:29400", "PET_MAX_RESTARTS": "1",
           "PET_RDZV_CONF": "last_call_timeout=2,join_timeout=40"}
    command = [sys.executable, "-m", "sluice.launch.cli", "launch", "--set", "scheduler.heartbeat_interval=0.25",
               "--set", "scheduler.heartbeat_timeout=2", "--secret-file", str(secret), str(ELASTIC), str(size),
               str(restart)]
    return bed.run(name, command, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _running(launcher: subprocess.Popen[str], size: int) -> str:
    """`launcher`'s output until its worker runs in a job of `size` ranks."""
    assert launcher.stdout is not None
    read = []
    for line in launcher.stdout:
        read.append(line)
        if "RUNNING " in line and line.split()[-3] == str(size):
            return "".join(read)
    raise AssertionError(f"the launcher ended before its worker ran in a job of {size}: {''.join(read)[-3000:]}")


def _results(outputs: list[str]) -> list[str]:
    return sorted(line.split("RESULT ")[1] for text in outputs for line in text.splitlines() if "RESULT " in line)


@requires_testbed
@pytest.mark.timeout(120)
def test_an_elastic_range_of_machines_grows_when_one_joins_and_goes_on_without_one_that_is_lost(
        tmp_path: Path) -> None:
    """torchrun's --nnodes 2:3 as Kubeflow's elastic PyTorchJob starts it, three network namespaces as the machines:
    two machines start the job; a third started later joins it (every machine's processes start again, with
    WORLD_SIZE 3, not counted as a restart); then a machine lost outright (its launcher killed) ends the start, and the
    two left go on in a job of two (TORCHELASTIC_RESTART_COUNT 1), after the round's last call."""
    secret = _secret(tmp_path)
    with Netbed() as bed:
        for name in ("m0", "m1", "m2"):
            bed.host(name)
        master = bed.hosts["m0"].address
        first = [_elastic(bed, name, master, secret, 3, 0) for name in ("m1", "m0")]
        began = _running(first[1], 2)  # a job of two after the last call: machine 2 joins it
        ended = _finish([*first, _elastic(bed, "m2", master, secret, 3, 0)], 60)
        outputs = [out + err for _, out, err in ended]
        outputs[1] = began + outputs[1]
        assert all(code == 0 for code, _, _ in ended), "".join(text[-3000:] for text in outputs)
        assert _results(outputs) == ["0 3 0 1 0 3.0 0", "1 3 0 1 1 3.0 0", "2 3 0 1 2 3.0 0"]
        zero = outputs[1]
        assert "[launch] start 1: 2 machines (0 here, 1 " in zero
        assert re.search(r"start \d: 3 machines \(0 here, 1 ", zero), zero[-3000:]
        assert "joins start 2 (2 machines of --nnodes 2:3)" in zero  # machine 2 first, then machine 1 again
        for out in outputs[:2]:
            assert "[launch] restarting this machine's processes: start 2 (--nnodes 2:3, --max-restarts 1)" in out
        # lost: machine 2's launcher killed while the three run; the others' workers fail on it, and start again
        launchers = [_elastic(bed, name, master, secret, 2, 1) for name in ("m0", "m1", "m2")]
        _running(launchers[2], 3)
        launchers[2].kill()
        ended = _finish(launchers[:2], 60)
        launchers[2].communicate()
    outputs = [out + err for _, out, err in ended]
    assert all(code == 0 for code, _, _ in ended), "".join(text[-3000:] for text in outputs)
    assert _results(outputs) == ["0 2 0 1 0 1.0 1", "1 2 0 1 1 1.0 1"]
    starts = re.findall(r"\[launch\] start \d+: (\d) machines", outputs[0])
    assert starts[-1] == "2" and "3" in starts, outputs[0][-3000:]  # three ran, two went on


@pytest.mark.timeout(90)
def test_a_worker_failing_on_one_machine_ends_both_launchers_naming_it(tmp_path: Path) -> None:
    secret = _secret(tmp_path)
    with socket.socket() as probe:  # the workers' MASTER_PORT; the scheduler listens on the ports above it
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started = time.monotonic()
    launchers = [subprocess.Popen(_command(rank, "127.0.0.1", port, secret, "fail", launch_args=PRELOAD), cwd=ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (1, 0)]
    (code1, _, err1), (code0, out0, err0) = _finish(launchers, 60)
    assert code1 == 1 and err1.startswith("sluice launch: worker 3 (pid "), err1[-3000:]  # the first to fail
    assert "RuntimeError: rank 3 fails on purpose" in err1
    assert code0 != 0, (out0 + err0)[-3000:]  # machine 0's workers lost their peer: the launcher says who
    # machine 0 names worker 3 and what ended it: as machine 1's launcher told it ("machine 1 (HOST): worker 3 (pid N)
    # exited with code 1; its last line: RuntimeError: ..."), or as its own workers heard worker 3's goodbye first
    # ("worker 3 (on HOST) has left the job with an error (RuntimeError: ...)", scheduler/leaving.py)
    relayed = r"machine 1 \(\S+\): worker 3 \(pid \d+\) exited with code 1; its last line: RuntimeError: rank 3 fails"
    heard = r"worker 3 \(on \S+\) has left the job with an error \(RuntimeError: rank 3 fails"
    assert re.search(f"({relayed}|{heard}) on purpose", err0), err0[-3000:]
    assert time.monotonic() - started < 45


@pytest.mark.timeout(90)
def test_a_scheduler_that_cannot_start_on_machine_0_ends_the_other_machines_launcher_within_seconds(
        tmp_path: Path) -> None:
    """Another process holds the port above --master-port, so machine 0's scheduler cannot listen: machine 0's
    launcher fails saying so, and machine 1's, whose workers would wait for that scheduler for their whole
    rendezvous timeout (125 s), follows machine 0's count of the job's starts and ends within seconds too."""
    secret = _secret(tmp_path)
    with socket.socket() as probe, socket.socket() as holder:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        holder.bind(("0.0.0.0", port + 1))  # the scheduler's port (OSError, rarely: taken already; run it again)
        holder.listen()
        probe.close()
        started = time.monotonic()
        launchers = [subprocess.Popen(_command(rank, "127.0.0.1", port, secret, launch_args=PRELOAD), cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (1, 0)]
        (code1, out1, err1), (code0, _, err0) = _finish(launchers, 60)
    assert code0 == 1 and "the scheduler cannot listen" in err0 and "Address already in use" in err0, err0[-3000:]
    # machine 1 says which machine's process failed, and how, as machine 0's launcher told machine 0's service
    assert code1 == 1 and re.search(r"another machine's processes failed \(machine 0 \(\S+\): scheduler \(pid \d+\) "
                                    r"exited with code 1; its last line: ERROR sluice.scheduler: the scheduler cannot "
                                    r"listen: .*\); stopping this machine's", err1), (out1 + err1)[-3000:]
    # with the cause named, machine 1 stops its processes at once (5-6 s in all, idle; 17-25 s when it gave them
    # OWN_FAILURE_S to fail by themselves first)
    assert time.monotonic() - started < 30


@pytest.mark.timeout(180)
def test_max_restarts_starts_every_machines_processes_again_after_one_fails_and_ends_them_after_the_last(
        tmp_path: Path) -> None:
    """torchrun's --max-restarts with a launcher per machine: worker 3 (machine 1) fails in the job's first start;
    machine 1 tells machine 0, both stop their processes, and the second start (TORCHELASTIC_RESTART_COUNT=1) runs
    the job to its end on both machines."""
    secret = _secret(tmp_path)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    launchers = [subprocess.Popen(_command(rank, "127.0.0.1", port, secret, "fail-once",
                                           launch_args=[*PRELOAD, "--max-restarts", "1"]), cwd=ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (1, 0)]
    (code1, out1, err1), (code0, out0, err0) = _finish(launchers, 100)
    assert code0 == 0 and code1 == 0, (out0 + err0)[-3000:] + (out1 + err1)[-3000:]
    assert "RuntimeError: rank 3 fails on the first start" in out1 + err1
    for out in (out0, out1):
        assert "[launch] restarting this machine's processes: start 2 of at most 2 (--max-restarts 1; the workers " \
               "see TORCHELASTIC_RESTART_COUNT=1)" in out
    results = sorted(line.split("RESULT ")[1] for line in (out0 + out1).splitlines() if "RESULT " in line)
    assert results == ["0 4 0 2 0 6.0 6.0 1", "1 4 1 2 0 6.0 6.0 1", "2 4 0 2 1 6.0 6.0 1", "3 4 1 2 1 6.0 6.0 1"]
    # failing every time: the second start fails too, and with no restart left every machine ends
    launchers = [subprocess.Popen(_command(rank, "127.0.0.1", port, secret, "fail",
                                           launch_args=[*PRELOAD, "--max-restarts", "1"]), cwd=ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (1, 0)]
    (code1, out1, err1), (code0, out0, err0) = _finish(launchers, 100)
    assert code1 == 1 and code0 != 0, (out0 + err0)[-3000:] + (out1 + err1)[-3000:]
    assert "the job failed with no restart left (--max-restarts 1); ending it" in err1
    assert out1.count("[launch] restarting this machine's processes") == 1


@pytest.mark.timeout(90)
def test_a_machines_launcher_killed_outright_takes_its_workers_and_the_other_machine_ends_naming_one(
        tmp_path: Path) -> None:
    secret = _secret(tmp_path)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    quick = [*PRELOAD, "--set", "scheduler.heartbeat_interval=0.25", "--set", "scheduler.heartbeat_timeout=2"]
    launchers = [subprocess.Popen(_command(rank, "127.0.0.1", port, secret, "long", launch_args=quick), cwd=ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (1, 0)]
    try:
        assert launchers[0].stdout is not None
        pids = []
        for line in launchers[0].stdout:  # machine 1's workers, once they run
            if "RUNNING " in line:
                pids.append(int(line.split()[-1]))
                if len(pids) == 2:
                    break
        assert len(pids) == 2
        launchers[0].kill()  # SIGKILL: machine 1's launcher can stop nothing itself
        launchers[0].wait(10)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in pids):
            time.sleep(0.2)
        assert not any(Path(f"/proc/{pid}").exists() for pid in pids), "a worker outlived its machine's launcher"
        assert not [name for name in os.listdir("/dev/shm") for pid in pids if name.startswith(f"sluice-{pid}-")]
        out0, err0 = launchers[1].communicate(timeout=45)
        assert launchers[1].returncode != 0, (out0 + err0)[-3000:]
        # the scheduler's verdict first: a worker of the lost machine, by name (no goodbye: its heartbeats stopped)
        first = err0.splitlines()[0]
        assert first.startswith(("sluice launch: worker 2 (pid ", "sluice launch: worker 3 (pid ")), err0
        assert "; scheduler (pid " in first and "reported: " in first and "it is lost" in first, err0
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                launcher.kill()
            launcher.communicate()


@pytest.mark.timeout(30)
def test_a_machine_without_the_secret_starts_nothing_and_says_what_to_give(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "sluice.launch.cli", "launch", "--nnodes", "2", "--node-rank", "1",
                           "--nproc-per-node", "2", str(SCRIPT)], cwd=ROOT, capture_output=True, text=True, timeout=25)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "no --secret-file: every process of the job needs the job secret" in done.stderr
    assert "--set transport.curve=false" in done.stderr and "RESULT" not in done.stdout
