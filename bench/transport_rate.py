"""Small-message rate and round trip of Sluice's transport against the same protocol on zmq.asyncio."""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/transport_rate.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import uvloop
import zmq
import zmq.asyncio

from bench.common import add_common_options, print_table, progress, record, stats, write_json
from sluice.transport.config import TransportConfig
from sluice.transport.wire import Kind, Message, decode, encode
from sluice.transport.zmq_transport import ZmqTransport
from testbed.children import Children

DESCRIPTION = """\
Why the data path is a thread with a zmq Poller and not asyncio (docs/architecture.md). Two processes
exchange wire-format messages (msgpack header + payload, encoded and decoded by transport/wire.py
on both sides, so the per-message Python work is the same):

  stream     the sender queues MESSAGES messages of SIZE bytes; time until the receiver has them all
  pingpong   one message, one reply, ROUNDS times: the round trip a worker's wait sees

  sluice   transport/zmq_transport.py (an I/O thread, credit acknowledgements, priority queues)
  asyncio  zmq.asyncio DEALER -> ROUTER on uvloop, a coroutine per side
"""

LAST = 1 << 30  # the key of the message that ends a stream


def _payload(size: int) -> np.ndarray | None:
    return np.ones(size, np.uint8) if size else None


def _message(key: int, payload: np.ndarray | None) -> Message:
    if payload is None:
        return Message(Kind.PUSH, sender=1, key=key)
    return Message(Kind.PUSH, sender=1, key=key, dtype="uint8", shape=payload.shape, payload=payload)


# ---------------------------------------------------------------------------- sluice
def _sluice_receiver(endpoints: Any, stop: Any) -> int:
    transport: ZmqTransport

    def handler(peer: str, channel: int, msg: Message) -> None:
        if msg.key == LAST or msg.chunk == 1:  # end of a stream, or a ping: answer
            transport.send(peer, channel, Message(Kind.REPLY, key=msg.key))

    transport = ZmqTransport("receiver", TransportConfig(channels=1, shm=False, curve=False), handler)
    endpoints.put(transport.listen())
    stop.get(timeout=300)
    transport.close(0.5)
    return 0


def _sluice_sender(endpoints: Any, stop: Any, mode: str, count: int, size: int) -> float:
    replies = threading.Semaphore(0)
    config = TransportConfig(channels=1, shm=False, curve=False)
    transport = ZmqTransport("sender", config, lambda *_: replies.release())
    transport.connect("receiver", endpoints.get(timeout=30))
    payload = _payload(size)
    ping = _ping(payload)
    for _ in range(20):  # warm-up: connection up, code paths hot
        transport.send("receiver", 0, ping)
        replies.acquire(timeout=10)
    started = time.perf_counter()
    if mode == "stream":
        for key in range(count):
            transport.send("receiver", 0, _message(key, payload))
        transport.send("receiver", 0, _message(LAST, None))
        if not replies.acquire(timeout=120):
            raise TimeoutError("the receiver did not confirm the stream")
    else:
        for _ in range(count):
            transport.send("receiver", 0, ping)
            if not replies.acquire(timeout=10):
                raise TimeoutError("no reply to a ping")
    elapsed = time.perf_counter() - started
    transport.close(0.5)
    stop.put(True)
    # the child ends with os._exit, which would kill the queue's feeder thread before it wrote the message:
    # the receiver then waited for it until its 300 s ran out (seen once in ten quick runs)
    stop.close()
    stop.join_thread()
    return elapsed


# ---------------------------------------------------------------------------- zmq.asyncio
async def _asyncio_receive(endpoints: Any) -> None:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind("tcp://127.0.0.1:0")
    endpoints.put([sock.getsockopt_string(zmq.LAST_ENDPOINT)])
    while True:
        frames = await sock.recv_multipart(copy=False)
        msg = decode(frames[1:])
        if msg.key == LAST or msg.chunk == 1:
            await sock.send_multipart([frames[0], *encode(Message(Kind.REPLY, key=msg.key))])
        if msg.key == LAST and msg.chunk == 2:  # the sender says it is done
            break
    sock.close(linger=0)
    ctx.term()


