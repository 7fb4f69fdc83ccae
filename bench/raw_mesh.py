"""Raw ZeroMQ rounds on the testbed: a PS round's traffic with nothing of Sluice, the floor under the PS benchmark.

Each worker sends its tensor as chunks, chunk i to server i % S, on one DEALER a server; a server answers
chunk k to every worker (a message of the chunk's size) once every worker's k-th chunk to it came, as a
PS server answers once its sum is complete; a worker's round ends when every answer came, and the next
starts then. No sums, no credit (libzmq's pipes and TCP pace the sends), no cipher, no priorities: what
the links, the kernel and libzmq carry in these rounds. One untimed warm-up round; then each repetition
times ROUNDS rounds on worker 0's clock (the servers couple every worker's rounds).

Run by run_raw_mesh() (and bench/chunk_cpu.py, with ipc:// endpoints); a process learns its part from RANK and
WORLD_SIZE (workers first, then servers).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence

if __package__ in (None, ""):  # run as `python bench/raw_mesh.py`: make the repo root importable
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))

import zmq

from bench.common import Stats, stats, thread_cpu
from testbed.job import emit_result, free_port, run_gloo_job
from testbed.launch import children
from testbed.netbed import Netbed

#: messages queued in a socket beyond what the kernel holds: enough to keep a link busy
HWM = 4
#: set to a pid, worker 0 reports the CPU seconds of that pid's children through its timed rounds
CPU_OF = "RAW_MESH_CPU_OF"


def serve(endpoint: str, workers: int, answers: int, chunk: int) -> None:
    """Answer `answers` chunks to each of `workers` workers, each once every worker's copy of it came."""
    context = zmq.Context()
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full pipe says so (EAGAIN) instead of dropping the answer
    sock.bind(endpoint)
    payload = zmq.Frame(bytes(chunk))
    counts: dict[bytes, int] = {}
    owed: dict[bytes, int] = {}
    complete, sent, heard = 0, 0, time.monotonic()
    while sent < answers * workers:
        # a ROUTER cannot say which peer's pipe has room again: with answers owed, try again in 2 ms (HWM
        # chunks and the kernel's buffer keep the link busy far longer)
        sock.poll(2 if any(owed.values()) else 1000, zmq.POLLIN)
        while int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            ident, _ = sock.recv_multipart(copy=False)
            counts[ident.bytes] = counts.get(ident.bytes, 0) + 1
            heard = time.monotonic()
        while len(counts) == workers and min(counts.values()) > complete:
            complete += 1
            for peer in counts:
                owed[peer] = owed.get(peer, 0) + 1
        for peer in owed:
            while owed[peer]:
                try:
                    sock.send_multipart([peer, payload], zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                owed[peer] -= 1
                sent += 1
        if time.monotonic() - heard > 60:
            raise SystemExit(f"raw mesh server at {endpoint}: nothing for 60 s ({sent} answers sent)")
    sock.close(linger=-1)  # every answer delivered before the process leaves
    context.term()


def work(rank: int, endpoints: Sequence[str], nbytes: int, chunk: int, rounds: int, repeats: int,
         cpu_of: int | None = None) -> tuple[list[float], float]:
    """Seconds per round of each repetition, after one untimed round; and, given `cpu_of` (the pid whose
    children are the job's processes), their CPU seconds through the timed rounds (else 0)."""
    context = zmq.Context()
    socks = []
    for endpoint in endpoints:
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, f"worker-{rank}".encode())
        sock.setsockopt(zmq.SNDHWM, HWM)
        sock.connect(endpoint if "://" in endpoint else f"tcp://{endpoint}")
        socks.append(sock)
    payload = zmq.Frame(bytes(chunk))
    each = nbytes // chunk // len(socks)

    def one_round() -> None:
        left, answers = [each] * len(socks), 0
        poller = zmq.Poller()
        for sock in socks:
            poller.register(sock, zmq.POLLIN | zmq.POLLOUT)
        while answers < each * len(socks):
            events = poller.poll(60_000)
            if not events:
                raise SystemExit(f"raw mesh worker {rank}: nothing for 60 s ({answers} answers this round)")
            for sock, event in events:
                index = socks.index(sock)
                if event & zmq.POLLIN:
                    sock.recv(copy=False)
                    answers += 1
                if event & zmq.POLLOUT and left[index]:
                    sock.send(payload, copy=False)
                    left[index] -= 1
                    if not left[index]:  # its part sent: wait for answers only (no spinning on a writable socket)
                        poller.modify(sock, zmq.POLLIN)

    one_round()
    pids = children(cpu_of) if cpu_of is not None else []
    cpu = sum(map(sum, thread_cpu(pids).values()))
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(rounds):
            one_round()
        seconds.append((time.perf_counter() - started) / rounds)
    cpu = sum(map(sum, thread_cpu(pids).values())) - cpu
    for sock in socks:
        sock.close(linger=0)
    context.term()
    return seconds, cpu


def run_raw_mesh(bed: Netbed, workers: Sequence[str], servers: Sequence[str], nbytes: int, chunk: int, rounds: int,
                 repeats: int, timeout: float) -> Stats:
    """MB/s of worker 0's repetitions (bytes of its tensor over the time of one round)."""
    if nbytes % (chunk * len(servers)):
        raise ValueError(f"{nbytes} bytes do not cut into chunks of {chunk} spread evenly over {len(servers)} servers")
    endpoints = ",".join(f"{bed.hosts[h].address}:{free_port(bed, h)}" for h in servers)
    argv = [sys.executable, "-m", "bench.raw_mesh", endpoints, str(len(workers)), str(nbytes), str(chunk),
            str(rounds), str(repeats)]
    results = run_gloo_job(bed, [*workers, *servers], argv, timeout=timeout)
    first = next(r for r in results if r["rank"] == 0)
    return stats([nbytes / t / 1e6 for t in first["seconds"]])


def main(argv: Sequence[str]) -> int:
    endpoints, workers, nbytes, chunk, rounds, repeats = argv[0].split(","), *map(int, argv[1:])
    rank = int(os.environ["RANK"])
    if rank < workers:
        cpu_of = os.environ.get(CPU_OF)
        seconds, cpu = work(rank, endpoints, nbytes, chunk, rounds, repeats, int(cpu_of) if cpu_of else None)
        emit_result({"rank": rank, "seconds": seconds, "cpu_seconds": cpu})
    else:
        endpoint = endpoints[rank - workers]  # host:port (TCP), or a whole ZeroMQ endpoint (ipc://PATH)
        bind = endpoint if "://" in endpoint else f"tcp://*:{endpoint.rsplit(':', 1)[1]}"
        serve(bind, workers, (1 + repeats * rounds) * (nbytes // chunk // len(endpoints)), chunk)
        emit_result({"rank": rank})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
