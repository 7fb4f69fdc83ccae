"""A process's transport still sends at exit: what an atexit handler sends (a stage's last gradients, its
closing word) leaves, whatever order the atexit handlers were registered in."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "scripts" / "send_at_exit.py"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("order", ["late", "early"])
def test_a_large_message_sent_from_an_atexit_handler_is_delivered(order: str) -> None:
    """pyzmq's zero-copy sends need its garbage-collector thread, which its own atexit handler stops; a
    handler registered before pyzmq's (hvd.init registers its close before the first zero-copy send)
    runs after it. Before the fix the I/O thread died with `zmq gc socket requested during shutdown`,
    and with it the heartbeats: a pipeline stage on a slow link was declared lost at the job's end."""
    done = subprocess.run([sys.executable, str(SCRIPT), order], capture_output=True, text=True, timeout=50)
    output = done.stdout + done.stderr
    assert done.returncode == 0 and "DELIVERED" in done.stdout, output[-3000:]
    assert "I/O thread failed" not in output, output[-3000:]
