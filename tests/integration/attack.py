"""Training while worker 0 attacks every server with malformed and forged messages (see test_hostile.py).

Two attack paths, both on a thread that runs one round before the broadcast and one during each step:
- raw ZeroMQ DEALERs with random identities, one per server endpoint, sending wire-level garbage (bad
  shared-memory descriptors included) and well-formed messages that no worker of the job sent
  (forged sender ids, control kinds);
- worker 0's own connection to each server, sending well-formed messages the server must refuse:
  an unknown key, a push for a round that is not the next one, a payload of the wrong dtype, a kind
  a server does not take. None of them may change a parameter.
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from typing import Any

import msgpack
import numpy as np
import zmq

from tests.integration.training import train_distributed
from transport.shm import Segment
from transport.wire import VERSION, Flag, Kind, Message, encode

_FIELDS = (
    "version", "kind", "sender", "key", "chunk", "round", "priority", "dtype", "shape", "nbytes", "flags", "meta",
)


def _header(**fields: Any) -> bytes:
    values: dict[str, Any] = {
        "version": VERSION, "kind": int(Kind.PUSH), "sender": 0, "key": 0, "chunk": 0, "round": 1,
        "priority": 0, "dtype": "float32", "shape": [4], "nbytes": 16, "flags": 0, "meta": None,
    }
    values.update(fields)
    return bytes(msgpack.packb([values[name] for name in _FIELDS]))


def raw_attacks(
    rng: random.Random, key: int, chunk: int, length: int, worker_id: int, segment: str
) -> dict[str, list[bytes]]:
    """Frames a stranger sends, by name. `key`/`chunk` are real, of `length` floats; `segment` names a
    real shared-memory segment of 4096 bytes."""
    valid = _header()
    shm = int(Flag.SHM)
    real = np.arange(length, dtype=np.float32).tobytes()

    def data_header(**fields: Any) -> bytes:
        return _header(key=key, chunk=chunk, shape=[length], nbytes=4 * length, **fields)

    return {
        "wrong version": [_header(version=VERSION + 1), bytes(16)],
        "version 0": [_header(version=0), bytes(16)],
        "truncated header": [valid[: len(valid) // 2], bytes(16)],
        "truncated to one byte": [valid[:1]],
        "random bytes": [rng.randbytes(rng.randint(1, 64))],
        "random frames": [rng.randbytes(rng.randint(1, 32)), rng.randbytes(rng.randint(1, 4096))],
        "random 64 KiB": [rng.randbytes(1 << 16)],
        "empty frame": [b""],
        "declared bytes above the frame": [_header(nbytes=20, shape=[5]), bytes(16)],
        "frame above the declared bytes": [_header(), bytes(17)],
        "shape against bytes": [_header(shape=[3]), bytes(16)],
        "unknown dtype": [_header(dtype="complex64", shape=[2]), bytes(16)],
        "huge declared length": [_header(nbytes=1 << 40, shape=[1 << 38]), bytes(16)],
        "huge header array": [b"\xdd\xff\xff\xff\xff"],
        "three frames": [valid, bytes(16), bytes(16)],
        "dtype without payload": [valid],
        "payload without dtype": [_header(dtype="", shape=[], nbytes=0), bytes(16)],
        "unknown kind": [_header(kind=77), bytes(16)],
        "negative key": [_header(key=-1), bytes(16)],
        "meta not a map": [_header(meta=[1, 2, 3]), bytes(16)],
        "shm descriptor not msgpack": [_header(flags=shm), b"\xc1"],
        "shm path traversal": [_header(flags=shm), bytes(msgpack.packb(["../../../etc/passwd", 0]))],
        "shm unknown segment": [_header(flags=shm), bytes(msgpack.packb(["sluice-1-0-00000000", 0]))],
        "shm outside a segment": [_header(flags=shm), bytes(msgpack.packb([segment, 4090]))],
        # well-formed on the wire, but no worker of this job sent them
        "unknown key from a stranger": [_header(key=1 << 20, sender=worker_id), bytes(16)],
        "push from a non-worker id": [data_header(sender=999), real],
        "push forging worker 0's id": [data_header(sender=worker_id), real],
        "pull from a stranger": [_header(kind=int(Kind.PULL), key=key, chunk=chunk, dtype="", shape=[], nbytes=0)],
        "broadcast from a stranger": [data_header(kind=int(Kind.BCAST_PUSH), round=1 << 40, sender=worker_id), real],
        "shutdown from a stranger": [encode(Message(Kind.SHUTDOWN, sender=0))[0]],
        "error from a stranger": [encode(Message(Kind.ERROR, sender=0, meta={"error": "forged"}))[0]],
        "calibration probe from a stranger": [_header(kind=int(Kind.PROBE), sender=worker_id, dtype="", shape=[],
                                                      nbytes=0)],
    }


def own_connection_attacks(key: int, chunk: int, length: int, sender: int, forge_opt: bool) -> dict[str, Message]:
    """Well-formed messages from worker 0's real connection that a server must refuse without effect.

    With `forge_opt`, the pushes the server must refuse also carry optimizer settings (a huge rate)."""
    floats = np.ones(length, np.float32)
    doubles = np.ones(length, np.float64)
    meta = {"opt": {"name": "sgd", "lr": 1000.0}} if forge_opt else None
    return {
        "unknown key": Message(Kind.PUSH, sender=sender, key=1 << 20, chunk=0, round=1, dtype="float32",
                               shape=(length,), payload=floats),
        "unknown chunk": Message(Kind.PULL, sender=sender, key=key, chunk=1 << 20, round=1),
        "wrong round": Message(Kind.PUSH, sender=sender, key=key, chunk=chunk, round=1 << 40, dtype="float32",
                               shape=(length,), meta=meta, payload=floats),
        "wrong dtype": Message(Kind.PUSH, sender=sender, key=key, chunk=chunk, round=1, dtype="float64",
                               shape=(length,), payload=doubles),
        "wrong shape": Message(Kind.PUSH, sender=sender, key=key, chunk=chunk, round=1, dtype="float32",
                               shape=(length - 1,), payload=floats[:-1]),
        "kind a server does not take": Message(Kind.REPLY, sender=sender, key=key, chunk=chunk, round=1),
    }


class Attacker(threading.Thread):
    """Sends every attack to every server endpoint once per `attack()` call, on its own thread, so each
    round overlaps the training step that asked for it; `finish()` waits for the rounds asked for."""

    def __init__(self, client: Any, forge_opt: bool = False, seed: int = 0) -> None:
        super().__init__(name="attacker", daemon=True)
        self.client, self.forge_opt, self.rng = client, forge_opt, random.Random(seed)
        self._asked = threading.Semaphore(0)
        self._finishing = threading.Event()
        self.sent: Counter[str] = Counter()
        self.rounds = 0
        self.error: BaseException | None = None

    def attack(self) -> None:
        self._asked.release()

    def finish(self, timeout: float = 30.0) -> None:
        self._finishing.set()
        self._asked.release()
        self.join(timeout)
        if self.is_alive():
            raise RuntimeError("the attacker did not finish")
        if self.error is not None:
            raise RuntimeError(f"the attacker failed: {self.error!r}") from self.error

    def run(self) -> None:
        ctx = zmq.Context()
        sockets: list[zmq.Socket[bytes]] = []
        segment = Segment(4096)
        try:
            servers = sorted((p for p in self.client.control.peers if p.role == "server"), key=lambda p: p.rank)
            assert servers, "the address book lists no server"
            for server in servers:
                for endpoint in server.endpoints:
                    sock = ctx.socket(zmq.DEALER)
                    sock.setsockopt(zmq.IDENTITY, f"stranger-{self.rng.getrandbits(48):012x}".encode())
                    sock.setsockopt(zmq.LINGER, 2000)
                    sock.setsockopt(zmq.SNDHWM, 0)
                    sock.connect(endpoint)
                    sockets.append(sock)
            tensor = min(self.client._tensors.values(), key=lambda t: t.key)  # a real key, its first chunk
            chunk, _offset, length, _server = tensor.chunks[0]
            node_id = self.client.control.node_id
            while True:
                self._asked.acquire()
                if self._finishing.is_set():
                    break
                for sock in sockets:
                    for name, frames in raw_attacks(self.rng, tensor.key, chunk, length, node_id, segment.name).items():
                        sock.send_multipart(frames, copy=True)
                        self.sent[name] += 1
                for name, msg in own_connection_attacks(tensor.key, chunk, length, node_id, self.forge_opt).items():
                    for server in servers:
                        self.client.transport.send(server.name, tensor.channel, msg)
                        self.sent[name] += 1
                self.rounds += 1
        except BaseException as exc:  # reported to the test through the worker's result
            self.error = exc
        finally:
            for sock in sockets:
                sock.close()
            ctx.term()
            segment.close()


class _AttackEveryStep:
    """StepHooks for train_distributed: attack before the broadcast and before every step."""

    def __init__(self, attacker: Attacker) -> None:
        self.attacker = attacker
        attacker.start()

    def before_broadcast(self) -> None:
        self.attacker.attack()

    def before_step(self) -> None:
        self.attacker.attack()

    def finish(self) -> Any:
        self.attacker.finish()
        return {"rounds": self.attacker.rounds, "sent": dict(self.attacker.sent)}


def train_under_attack(steps: int, batch: int, optimizer: str, forge_opt: bool = False) -> dict[str, Any]:
    """train_distributed, with worker 0 attacking the servers before the broadcast and at every step
    (the other worker trains as usual); the attack's report is under "attack"."""
    import worker.torch_shim as hvd

    def hooks() -> _AttackEveryStep | None:
        return _AttackEveryStep(Attacker(hvd._require(), forge_opt)) if hvd.rank() == 0 else None

    result = train_distributed(steps, batch, optimizer, hooks)
    result["attack"] = result.pop("extra")
    return result
