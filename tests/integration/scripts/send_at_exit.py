"""Sends a large (zero-copy) message from an atexit handler registered before the process's first such send,
as `hvd.init()` registers its close (argument `early`: before Sluice's transport is even imported):
prints DELIVERED when the peer got it, FAILED otherwise."""

from __future__ import annotations

import atexit
import sys
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

made: dict[str, Any] = {}
got = threading.Semaphore(0)


def at_exit() -> None:
    made["client"].send("server-x", 0, made["big"](2))
    print("DELIVERED" if got.acquire(timeout=10) else "FAILED", flush=True)
    made["client"].close()
    made["server"].close()


if sys.argv[1:] == ["early"]:
    atexit.register(at_exit)

import numpy as np  # noqa: E402

from sluice.transport.config import TransportConfig  # noqa: E402
from sluice.transport.wire import Kind, Message  # noqa: E402
from sluice.transport.zmq_transport import ZmqTransport  # noqa: E402

CONFIG = TransportConfig(channels=1, inflight_bytes=8 << 20, chunk_bytes=1 << 20, curve=False, shm=False)
PAYLOAD = np.ones(1 << 19, np.uint8)  # far above pyzmq's copy threshold: sent without a copy


def received(peer: str, channel: int, msg: Message) -> None:
    if msg.payload is not None and msg.payload.nbytes == PAYLOAD.nbytes:
        got.release()


def big(key: int) -> Message:
    return Message(Kind.PUSH, sender=1, key=key, dtype="uint8", shape=PAYLOAD.shape, payload=PAYLOAD)


made.update(server=ZmqTransport("server-x", CONFIG, received, None), big=big,
            client=ZmqTransport("client-x", CONFIG, lambda *_: None, None))
if sys.argv[1:] != ["early"]:
    atexit.register(at_exit)  # before the first zero-copy send, as hvd.init() registers its close
made["client"].connect("server-x", made["server"].listen())
made["client"].send("server-x", 0, big(1))
if not got.acquire(timeout=10):
    raise SystemExit("the first message did not arrive")