def _asyncio_receiver(endpoints: Any, stop: Any) -> int:
    uvloop.run(_asyncio_receive(endpoints))
    return 0


async def _asyncio_send(endpoints: Any, mode: str, count: int, size: int) -> float:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoints.get(timeout=30)[0])
    payload = _payload(size)
    ping = encode(_ping(payload))
    for _ in range(20):
        await sock.send_multipart(ping, copy=False)
        await sock.recv_multipart()
    started = time.perf_counter()
    if mode == "stream":
        for key in range(count):
            await sock.send_multipart(encode(_message(key, payload)), copy=False)
        await sock.send_multipart(encode(_message(LAST, None)))
        decode(await asyncio.wait_for(sock.recv_multipart(copy=False), 120))
    else:
        for _ in range(count):
            await sock.send_multipart(ping, copy=False)
            decode(await asyncio.wait_for(sock.recv_multipart(copy=False), 10))
    elapsed = time.perf_counter() - started
    done = _message(LAST, None)
    done.chunk = 2
    await sock.send_multipart(encode(done))
    await sock.recv_multipart()
    sock.close(linger=1000)
    ctx.term()
    return elapsed


def _ping(payload: np.ndarray | None) -> Message:
    msg = _message(0, payload)
    msg.chunk = 1
    return msg


def _asyncio_sender(endpoints: Any, stop: Any, mode: str, count: int, size: int) -> float:
    return uvloop.run(_asyncio_send(endpoints, mode, count, size))


# ---------------------------------------------------------------------------- driver
SIDES = {"sluice": (_sluice_receiver, _sluice_sender), "asyncio": (_asyncio_receiver, _asyncio_sender)}


def measure(side: str, mode: str, count: int, size: int) -> float:
    """Messages (stream) or round trips (pingpong) per second, one run."""
    receiver, sender = SIDES[side]
    with Children() as children:
        endpoints, stop = children.queue(), children.queue()
        children.start("receiver", receiver, endpoints, stop)
        children.start("sender", sender, endpoints, stop, mode, count, size)
        elapsed = children.collect(["sender", "receiver"], timeout=300)["sender"]
    return count / float(elapsed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=4096, help="payload bytes per message (default: %(default)s)")
    parser.add_argument("--messages", type=int, default=50_000, help="messages per stream (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=5_000, help="round trips per pingpong (default: %(default)s)")
    add_common_options(parser, quick="3000 messages, 300 round trips, 1 repeat", repeats=3)
    args = parser.parse_args(argv)
    if args.quick:
        args.messages, args.rounds, args.repeats = 3000, 300, 1
    rows, records = [], []
    for mode, count, unit in (("stream", args.messages, "messages/s"), ("pingpong", args.rounds, "round trips/s")):
        runs: dict[str, list[float]] = {"sluice": [], "asyncio": []}
        for repeat in range(args.repeats):
            for side in runs:
                runs[side].append(measure(side, mode, count, args.size))
                progress(f"  {mode:8s} {side:8s} run {repeat + 1}: {runs[side][-1]:,.0f} {unit}")
        ours, peer = stats(runs["sluice"]), stats(runs["asyncio"])
        case = f"{mode}-{args.size}B"
        records.append(record(case, ours, peer, "zmq.asyncio on uvloop", unit))
        rows.append([case, f"{ours.median:,.0f}", f"{peer.median:,.0f}", unit, f"{ours.median / peer.median:.2f}x",
                     f"{1e6 / ours.median:.0f}", f"{1e6 / peer.median:.0f}"])
    print(f"\nmedians of {args.repeats} runs")
    print_table(["case", "sluice", "asyncio", "unit", "ratio", "sluice us", "asyncio us"], rows)
    write_json(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
