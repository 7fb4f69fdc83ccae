"""`sluice node` processes as the tests start them: one per index, as the pods of a Kubernetes job, on 127.0.0.1."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class Node:
    """One `sluice node` process; its output is collected by a thread, so reads have deadlines."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sluice.launch.node", *args], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def finish(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout} s; output:\n{self.output()}") from None
        self._reader.join(5)
        return code

    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, text: str, timeout: float) -> None:
        """Until `text` is in the output (AssertionError, with the output, at `timeout`)."""
        deadline = time.monotonic() + timeout
        while text not in self.output():
            if time.monotonic() > deadline:
                raise AssertionError(f"no {text!r} within {timeout} s; output:\n{self.output()[-4000:]}")
            time.sleep(0.05)

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: the role and whatever it started
        self.proc.wait(5)


def env_without_sluice(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_") and k != "JOB_COMPLETION_INDEX"}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def secret_file(path: Path, mode: int = 0o600, text: str | None = None) -> Path:
    path.write_text(text if text is not None else os.urandom(32).hex() + "\n")
    path.chmod(mode)
    return path


def start_node(nodes: list[Node], index: int | None, args: list[str], env: dict[str, str] | None = None) -> Node:
    node = Node([*([] if index is None else ["--index", str(index)]), *args],
                env if env is not None else env_without_sluice())
    nodes.append(node)
    return node
