"""Training while worker 0 attacks every server with malformed and forged messages (see test_hostile.py).

Three attack paths, on a thread that runs one round before the broadcast and one during each step:
- raw ZeroMQ DEALERs, one per server endpoint, sending wire-level garbage (deep nesting, a 31 MiB
  header, a frame over the job's chunk size, bad shared-memory descriptors and announcements of
  directories, FIFOs, symlinks and names with a newline) and well-formed messages that no worker of
  the job sent (forged sender ids, control kinds). With CURVE off (transport.curve = false) they
  are strangers with random identities. With CURVE on, strangers cannot even connect (they are
  counted as refused), so the garbage comes from a compromised member instead: a socket that holds
  the job secret and connects to each server with another server's key and name;
- worker 0's own connection to each server, sending well-formed messages the server must refuse:
  an unknown key, a push for a round that is not the next one, a payload of the wrong dtype, a kind
  a server does not take. None of them may change a parameter.
"""

from __future__ import annotations

import os
import random
import secrets
import threading
import time
from collections import Counter
from typing import Any

import msgpack
import numpy as np
import zmq

from sluice.scheduler.bootstrap import member_names, node_name
from sluice.transport import local_endpoints
from sluice.transport.auth import JobKeys
from sluice.transport.seal import MAX_FRAMES
from sluice.transport.shm import SHM_DIR, Segment
from sluice.transport.wire import VERSION, Flag, Kind, Message, encode
from sluice.transport.zmq_seal import Seals
from tests.integration.stranger_helpers import _ticketed
from tests.integration.training import train_distributed

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


def _nested_header(depth: int, field: int) -> bytes:
    """A 12-field header whose field number `field` is a list nested `depth` deep (about depth bytes)."""
    fields = [bytes(msgpack.packb(v)) for v in (VERSION, int(Kind.PUSH), 0, 0, 0, 1, 0, "", [], 0, 0, None)]
    fields[field] = b"\x91" * depth + b"\xc0"
    return b"\x9c" + b"".join(fields)


def _announce(name: str, size: int) -> list[bytes]:
    return encode(Message(Kind.SHM_OPEN, meta={"segment": name, "size": size}))


class HostileFiles:
    """Entries in /dev/shm named like segments that are not: a directory, a FIFO, a symlink to a real
    segment; removed by close()."""

    def __init__(self, real: Segment) -> None:
        base = f"sluice-{os.getpid()}-{9000 + random.randrange(1000)}-"
        self.directory, self.fifo, self.link = (base + secrets.token_hex(4) for _ in range(3))
        os.mkdir(os.path.join(SHM_DIR, self.directory))
        os.mkfifo(os.path.join(SHM_DIR, self.fifo))
        os.symlink(real.path, os.path.join(SHM_DIR, self.link))

    def close(self) -> None:
        os.rmdir(os.path.join(SHM_DIR, self.directory))
        for name in (self.fifo, self.link):
            os.unlink(os.path.join(SHM_DIR, name))


