"""`sluice node` end to end, in the shape of a Kubernetes Indexed Job: one process per index, on 127.0.0.1."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from sluice.launch.master_port import free_port
from sluice.launch.node import NodeError, role_of
from sluice.transport.auth import JobKeys
from sluice.transport.base import open_transport
from sluice.transport.config import TransportConfig
from tests.integration.node_procs import ROOT, Node, env_without_sluice, secret_file, start_node

# A worker of a real job: it checks it is the process `sluice node` started (exec, not a child), what
# it was told, and that the secret came only through the pipe; then every worker adds rank + 1.
WORKER = """
import os, sys
import numpy as np
from sluice.worker.node import WorkerNode
print("pid", os.getpid(), flush=True)
print("torchrun", *(os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")), flush=True)
print("master", os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"), flush=True)
node = WorkerNode()
client = node.ps
fd = int(os.environ["SLUICE_SECRET_FD"])
try:
    what = os.readlink(f"/proc/self/fd/{fd}")
except OSError:
    what = "closed"
print("secret pipe", "still open" if what.startswith("pipe:") else "closed", flush=True)
secret = open(sys.argv[1]).read().strip()
leaks = [k for k, v in os.environ.items() if secret in v or ("SECRET" in k and k != "SLUICE_SECRET_FD")]
print("secret in environ:", leaks, "in argv:", secret in " ".join(sys.argv), flush=True)
print("rank", client.rank, flush=True)
client.declare([("w", (1000,), "float32", None)])
out = np.zeros(1000, np.float32)
for _ in range(3):
    client.push_pull("w", np.full(1000, client.rank + 1, np.float32), out).wait(30)
print("sum", out[0], flush=True)
node.close()
"""


def test_indexes_map_to_roles_in_order() -> None:
    assert [role_of(i, 2, 2, 1) for i in range(6)] == [
        ("scheduler", 0), ("server", 0), ("server", 1), ("aggregator", 0), ("worker", 0), ("worker", 1)]
    with pytest.raises(NodeError, match=r"index 6 is outside this job: .* make 6 processes, indexes 0\.\.5"):
        role_of(6, 2, 2, 1)


@pytest.mark.timeout(90)
def test_a_job_of_nodes_trains_and_every_node_exits_0(nodes: list[Node], tmp_path: Path) -> None:
    secret = secret_file(tmp_path / "secret")
    script = tmp_path / "train.py"
    script.write_text(WORKER)
    port, master = free_port(), free_port()
    # a name, not an address: zmq resolves it at each try to connect, as it will NAME-0.NAME on Kubernetes
    job = ["-w", "2", "-s", "1", "--scheduler", f"localhost:{port}", "--secret-file", str(secret),
           "--master", f"127.0.0.1:{master}", "--", sys.executable, str(script), str(secret)]
    # workers first: like pods, they may start before the scheduler listens, and wait for it
    by_index = {index: start_node(nodes, index, job) for index in (3, 2, 1)}
    # the scheduler takes its index from Kubernetes' variable
    by_index[0] = start_node(nodes, None, job, env_without_sluice(JOB_COMPLETION_INDEX="0"))
    started = [by_index[index] for index in range(4)]
    codes = [node.finish(60) for node in started]
    assert codes == [0, 0, 0, 0], "\n\n".join(n.output() for n in started)
    scheduler, server, *workers = started
    assert f"SLUICE_SCHEDULER_READY tcp://127.0.0.1:{port}" in scheduler.output()
    assert "sluice node: server 0:" in server.output()
    for rank, worker in enumerate(workers):
        out = worker.output()
        assert f"pid {worker.proc.pid}" in out  # exec'd: the node's process is the worker itself
        assert f"torchrun {rank} 2 0 1" in out and f"master 127.0.0.1 {master}" in out
        assert f"rank {rank}" in out and "sum 3.0" in out
        assert "secret pipe closed" in out and "secret in environ: [] in argv: False" in out


@pytest.mark.timeout(60)
def test_bad_secret_files_and_indexes_are_refused_saying_what_to_do(tmp_path: Path) -> None:
    def node(index: str | None, secret: Path | None, env: dict[str, str] | None = None) -> tuple[int, str]:
        args = [sys.executable, "-m", "sluice.launch.node", "-w", "2", "-s", "1", "--scheduler", "127.0.0.1:1",
                *([] if index is None else ["--index", index]),
                *([] if secret is None else ["--secret-file", str(secret)]), "--", "true"]
        done = subprocess.run(args, cwd=ROOT, env=env or env_without_sluice(), capture_output=True, text=True,
                              timeout=30)
        return done.returncode, done.stderr

    readable = secret_file(tmp_path / "readable", 0o644)
    code, err = node("1", readable)
    assert code == 2 and f"the secret file {readable} can be read by others (mode 0644): run chmod 600" in err
    code, err = node("1", secret_file(tmp_path / "short", text="tiny\n"))
    assert code == 2 and "holds 4 bytes" in err and "openssl rand -hex 32" in err
    code, err = node("1", tmp_path)
    assert code == 2 and "is not a regular file" in err
    code, err = node("1", None)
    assert code == 2 and "no --secret-file" in err and "transport.curve=false" in err
    code, err = node(None, secret_file(tmp_path / "good"))
    assert code == 2 and "--index" in err and "JOB_COMPLETION_INDEX" in err
    code, err = node("4", tmp_path / "good")
    assert code == 2 and "index 4 is outside this job" in err and "4 processes, indexes 0..3" in err


@pytest.mark.timeout(60)
def test_a_taken_scheduler_port_is_named(nodes: list[Node], tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        node = start_node(nodes, 0, ["-w", "1", "-s", "0", "--scheduler", f"127.0.0.1:{port}",
                                 "--secret-file", str(secret_file(tmp_path / "secret")), "--", "true"])
        assert node.finish(30) == 1
    assert f"cannot listen on tcp://127.0.0.1:{port} (Address already in use): another process holds it" \
        in node.output()


def _free_run(count: int) -> int:
    """The first of `count` consecutive free ports below Linux's ephemeral range (32768 on), where no
    port the OS hands out to another test can land meanwhile."""
    for base in random.Random().sample(range(20000, 32000 - count), 200):
        try:
            for port in range(base, base + count):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise AssertionError(f"no {count} consecutive free ports between 20000 and 32000")


@pytest.mark.timeout(30)
@pytest.mark.serial
def test_a_transport_listens_on_a_fixed_port_or_releases_it() -> None:
    config = TransportConfig(channels=3)
    transport = open_transport("scheduler", config, lambda *_: None, keys=JobKeys(b"k" * 32, ["scheduler"]))
    try:
        with socket.socket() as holder:
            base = _free_run(3)
            taken = base + 1
            holder.bind(("127.0.0.1", taken))
            holder.listen()
            with pytest.raises(OSError, match=f"cannot listen on tcp://127.0.0.1:{taken} .*another process holds it"):
                transport.listen(base)  # channel 1 would need the port taken
            with pytest.raises(ValueError, match="a fixed port needs"):
                transport.listen(65535)
        # what the failed try bound was closed again: the same ports can be had now
        assert transport.listen(base)[:3] == [f"tcp://127.0.0.1:{base + c}" for c in range(3)]  # then its Unix sockets
    finally:
        transport.close()


@pytest.mark.timeout(90)
def test_a_worker_with_another_secret_cannot_join(nodes: list[Node], tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(WORKER)
    port = free_port()
    secret, stranger = secret_file(tmp_path / "secret"), secret_file(tmp_path / "other")

    def job(secret_file: Path, rendezvous_s: int = 4) -> list[str]:
        return ["-w", "2", "-s", "1", "--scheduler", f"127.0.0.1:{port}", "--secret-file", str(secret_file),
                "--set", f"scheduler.rendezvous_timeout={rendezvous_s}", "--", sys.executable, str(script),
                str(secret_file)]

    members = [start_node(nodes, index, job(secret)) for index in (0, 1, 2)]
    # a worker waits for its admission rendezvous_timeout + 5 s: the intruder's ends 3 s sooner than the
    # members' would, still after the scheduler's rendezvous timed out
    intruder = start_node(nodes, 3, job(stranger, rendezvous_s=1))
    codes = [node.finish(40) for node in (*members, intruder)]
    scheduler = members[0].output()
    assert all(code != 0 for code in codes), (codes, scheduler)
    assert "refused a connection whose handshake failed" in scheduler
    assert "rendezvous timed out after 4 s: 1 of 2 workers and 1 of 1 servers registered" in scheduler
    assert f"waiting for the scheduler at tcp://127.0.0.1:{port} to admit this worker" in intruder.output()
    assert "sum" not in members[2].output() and "sum" not in intruder.output()


def _one_worker_job(nodes: list[Node], tmp_path: Path, script_text: str, *options: str) -> list[Node]:
    """Scheduler, server and one worker running `script_text`, as indexes 0, 1, 2 of a job."""
    secret = secret_file(tmp_path / "secret")
    script = tmp_path / "train.py"
    script.write_text(script_text)
    job = ["-w", "1", "-s", "1", "--scheduler", f"127.0.0.1:{free_port()}", "--secret-file", str(secret),
           *options, "--", sys.executable, str(script)]
    return [start_node(nodes, index, job) for index in range(3)]


# A script that raises before it closes its node: Python's exit still says goodbye, with the error.
RAISES = """
import numpy as np
from sluice.worker.node import WorkerNode
node = WorkerNode()
node.ps.declare([("w", (1000,), "float32", None)])
node.ps.push_pull("w", np.ones(1000, np.float32), np.zeros(1000, np.float32)).wait(30)
raise RuntimeError("fails on purpose")
"""


@pytest.mark.timeout(60)
def test_a_worker_that_raises_without_closing_names_its_error_and_leaves_no_shared_memory(
        nodes: list[Node], tmp_path: Path) -> None:
    # heartbeats would only notice after a minute: the error must come from the goodbye
    scheduler, server, worker = _one_worker_job(nodes, tmp_path, RAISES, "--set", "scheduler.heartbeat_timeout=60")
    assert worker.finish(30) == 1
    assert "RuntimeError: fails on purpose" in worker.output()
    # the scheduler names it at once (the worker's pod carries the failure: its exit code is the job's verdict)
    scheduler.finish(20)
    assert "the first: worker 0 (RuntimeError: fails on purpose)" in scheduler.output(), scheduler.output()
    assert server.finish(20) == 0, server.output()
    assert not [name for name in os.listdir("/dev/shm") if name.startswith(f"sluice-{worker.proc.pid}-")]


# A worker that forks a child which ends normally: the child inherits the node's exit handler (the node closes
# only in the process that made it), and its exit must leave the parent's node whole: its shared memory, which
# peers on this host may have yet to map, and its place in the job.
FORKS = """
import os, sys, time
import numpy as np
from sluice.worker.node import WorkerNode
node = WorkerNode()
node.ps.declare([("w", (1000,), "float32", None)])
out = np.zeros(1000, np.float32)
def segments():
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"sluice-{os.getpid()}-"))
before = segments()
pid = os.fork()
if pid == 0:
    sys.exit(0)  # a normal exit: atexit handlers run
started = time.monotonic()
os.waitpid(pid, 0)
print("child took", round(time.monotonic() - started), "s", flush=True)
print("segments kept:", bool(before) and segments() == before, flush=True)
node.ps.push_pull("w", np.ones(1000, np.float32), out).wait(30)
print("sum", out[0], flush=True)
node.close()
"""


@pytest.mark.timeout(60)
def test_a_child_forked_from_a_worker_exits_at_once_and_leaves_the_worker_in_the_job(
        nodes: list[Node], tmp_path: Path) -> None:
    scheduler, server, worker = _one_worker_job(nodes, tmp_path, FORKS)
    assert worker.finish(40) == 0, worker.output()
    out = worker.output()
    assert "child took 0 s" in out and "segments kept: True" in out and "sum 1.0" in out, out
    assert scheduler.finish(20) == 0 and "all workers finished; job done" in scheduler.output(), scheduler.output()
    assert server.finish(20) == 0, server.output()
