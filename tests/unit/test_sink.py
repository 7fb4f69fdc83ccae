"""The launcher's stdout: whole lines arrive intact through a non-blocking pipe that fills, and a reader that
goes away only stops the output."""

from __future__ import annotations

import os
import threading
import time

import pytest

from sluice.launch.children import Sink


@pytest.mark.timeout(30)
def test_a_full_non_blocking_pipe_is_waited_out_and_every_line_arrives_whole() -> None:
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)  # as ssh leaves a descriptor it shares
    sink = Sink(os.fdopen(write_end, "wb"), stall_s=10.0)
    lines = [b"[worker %d] CLUSTER_RESULT %s\n" % (i % 4, b"x" * (i % 3000)) for i in range(2000)]
    received = bytearray()

    def slow_reader() -> None:
        time.sleep(0.3)  # long enough for the pipe (64 KiB) to fill
        while chunk := os.read(read_end, 4096):
            received.extend(chunk)
            time.sleep(0.0005)

    reader = threading.Thread(target=slow_reader)
    reader.start()
    for start in range(0, len(lines), 50):
        sink.write(b"".join(lines[start:start + 50]))
    assert sink.stream is not None
    sink.stream.close()
    reader.join(20)
    os.close(read_end)
    assert bytes(received) == b"".join(lines)


@pytest.mark.timeout(10)
def test_a_reader_gone_stops_the_output_not_the_launcher() -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)
    sink = Sink(os.fdopen(write_end, "wb"))
    sink.write(b"[launch] a line nobody reads\n")  # EPIPE: Python ignores SIGPIPE
    assert sink.stream is None
    sink.write(b"[launch] and the next\n")
