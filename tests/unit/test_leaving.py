"""What a worker's goodbye says of why its process ends: the line made of an exception, the check on receipt, and
the exception sys.excepthook saw in a process that raised (a real interpreter exiting)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sluice.scheduler.leaving import MAX_ERROR, left, one_line, parse_error
from sluice.transport.wire import WireError


@pytest.mark.parametrize(("kind", "text", "want"), [
    ("RuntimeError", "boom", "RuntimeError: boom"),
    ("KeyboardInterrupt", "", "KeyboardInterrupt"),
    ("ValueError", "two\nlines\n\n", "ValueError: two / lines"),
    ("OSError", "a\tbell\a", "OSError: a?bell?"),
    ("E", "x" * 500, "E: " + "x" * (MAX_ERROR - 3)),
])
def test_an_exception_becomes_one_printable_line_of_bounded_length(kind: str, text: str, want: str) -> None:
    assert one_line(kind, text) == want


@pytest.mark.parametrize(("meta", "want"), [(None, ""), ({}, ""), ({"rank": 1}, ""), ({"error": "E: x"}, "E: x"),
                                            ({"error": "E:\x1b[2J"}, "E:?[2J")])
def test_a_goodbye_s_error_is_read_with_control_characters_masked(meta: dict[str, object] | None, want: str) -> None:
    assert parse_error(meta) == want


@pytest.mark.parametrize("bad", [3, b"bytes", ["list"], "x" * (MAX_ERROR + 1)])
def test_a_goodbye_s_malformed_error_is_refused(bad: object) -> None:
    with pytest.raises(WireError):
        parse_error({"error": bad})


def test_who_left_says_the_error_when_there_is_one() -> None:
    assert left("worker 3", "") == "worker 3 has left the job"
    assert left("worker 3", "E: x") == "worker 3 has left the job with an error (E: x)"


@pytest.mark.timeout(30)
def test_the_exception_ending_a_process_is_seen_by_its_exit_handlers_and_its_traceback_still_printed() -> None:
    script = ("import atexit\nfrom sluice.scheduler.leaving import note_uncaught, uncaught\nnote_uncaught()\n"
              "note_uncaught()\natexit.register(lambda: print('AT EXIT', repr(uncaught())))\n"
              "raise ValueError('bad\\nbatch')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=20)
    assert done.returncode == 1
    assert "AT EXIT 'ValueError: bad / batch'" in done.stdout
    assert "Traceback (most recent call last)" in done.stderr and "ValueError: bad" in done.stderr
    clean = subprocess.run([sys.executable, "-c", script.replace("raise ValueError('bad\\nbatch')", "")],
                           capture_output=True, text=True, timeout=20)
    assert clean.returncode == 0 and "AT EXIT ''" in clean.stdout