def big_attacks(largest_frame: int) -> dict[str, list[bytes]]:
    """Sent once per endpoint: a 31 MiB header, and a frame twice the job's largest (each makes ZeroMQ
    drop the connection before the frame is held; the attacker's socket reconnects by itself)."""
    return {"31 MiB header": [b"\xdc\xff\xff" + bytes(31 << 20)],
            "frame over the chunk size": [_header(shape=[largest_frame // 2], nbytes=2 * largest_frame),
                                          bytes(2 * largest_frame)]}


def raw_attacks(
    rng: random.Random, key: int, chunk: int, length: int, worker_id: int, segment: Segment, files: HostileFiles
) -> dict[str, list[bytes]]:
    """Frames a stranger sends, by name. `key`/`chunk` are real, of `length` floats; `segment` is a
    real shared-memory segment of 4096 bytes; `files` the hostile /dev/shm entries."""
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
        "oversized header": [_header(meta={"pad": "x" * (80 << 10)}), bytes(16)],
        "three frames": [valid, bytes(16), bytes(16)],
        "dtype without payload": [valid],
        "payload without dtype": [_header(dtype="", shape=[], nbytes=0), bytes(16)],
        "unknown kind": [_header(kind=77), bytes(16)],
        "negative key": [_header(key=-1), bytes(16)],
        "meta not a map": [_header(meta=[1, 2, 3]), bytes(16)],
        "list nested 1,000 deep": [_nested_header(1000, 2)],
        "meta nested 1,000 deep": [_nested_header(1000, 11)],
        "list nested 100,000 deep": [_nested_header(100_000, 3)],
        "shm descriptor not msgpack": [_header(flags=shm), b"\xc1"],
        "shm path traversal": [_header(flags=shm), bytes(msgpack.packb(["../../../etc/passwd", 0]))],
        "shm unknown segment": [_header(flags=shm), bytes(msgpack.packb(["sluice-1-0-00000000", 0]))],
        "shm segment not announced": [_header(flags=shm), bytes(msgpack.packb([segment.name, 0]))],
        "shm announce of a directory": _announce(files.directory, 4096),
        "shm announce of a FIFO": _announce(files.fifo, 4096),
        "shm announce of a symlink": _announce(files.link, 4096),
        "shm announce of a name with a newline": _announce(segment.name + "\n", 4096),
        "shm announce with the wrong size": _announce(segment.name, 8192),
        "shm announce of a real segment": _announce(segment.name, 4096),
        "shm outside a segment": [_header(flags=shm), bytes(msgpack.packb([segment.name, 4090]))],
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


def _strangers(ctx: zmq.Context[zmq.Socket[bytes]], keys: JobKeys, names: list[str], server: str,
               endpoint: str, channel: int, sealed: bool) -> list[zmq.Socket[bytes]]:
    """Dealers that must be refused at the door, calling themselves worker 0: on the network one guesses the
    keys and one knows the server's public key (leaked, say), or at a sealed listener one shows a ticket made
    with another secret and one shows worker 0's ticket from another address (read off the network); on a
    Unix socket one shows a ticket made with another secret and one shows none."""
    guessed = JobKeys(secrets.token_bytes(32), names)
    worker = node_name("worker", 0)
    made = []
    for attempt in range(2):
        if sealed and not endpoint.startswith(local_endpoints.PREFIX):
            made.append(_ticketed(ctx, endpoint, worker, (guessed, keys)[attempt], worker, server, channel,
                                  shown_from=(None, "127.0.0.2")[attempt]))
            continue
        stranger = ctx.socket(zmq.DEALER)
        stranger.setsockopt(zmq.LINGER, 0)
        stranger.setsockopt(zmq.IDENTITY, worker.encode())
        if endpoint.startswith(local_endpoints.PREFIX) and attempt == 0:
            guessed.secure_dialer(stranger, worker, server, endpoint)
        elif not endpoint.startswith(local_endpoints.PREFIX):
            stranger.setsockopt(zmq.CURVE_SERVERKEY, (guessed, keys)[attempt].public_key(server))
            public, secret = zmq.curve_keypair()
            stranger.setsockopt(zmq.CURVE_PUBLICKEY, public)
            stranger.setsockopt(zmq.CURVE_SECRETKEY, secret)
        stranger.connect(endpoint)
        made.append(stranger)
    return made


def _channels(endpoints: list[str]) -> dict[str, int]:
    """The channel of each endpoint a node published (its network ones in channel order, then its local ones)."""
    network, local = local_endpoints.split(endpoints)
    return {**{e: c for c, e in enumerate(network)}, **{e: c for c, e in enumerate(local)}}


class Attacker(threading.Thread):
    """Sends every attack to every server endpoint once per `attack()` call, on its own thread, so each
    round overlaps the training step that asked for it; `finish()` waits for the rounds asked for."""

    def __init__(self, node: Any, forge_opt: bool = False, seed: int = 0) -> None:
        super().__init__(name="attacker", daemon=True)
        self.node, self.forge_opt, self.rng = node, forge_opt, random.Random(seed)
        self._asked = threading.Semaphore(0)
        self._finishing = threading.Event()
        self.sent: Counter[str] = Counter()
        self.strangers: list[zmq.Socket[bytes]] = []
        self.stranger_blocked = 0
        self.rounds = 0
        self.asked = 0
        self.error: BaseException | None = None
        #: the attacker's sockets at sealed listeners: what seals their messages, to which server, channel
        self._seals: dict[zmq.Socket[bytes], tuple[Seals, str, int]] = {}

    def attack(self) -> None:
        self.asked += 1
        self._asked.release()

    def finish(self, timeout: float = 30.0) -> None:
        self._finishing.set()
        self._asked.release()
        self.join(timeout)
        if self.is_alive():
            raise RuntimeError("the attacker did not finish")
        if self.error is not None:
            raise RuntimeError(f"the attacker failed: {self.error!r}") from self.error

    def _sockets(self, ctx: zmq.Context[zmq.Socket[bytes]], servers: list[Any],
                 big: bool = False) -> list[zmq.Socket[bytes]]:
        """One DEALER per server endpoint and one to the scheduler: strangers with CURVE off; with it on,
        a compromised member (another server's key and name, or for the `big` attacks the scheduler's),
        plus strangers that must be refused at the door."""
        env = self.node.env
        keys = env.job_keys()
        names = member_names(env.workers, env.servers)
        sealed = keys is not None and self.node.transport.config.cipher == "aes-gcm"
        sockets = []
        for server in servers:
            channels = _channels(server.endpoints)
            for endpoint in server.endpoints:
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, 0)
                if keys is None:
                    sock.setsockopt(zmq.IDENTITY, f"stranger-{self.rng.getrandbits(48):012x}".encode())
                    sock.connect(endpoint)
                else:
                    member = "scheduler" if big else node_name("server", (server.rank + 1) % env.servers)
                    self._dial_as(sock, keys, member, server.name, endpoint, channels[endpoint], sealed)
                    if not big:
                        self.strangers.extend(_strangers(ctx, keys, names, server.name, endpoint,
                                                         channels[endpoint], sealed))
                sockets.append(sock)
        if not big:  # the scheduler too; with CURVE under its own name, the one member that never dials it
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            if keys is None:
                sock.setsockopt(zmq.IDENTITY, f"stranger-{self.rng.getrandbits(48):012x}".encode())
            else:
                sock.setsockopt(zmq.IDENTITY, b"scheduler")
                keys.secure_client(sock, "scheduler", "scheduler")
            sock.connect(env.scheduler)
            sockets.append(sock)
        return sockets

    def _dial_as(self, sock: zmq.Socket[bytes], keys: JobKeys, member: str, server: str, endpoint: str,
                 channel: int, sealed: bool) -> None:
        """Connect `sock` as `member` (whose keys it holds): with its ticket or key, its messages sealed where the
        listener seals (so that the garbage reaches the server's decoder)."""
        sock.setsockopt(zmq.IDENTITY, member.encode())
        if sealed and not endpoint.startswith(local_endpoints.PREFIX):
            seals = Seals(member, keys)
            sock.connect(seals.dial(sock, server, channel, endpoint))
            self._seals[sock] = (seals, server, channel)
        else:
            keys.secure_dialer(sock, member, server, endpoint)
            sock.connect(endpoint)

    def _send(self, sock: zmq.Socket[bytes], frames: list[bytes]) -> None:
        """Send `frames` on `sock`, sealed where its listener seals and a message of that many frames can be (the
        server refuses the others unopened)."""
        sealing = self._seals.get(sock)
        if sealing is not None and len(frames) <= MAX_FRAMES:
            sock.send_multipart(sealing[0].seal(frames, sock, *sealing[1:]), copy=False)
        else:
            sock.send_multipart(frames, copy=False)

    def run(self) -> None:
        ctx = zmq.Context()
        sockets: list[zmq.Socket[bytes]] = []
        segment = Segment(4096)
        files = HostileFiles(segment)
        try:
            servers = sorted((p for p in self.node.control.peers if p.role == "server"), key=lambda p: p.rank)
            assert servers, "the address book lists no server"
            sockets = self._sockets(ctx, servers)
            deadline = time.monotonic() + 30  # fused gradients are declared at the first backward pass
            while not self.node.ps._tensors and time.monotonic() < deadline:
                time.sleep(0.01)
            tensor = min(self.node.ps._tensors.values(), key=lambda t: t.key)  # a real key, its first chunk
            chunk, _offset, length, _server = tensor.chunks[0]
            node_id = self.node.control.node_id
            big = big_attacks(self.node.settings.largest_payload)
            while True:
                self._asked.acquire()
                if self._finishing.is_set() and self.rounds >= self.asked:  # every round asked for is done
                    break
                attacks = raw_attacks(self.rng, tensor.key, chunk, length, node_id, segment, files)
                for sock in sockets:
                    for name, frames in attacks.items():
                        self._send(sock, frames)
                        self.sent[name] += 1
                if self.rounds == 0:  # on sockets of their own: ZeroMQ drops the connection that sends them
                    for sock in self._sockets(ctx, servers, big=True):
                        sockets.append(sock)
                        for name, frames in big.items():
                            self._send(sock, frames)
                            self.sent[name] += 1
                for stranger in self.strangers:  # never connected: nothing of this gets through
                    for frames in attacks.values():
                        try:
                            stranger.send_multipart(frames, zmq.NOBLOCK, copy=True)
                        except zmq.Again:
                            self.stranger_blocked += 1
                for name, msg in own_connection_attacks(tensor.key, chunk, length, node_id, self.forge_opt).items():
                    for server in servers:
                        self.node.transport.send(server.name, tensor.channel, msg)
                        self.sent[name] += 1
                self.rounds += 1
        except BaseException as exc:  # reported to the test through the worker's result
            self.error = exc
        finally:
            for sock in [*sockets, *self.strangers]:
                sock.close()
            ctx.term()
            segment.unlink()
            files.close()


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
        return {"rounds": self.attacker.rounds, "sent": dict(self.attacker.sent),
                "strangers": len(self.attacker.strangers), "stranger_blocked": self.attacker.stranger_blocked}


def train_under_attack(steps: int, batch: int, optimizer: str, forge_opt: bool = False) -> dict[str, Any]:
    """train_distributed, with worker 0 attacking the servers before the broadcast and at every step
    (the other worker trains as usual); the attack's report is under "attack"."""
    import sluice.torch as hvd
    from sluice.worker.torch.state import require

    def hooks() -> _AttackEveryStep | None:
        return _AttackEveryStep(Attacker(require(), forge_opt)) if hvd.rank() == 0 else None

    result = train_distributed(steps, batch, optimizer, hooks)
    result["attack"] = result.pop("extra")
    return result
