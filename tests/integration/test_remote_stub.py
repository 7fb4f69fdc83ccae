"""The remote stub (`python -m sluice.launch.remote`, what ssh runs on each host): the role gets the job
secret through a pipe, never its command line or environment, and ends with the session; run here
through a pipe in place of ssh."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SECRET = bytes(range(32))
# the role: reads the secret as a role does, starts a grandchild, reports, then waits to be stopped
ROLE = """
import os, subprocess, sys, time
from sluice.scheduler.bootstrap import ENV_SECRET_FD, read_secret
secret = read_secret(int(os.environ[ENV_SECRET_FD]))
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(secret.hex(), os.environ["SLUICE_ROLE"], os.getpid(), grandchild.pid, flush=True)
time.sleep(120)
"""


def _stub() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "sluice.launch.remote"], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _header(argv: list[str], env: dict[str, str] | None = None, secret: bytes = SECRET, **extra: bool) -> bytes:
    fields = {"argv": argv, "env": env or {}, "cwd": str(ROOT), "secret": secret.hex(), **extra}
    return json.dumps(fields).encode() + b"\n"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}/stat").exists() else "X"
    return state not in ("Z", "X")


@pytest.mark.timeout(60)
def test_the_role_gets_the_secret_by_pipe_and_ends_with_the_session() -> None:
    stub = _stub()
    assert stub.stdin is not None and stub.stdout is not None
    stub.stdin.write(_header([sys.executable, "-c", ROLE], {"SLUICE_ROLE": "server"}))
    stub.stdin.flush()
    secret, role, pid, grandchild = stub.stdout.readline().decode().split()
    assert bytes.fromhex(secret) == SECRET and role == "server"
    for where in (f"/proc/{pid}/cmdline", f"/proc/{pid}/environ", f"/proc/{stub.pid}/cmdline"):
        text = Path(where).read_bytes()
        assert SECRET.hex().encode() not in text and SECRET not in text, where
    started = time.monotonic()
    stub.stdin.close()  # the session ends (the launcher is gone, or stopped the job)
    assert stub.wait(20) == 128 + 15  # the role was stopped with SIGTERM
    assert time.monotonic() - started < 10
    deadline = time.monotonic() + 5
    while (_alive(int(pid)) or _alive(int(grandchild))) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(int(pid)) and not _alive(int(grandchild))  # nothing of the role is left


@pytest.mark.timeout(60)
def test_the_stub_exits_with_the_roles_status() -> None:
    for code, program in ((3, "import sys; sys.exit(3)"), (128 + 9, "import os; os.kill(os.getpid(), 9)")):
        stub = _stub()
        assert stub.stdin is not None
        stub.stdin.write(_header([sys.executable, "-c", program]))
        stub.stdin.flush()  # the session stays open: the role ends by itself
        assert stub.wait(30) == code
        stub.stdin.close()


@pytest.mark.parametrize(("header", "error"), [
    (b"not json\n", "not JSON"),
    (b'{"argv": []}\n', "argv, env, cwd and secret"),
    (json.dumps({"argv": [], "env": {}, "cwd": "/", "secret": ""}).encode() + b"\n", "argv must be"),
    (json.dumps({"argv": ["x"], "env": {"A=B": "c"}, "cwd": "/", "secret": ""}).encode() + b"\n", "env must"),
    (json.dumps({"argv": ["x"], "env": {}, "cwd": "/", "secret": "zz"}).encode() + b"\n", "hex string"),
    (json.dumps({"argv": ["/no/such/program"], "env": {}, "cwd": "/", "secret": ""}).encode() + b"\n",
     "cannot start '/no/such/program'"),
])
def test_a_header_it_cannot_use_ends_it_saying_why(header: bytes, error: str) -> None:
    stub = _stub()
    _, err = stub.communicate(header, timeout=30)
    assert stub.returncode == 2 and error in err.decode(), err.decode()


@pytest.mark.timeout(60)
def test_a_signal_to_the_stub_stops_the_role_and_removes_its_shared_memory() -> None:
    """As SLURM cancelling a step does: SIGTERM to the stub with its session still open."""
    stub = _stub()
    assert stub.stdin is not None and stub.stdout is not None
    role = ("import os, time; open(f'/dev/shm/sluice-{os.getpid()}-0-0123abcd', 'wb').close(); "
            "print(os.getpid(), flush=True); time.sleep(120)")
    stub.stdin.write(_header([sys.executable, "-c", role]))
    stub.stdin.flush()
    segment = Path(f"/dev/shm/sluice-{int(stub.stdout.readline())}-0-0123abcd")
    try:
        started = time.monotonic()
        stub.send_signal(signal.SIGTERM)
        assert stub.wait(15) == 128 + 15
        assert time.monotonic() - started < 5.0, "the role died at once: the stub need not wait out its grace"
        assert not segment.exists(), "the role's shared memory outlived it"
    finally:
        if stub.poll() is None:
            stub.kill()
        stub.stdin.close()
        segment.unlink(missing_ok=True)


#: a role that prints far more than a pipe holds, then leaves a mark and ends by itself
CHATTY = """
import os, sys
print(os.getpid(), flush=True)
for _ in range(400):
    print("x" * 1023, flush=True)
open(sys.argv[1], "w").close()
"""


@pytest.mark.timeout(60)
def test_failover_an_outliving_role_runs_on_when_its_session_ends_unread(tmp_path: Path) -> None:
    """With a standby scheduler the roles outlive the launcher's host: its session ends (or nobody reads it
    any more) and the role neither stops nor waits on its output; it ends by itself and so does the stub."""
    stub = _stub()
    assert stub.stdin is not None and stub.stdout is not None
    mark = tmp_path / "done"
    stub.stdin.write(_header([sys.executable, "-c", CHATTY, str(mark)], outlive=True))
    stub.stdin.flush()
    pid = int(stub.stdout.readline())
    stub.stdin.close()  # the session ends, and from now on nobody reads the stub's output: 400 KiB wait there
    assert stub.wait(20) == 0  # the role ended by itself (the relay gave up on the unread rest after its grace)
    assert mark.exists() and not _alive(pid)


@pytest.mark.timeout(60)
def test_failover_an_outliving_role_stops_on_the_word_stop() -> None:
    stub = _stub()
    assert stub.stdin is not None and stub.stdout is not None
    stub.stdin.write(_header([sys.executable, "-c", ROLE], {"SLUICE_ROLE": "server"}, outlive=True))
    stub.stdin.flush()
    _, _, pid, grandchild = stub.stdout.readline().decode().split()
    stub.stdin.write(b"STOP\n")
    stub.stdin.flush()
    assert stub.wait(20) == 128 + 15
    stub.stdin.close()
    deadline = time.monotonic() + 5
    while (_alive(int(pid)) or _alive(int(grandchild))) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(int(pid)) and not _alive(int(grandchild))
