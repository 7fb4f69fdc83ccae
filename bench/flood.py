"""Training speed while a separate process floods every server and the scheduler with rejected messages."""

from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing as mp
import queue
import random
import re
import secrets
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/flood.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgpack
import torch
import zmq

from bench.common import Children, Stats, add_common_options, print_table, progress, record, stats, write_json
from bench.train_throughput import demo, timed_repeats, worker_batches
from scheduler.bootstrap import member_names, node_name
from tests.cluster import LocalCluster
from transport.auth import JobKeys
from transport.wire import VERSION, Kind

_ctx = mp.get_context("fork")

CLEAN_ON, CLEAN_OFF = "clean", "clean-curve-off"
STRANGERS, MEMBER, CURVE_OFF, CURVE_OFF_BANNED, SPIN = "strangers", "member", "curve-off", "curve-off-banned", "busy-loop"
MODES = (STRANGERS, MEMBER, CURVE_OFF, CURVE_OFF_BANNED, SPIN)
#: the clean run each mode is compared with (the same transport.curve)
BASELINE = {STRANGERS: CLEAN_ON, MEMBER: CLEAN_ON, SPIN: CLEAN_ON, CURVE_OFF: CLEAN_OFF, CURVE_OFF_BANNED: CLEAN_OFF}
PEER_NAME = {CLEAN_ON: "sluice, the same job without a flood (transport.curve = true)",
             CLEAN_OFF: "sluice, the same job without a flood (transport.curve = false)"}
LABELS = {
    STRANGERS: "CURVE on, strangers without the secret: connection attempts and garbage, nothing gets in",
    MEMBER: "CURVE on, a compromised member (the job secret, another server's key and name) sends garbage",
    CURVE_OFF: "CURVE off, strangers with random identities send garbage, rotating identities before a ban",
    CURVE_OFF_BANNED: "CURVE off, strangers that keep their identities: banned after 100 refusals, and cut",
    SPIN: "control: a process that only spins one core (no messages), to separate CPU contention",
}
TARGET_RATIO = 0.5
_STOPPED = re.compile(r"server (\d+) stopped \((\d+) messages rejected, (\d+) connections refused\)")
_BANNED = "messages and little else: its messages are dropped from now on"

DESCRIPTION = f"""\
Global training throughput (steps x batch x workers / seconds) of bench/train_throughput.py's digits
model (W workers, S servers, optimizer on the workers, LocalCluster: forked roles on 127.0.0.1) clean
and while one separate process floods every server endpoint (each channel) and the scheduler with
malformed messages as fast as the servers take them (it waits for room when ZeroMQ's queues are
full, rather than spinning). Modes (--modes):

  {STRANGERS:<10} {LABELS[STRANGERS]}. Per endpoint, SOCKETS
             DEALERs with fresh random CURVE keys (half know the server's public key, half guess it),
             reconnecting every millisecond and recreated every RECYCLE_MS; the servers count every
             refused handshake ("connections refused")
  {MEMBER:<10} {LABELS[MEMBER]}: the flooder
             derives the keys from the job secret (as a stolen secret would let it) and connects to
             server r as server r+1 (to the scheduler as the scheduler), so every message reaches the
             decoder and is rejected there; a member is never banned
  {CURVE_OFF:<10} {LABELS[CURVE_OFF]}: SOCKETS
             DEALERs per endpoint, each replaced by one with a new identity after ROTATE messages
             (a stranger is banned after 100 refused messages), so the flood never stops at a ban
  {SPIN:<10} {LABELS[SPIN]}

Every repetition runs each mode's job and both clean jobs (CURVE on and off), in an order that
rotates from one repetition to the next; every job is a fresh cluster. Each worker trains WARMUP
untimed steps, then STEPS timed steps between barriers (rank 0's clock); the flood starts before the
warm-up and stops when the timed steps are done. Counts: messages the flooder handed to ZeroMQ (and
its rate), and what each server logged when it stopped ("server N stopped (X messages rejected, Y
connections refused)"). ours = samples/s under the flood, peer = samples/s of the clean job with
the same transport.curve, ratio = speedup = ours/peer; target ratio >= {TARGET_RATIO}. This machine
has 2 cores: the flooder's own CPU time is taken from the training (the busy-loop control shows how
much that alone costs).
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="flood modes to measure, each against its clean run (default: all)")
    parser.add_argument("--workers", type=int, default=2, metavar="W", help="worker processes (default: %(default)s)")
    parser.add_argument("--servers", type=int, default=2, metavar="S", help="server processes (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=16, metavar="B",
                        help="samples per worker per step (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=200, metavar="N",
                        help="timed steps per job (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=20, metavar="N",
                        help="untimed steps first, under the flood already (default: %(default)s)")
    parser.add_argument("--sockets", type=int, default=4, metavar="N",
                        help=f"{STRANGERS} and {CURVE_OFF}: flooding sockets per endpoint (default: %(default)s)")
    parser.add_argument("--rotate", type=int, default=90, metavar="N",
                        help=f"{CURVE_OFF}: messages per identity before the socket is replaced by a new "
                             "identity; 0: never (default: %(default)s)")
    parser.add_argument("--recycle-ms", type=float, default=50.0, metavar="MS",
                        help=f"{STRANGERS}: each stranger socket is replaced by a fresh one (new key, new "
                             "connection) this often (default: %(default)s)")
    parser.add_argument("--logs", metavar="DIR",
                        help="keep every job's log (all roles' sluice.* lines) in DIR (default: a temporary "
                             "directory, removed)")
    parser.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                        help="give up on one job after this long (default: %(default)s)")
    add_common_options(parser, quick="30 timed steps after 5 warm-up steps, 1 repeat (overrides those options)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.repeats = 30, 5, 1
    if min(args.workers, args.servers, args.batch_size, args.steps, args.repeats, args.sockets) < 1:
        parser.error("workers, servers, batch size, steps, repeats and sockets must be positive")
    if args.warmup < 0 or args.rotate < 0 or args.recycle_ms <= 0:
        parser.error("warmup and rotate must not be negative, recycle-ms must be positive")
    return args


# ---------------------------------------------------------------------------- the garbage
def _header(**fields: Any) -> bytes:
    """A data header (wire.py's positional array) with `fields` changed."""
    values: dict[str, Any] = {
        "version": VERSION, "kind": int(Kind.PUSH), "sender": 0, "key": 0, "chunk": 0, "round": 1,
        "priority": 0, "dtype": "float32", "shape": [4], "nbytes": 16, "flags": 0, "meta": None,
    }
    values.update(fields)
    order = ("version", "kind", "sender", "key", "chunk", "round", "priority", "dtype", "shape", "nbytes", "flags",
             "meta")
    return bytes(msgpack.packb([values[name] for name in order]))


def garbage(rng: random.Random, to_server: bool) -> list[list[bytes]]:
    """Messages the decoder refuses (a sample of tests/integration/attack.py's raw attacks, small ones
    mostly); for a server also a well-formed PUSH of an unknown key from a non-worker id, which its
    store refuses. Nothing here changes any state."""
    valid = _header()
    nested = b"\x9c" + b"".join(bytes(msgpack.packb(v)) for v in (VERSION, int(Kind.PUSH))) + b"\x91" * 1000 + b"\xc0"
    frames = [
        [rng.randbytes(rng.randint(1, 64))],
        [rng.randbytes(rng.randint(1, 32)), rng.randbytes(rng.randint(1, 256))],
        [rng.randbytes(4096)],
        [_header(version=VERSION + 1), bytes(16)],
        [valid[: len(valid) // 2], bytes(16)],
        [valid[:1]],
        [b""],
        [_header(nbytes=20, shape=[5]), bytes(16)],
        [_header(shape=[3]), bytes(16)],
        [_header(dtype="complex64", shape=[2]), bytes(16)],
        [_header(kind=77), bytes(16)],
        [_header(key=-1), bytes(16)],
        [_header(meta=[1, 2, 3]), bytes(16)],
        [valid, bytes(16), bytes(16)],
        [valid],
        [nested],
    ]
    if to_server:
        frames.append([_header(key=1 << 20, sender=999), bytes(16)])
    return frames


# ---------------------------------------------------------------------------- the flooding process
@dataclass
class Target:
    """One endpoint to flood: a server's channel or the scheduler."""

    endpoint: str
    server: str  # the member listening there: "server-R" or "scheduler"
    #: compromised member mode: the member name (and key) the flooder claims there
    claim: str = ""


@dataclass
class _Flooder:
    target: Target
    sock: zmq.Socket[bytes]
    frames: list[list[bytes]]
    index: int = 0
    sent: int = 0
    born: float = 0.0


@dataclass
class FloodReport:
    mode: str
    seconds: float = 0.0
    sent_servers: int = 0
    sent_scheduler: int = 0
    sockets_opened: int = 0
    full_waits: int = 0
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def sent(self) -> int:
        return self.sent_servers + self.sent_scheduler


class Flood:
    """The sockets of one flooding process and how each is (re)made for its mode."""

    def __init__(self, mode: str, targets: list[Target], keys: JobKeys | None, sockets: int, rotate: int,
                 recycle_s: float) -> None:
        self.mode, self.targets, self.keys = mode, targets, keys
        self.rotate, self.recycle_s = rotate, recycle_s
        self.rng = random.Random(secrets.randbits(64))
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context(io_threads=1)
        self.report = FloodReport(mode)
        self.garbage = {True: garbage(self.rng, True), False: garbage(self.rng, False)}
        per = 1 if mode == MEMBER else sockets
        self.flooders = [self._make(t, n) for t in targets for n in range(per)]

    def _make(self, target: Target, n: int) -> _Flooder:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 1000)
        if self.mode == MEMBER:
            assert self.keys is not None
            sock.setsockopt(zmq.IDENTITY, target.claim.encode())
            self.keys.secure_client(sock, target.claim, target.server)
        elif self.mode == STRANGERS:
            assert self.keys is not None
            # a stranger claiming a member's name; half know the server's public key (leaked), half guess
            sock.setsockopt(zmq.IDENTITY, node_name("worker", 0).encode())
            known = n % 2 == 0
            server_key = self.keys.public_key(target.server) if known else zmq.curve_keypair()[0]
            public, secret = zmq.curve_keypair()
            sock.setsockopt(zmq.CURVE_SERVERKEY, server_key)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
            sock.setsockopt(zmq.RECONNECT_IVL, 1)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 0)
        else:
            sock.setsockopt(zmq.IDENTITY, f"stranger-{self.rng.getrandbits(48):012x}".encode())
        sock.connect(target.endpoint)
        self.report.sockets_opened += 1
        return _Flooder(target, sock, self.garbage[target.server != "scheduler"], self.rng.randrange(64), 0,
                        time.monotonic())

    def _renew(self, flooder: _Flooder, n: int) -> _Flooder:
        flooder.sock.close(linger=0)
        return self._make(flooder.target, n)

    def run(self, stop: Any, limit: float) -> FloodReport:
        """Flood until `stop` is set (or `limit` seconds passed)."""
        started = time.monotonic()
        poller = zmq.Poller()
        for f in self.flooders:
            poller.register(f.sock, zmq.POLLOUT)
        passes = 0
        while True:
            passes += 1
            if passes % 16 == 0 and (stop.is_set() or time.monotonic() - started > limit):
                break
            sent_now = 0
            for i, f in enumerate(self.flooders):
                for _ in range(64):
                    frames = f.frames[f.index % len(f.frames)]
                    try:
                        f.sock.send_multipart(frames, zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    f.index += 1
                    f.sent += 1
                    sent_now += 1
                    if f.target.server == "scheduler":
                        self.report.sent_scheduler += 1
                    else:
                        self.report.sent_servers += 1
                    if self.mode == CURVE_OFF and self.rotate and f.sent >= self.rotate:
                        break
                renew = (self.mode == CURVE_OFF and self.rotate and f.sent >= self.rotate) or (
                    self.mode == STRANGERS and time.monotonic() - f.born > self.recycle_s)
                if renew:
                    poller.unregister(f.sock)
                    self.flooders[i] = self._renew(f, i)
                    poller.register(self.flooders[i].sock, zmq.POLLOUT)
            if not sent_now:  # every queue is full: wait for room instead of spinning
                self.report.full_waits += 1
                poller.poll(5)
        self.report.seconds = time.monotonic() - started
        return self.report

    def close(self) -> None:
        for f in self.flooders:
            f.sock.close(linger=0)
        self.ctx.term()


def _spin(stop: Any, limit: float) -> FloodReport:
    report = FloodReport(SPIN)
    started = time.monotonic()
    while not stop.is_set() and time.monotonic() - started < limit:
        for _ in range(100_000):
            pass
    report.seconds = time.monotonic() - started
    return report


def flooder_main(mode: str, targets: list[Target], secret: bytes, workers: int, servers: int, args: Any,
                 ready: Any, stop: Any) -> dict[str, Any]:
    """The flooding process: set up, say ready, flood until `stop`; its report."""
    if mode == SPIN:
        ready.put("ready")
        report = _spin(stop, args.timeout)
    else:
        keys = JobKeys(secret, member_names(workers, servers)) if mode != CURVE_OFF else None
        flood = Flood(mode, targets, keys, args.sockets, args.rotate, args.recycle_ms / 1e3)
        try:
            ready.put("ready")
            report = flood.run(stop, args.timeout)
        finally:
            flood.close()
    return {"mode": report.mode, "seconds": report.seconds, "sent": report.sent, "sent_servers": report.sent_servers,
            "sent_scheduler": report.sent_scheduler, "sockets_opened": report.sockets_opened,
            "full_waits": report.full_waits}


def targets_for(mode: str, servers: list[tuple[int, str, list[str]]], scheduler: str) -> list[Target]:
    """Every server channel and the scheduler; in member mode, server r is told it talks to server r+1
    and the scheduler to itself (names no real member uses on those connections)."""
    out = []
    for rank, name, endpoints in servers:
        claim = node_name("server", (rank + 1) % len(servers))
        out += [Target(endpoint, name, claim) for endpoint in endpoints]
    out.append(Target(scheduler, "scheduler", "scheduler"))
    return out


# ---------------------------------------------------------------------------- the workers
def flood_worker(x: torch.Tensor, y: torch.Tensor, job: argparse.Namespace, peers: Any, go: Any,
                 done: Any) -> dict[str, Any]:
    """bench/train_throughput.py's Sluice worker, which also hands the servers' endpoints to the
    benchmark (rank 0), waits for the flood to start and says when the timed steps are over."""
    import worker.torch_shim as hvd
    from worker.torch_state import require

    torch.set_num_threads(1)
    hvd.init()
    make_model, _ = demo()
    torch.manual_seed(0)
    model = make_model()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), named_parameters=model.named_parameters()
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    if hvd.rank() == 0:
        found = [(p.rank, p.name, list(p.endpoints)) for p in require().control.peers if p.role == "server"]
        peers.put(sorted(found))
    if not go.wait(120):
        raise TimeoutError("the benchmark never said go")
    data = worker_batches(x, y, hvd.rank(), hvd.size(), job.batch_size, job.warmup + job.steps)
    result = timed_repeats(model, optimizer, data, job.warmup, job.steps, 1, hvd.barrier,
                           hvd.synchronize_parameters)
    if hvd.rank() == 0:
        done.set()
    hvd.shutdown()
    return result


# ---------------------------------------------------------------------------- one job
@dataclass
class JobResult:
    mode: str
    samples_per_s: float
    flood: dict[str, Any] | None
    rejected: list[int]
    refused: list[int]
    banned: int
    codes: list[int | None]
    seconds: float


@contextlib.contextmanager
def captured_log(path: Path) -> Iterator[None]:
    """Every sluice.* line of this process and of those forked inside, at INFO, to `path` (not to the
    terminal: the workers then add no handler of their own)."""
    ours = logging.getLogger("sluice")
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(process)d %(levelname)s %(name)s: %(message)s"))
    saved = ours.level
    ours.addHandler(handler)
    ours.setLevel(logging.INFO)
    try:
        yield
    finally:
        ours.removeHandler(handler)
        ours.setLevel(saved)
        handler.close()


def run_job(mode: str, args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor, log: Path) -> JobResult:
    curve = mode not in (CLEAN_OFF, CURVE_OFF)
    config = {"worker": {"optimizer_on": "worker"}, "transport": {"curve": curve}}
    job = argparse.Namespace(batch_size=args.batch_size, warmup=args.warmup, steps=args.steps)
    flooding = mode in MODES
    flood: dict[str, Any] | None = None
    started = time.perf_counter()
    with captured_log(log), LocalCluster(args.workers, args.servers, config) as cluster, Children() as children:
        peers, go, done, ready = _ctx.Queue(), _ctx.Event(), _ctx.Event(), _ctx.Queue()
        results = cluster.start_workers(flood_worker, x, y, job, peers, go, done)
        servers = peers.get(timeout=min(args.timeout, 120))
        if flooding:
            targets = targets_for(mode, servers, cluster.endpoint)
            children.start("flooder", flooder_main, mode, targets, cluster.secret, args.workers, args.servers, args,
                           ready, done)
            ready.get(timeout=60)
        go.set()
        try:
            reports = cluster.collect(results, args.workers, args.timeout)
        except queue.Empty:
            raise TimeoutError(f"{mode}: the workers did not finish within {args.timeout:g} s; log in {log}") from None
        failed = {rank: value for rank, (status, value) in reports.items() if status != "ok"}
        if failed:
            raise RuntimeError(f"{mode}: workers failed: {failed}; log in {log}")
        if flooding:
            flood = children.collect(["flooder"], 60)["flooder"]
        codes = cluster.wait(timeout=30)
    text = log.read_text(errors="replace")
    stopped = sorted((int(r), int(x_), int(y_)) for r, x_, y_ in _STOPPED.findall(text))
    seconds = reports[0][1]["seconds"][0]
    return JobResult(
        mode, args.steps * args.batch_size * args.workers / seconds, flood,
        [s[1] for s in stopped], [s[2] for s in stopped], text.count(_BANNED), codes,
        time.perf_counter() - started,
    )


def describe_job(job: JobResult) -> str:
    text = f"{job.samples_per_s:7.0f} samples/s"
    if job.flood is not None and job.mode != SPIN:
        rate = job.flood["sent"] / job.flood["seconds"]
        text += (f", flooder sent {job.flood['sent']:,} ({rate:,.0f}/s, {job.flood['sent_scheduler']:,} to the "
                 f"scheduler, {job.flood['sockets_opened']:,} sockets), servers rejected {sum(job.rejected):,} "
                 f"and refused {sum(job.refused):,} connections")
        if job.banned:
            text += f", {job.banned} bans"
    if any(code != 0 for code in job.codes):
        text += f"; exit codes {job.codes}"
    return text


# ---------------------------------------------------------------------------- driver
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    _, load_data = demo()
    x, y, _, _ = load_data()
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.05, momentum=0.9)  # import torch._dynamo once
    baselines = sorted({BASELINE[m] for m in args.modes})
    order = [*baselines[:1], *(m for m in args.modes if BASELINE[m] == baselines[0]), *baselines[1:],
             *(m for m in args.modes if BASELINE[m] != baselines[0])]
    progress(f"flood: {args.workers} workers x {args.servers} servers, batch {args.batch_size} per worker, "
             f"{args.warmup} warm-up + {args.steps} timed steps per job; {args.repeats} repeats of "
             f"{', '.join(order)}")
    jobs: dict[str, list[JobResult]] = {name: [] for name in order}
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        logdir = Path(args.logs) if args.logs else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        logdir.mkdir(parents=True, exist_ok=True)
        for rep in range(args.repeats):
            shift = rep % len(order)
            for name in order[shift:] + order[:shift]:
                job = run_job(name, args, x, y, logdir / f"{rep}-{name}.log")
                jobs[name].append(job)
                progress(f"  repeat {rep + 1}/{args.repeats}  {name:<15} {describe_job(job)}  ({job.seconds:.1f} s)")
    rows, records = [], []
    for mode in args.modes:
        base = BASELINE[mode]
        ours = stats([j.samples_per_s for j in jobs[mode]])
        peer = stats([j.samples_per_s for j in jobs[base]])
        ratio = ours.median / peer.median
        flooded = [j.flood for j in jobs[mode] if j.flood is not None]
        seconds = sum(f["seconds"] for f in flooded)
        sent = sum(f["sent"] for f in flooded)
        sent_scheduler = sum(f["sent_scheduler"] for f in flooded)
        rejected = sum(sum(j.rejected) for j in jobs[mode])
        refused = sum(sum(j.refused) for j in jobs[mode])
        banned = sum(j.banned for j in jobs[mode])
        codes = Counter(code for j in jobs[mode] for code in j.codes)
        rates = [f["sent"] / f["seconds"] for f in flooded] if mode != SPIN else []
        rate = stats(rates) if rates else Stats(0.0, 0.0, 0.0)
        case = f"{mode}-w{args.workers}-s{args.servers}-b{args.batch_size}"
        rows.append([case, ours.brief(0), peer.brief(0), f"{ratio:.2f}x", f"{rate.median:,.0f}",
                     f"{rejected / seconds:,.0f}" if seconds else "-", f"{refused / seconds:,.0f}" if seconds else "-",
                     str(banned), "met" if ratio >= TARGET_RATIO else "MISSED"])
        records.append(record(
            case, ours, peer, PEER_NAME[base], "samples/s", better="higher", speedup=ratio, mode=mode,
            description=LABELS[mode], curve=mode != CURVE_OFF, workers=args.workers, servers=args.servers,
            batch_size=args.batch_size, steps=args.steps, warmup=args.warmup, repeats=args.repeats,
            send_rate=rate.median, send_rate_min=rate.low, send_rate_max=rate.high, sent=sent,
            sent_scheduler=sent_scheduler, flood_seconds=seconds, sockets_opened=sum(f["sockets_opened"] for f in flooded),
            servers_rejected=rejected, servers_refused_connections=refused,
            servers_rejected_per_s=rejected / seconds if seconds else 0.0,
            servers_refused_per_s=refused / seconds if seconds else 0.0, banned=banned,
            rejected_by_job=[j.rejected for j in jobs[mode]], refused_by_job=[j.refused for j in jobs[mode]],
            exit_codes=dict(codes), target_ratio=TARGET_RATIO, met=ratio >= TARGET_RATIO,
        ))
    progress(f"\nglobal samples/s, median [min..max] of {args.repeats} jobs each ({time.perf_counter() - started:.0f} s "
             "in all); rates are per second of flooding, summed over the servers")
    print_table(["case", "under flood", "clean", "ratio", "sent/s", "rejected/s", "refused conn/s", "bans",
                 f">= {TARGET_RATIO}x"], rows)
    write_json(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
