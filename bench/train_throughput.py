"""Training throughput of the digits demo model: Sluice against torch DDP (gloo); sluice.keras against
sluice.torch, TF's MultiWorkerMirroredStrategy and Keras alone."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/train_throughput.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from bench.common import (
    Stats,
    add_common_options,
    free_port,
    import_example,
    keep_alive,
    print_table,
    progress,
    record,
    stats,
    write_json,
)
from bench.keras_mwms import MWMS as MWMS_LOOP
from bench.keras_mwms import measure_keras_mwms
from bench.keras_training import (
    ALONE,
    MWMS,
    measure_keras_alone,
    measure_mirrored,
    measure_sluice_keras,
    total_steps,
)
from sluice.launch.config import ConfigError, load_config
from testbed.children import Children
from testbed.cluster import LocalCluster

DDP = "torch DDP (gloo)"
Batches = tuple[torch.Tensor, torch.Tensor]  # (steps, batch, 1, 8, 8) images and (steps, batch) labels

DESCRIPTION = """\
Global training throughput (steps x batch x workers / seconds) of examples/train_digits.py's model
on the digits data, the same model, batches, optimizer (SGD lr 0.05, momentum 0.9) and one torch
thread per process on both sides:

  sluice  W workers (LocalCluster, sluice.torch: DistributedOptimizer, broadcast_parameters)
          with S servers; the optimizer runs on the workers or on the servers (--optimizer-on)
  ddp     W processes, torch.nn.parallel.DistributedDataParallel over gloo

Each process first trains WARMUP untimed steps; every repetition then times STEPS steps between
two barriers on rank 0 (with the optimizer on the servers the last parameters are waited for
inside the timed span). Process start and rendezvous are never timed.

With --framework keras, examples/train_digits_keras.py's model (the same layers in Keras 3) trains
with model.fit on the same batches, timed inside one fit per process (bench/keras_training.py),
and sluice.keras is measured against four peers in the same run:

  keras-vs-torch     sluice.torch on the same model and batches (optimizer on the workers)
  keras-vs-mwms      tf.distribute.MultiWorkerMirroredStrategy: the same processes, model and batches,
                     CPU collective ops over gRPC (TF_CONFIG on 127.0.0.1), through model.fit
  keras-vs-mwmsloop  the same strategy through TF's custom training loop (bench/keras_mwms.py)
  keras-vs-alone     W processes each training Keras alone at once (no exchange: the ceiling of scaling)
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=4, metavar="W",
                        help="worker processes on both sides (default: %(default)s)")
    parser.add_argument("--servers", type=int, default=2, metavar="S",
                        help="Sluice server processes (default: %(default)s)")
    parser.add_argument("--optimizer-on", nargs="+", choices=["worker", "server"], default=["worker"],
                        help="where Sluice runs the optimizer (worker.optimizer_on); give both to measure "
                             "both, each against its own DDP run (default: worker)")
    parser.add_argument("--framework", nargs="+", choices=["torch", "keras"], default=["torch"],
                        help="torch: Sluice against DDP; keras: sluice.keras against sluice.torch, TF's "
                             "MultiWorkerMirroredStrategy and Keras alone (default: torch)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", dest="settings",
                        help="a Sluice setting for the Sluice side, as `sluice launch --set` takes it, e.g. "
                             "collective.mode=allreduce (repeatable)")
    parser.add_argument("--batch-size", type=int, default=16, metavar="B",
                        help="samples per worker per step (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=200, metavar="N",
                        help="timed steps per repetition (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=20, metavar="N",
                        help="untimed steps before the first repetition (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                        help="give up on one measurement after this long (default: %(default)s)")
    add_common_options(parser, quick="2 warm-up + 10 timed steps, 1 repeat (overrides those options); with "
                                     "--framework keras, against MWMS only")
    args = parser.parse_args(argv)
    if args.quick:
        args.warmup, args.steps, args.repeats = 2, 10, 1
    if min(args.workers, args.batch_size, args.steps, args.repeats) < 1 or min(args.warmup, args.servers) < 0:
        parser.error("workers, batch size, steps and repeats must be positive; servers and warmup not negative")
    try:
        args.config = load_config(None, {}, args.settings).to_sections()
    except ConfigError as exc:
        parser.error(str(exc))
    return args


def demo() -> tuple[Callable[[], torch.nn.Module], Callable[[], tuple[torch.Tensor, ...]]]:
    """make_model and load_data of examples/train_digits.py (imported by name: examples/ is not type-checked)."""
    module: Any = import_example("train_digits")
    return module.make_model, module.load_data


def worker_batches(x: torch.Tensor, y: torch.Tensor, rank: int, size: int, batch: int, steps: int) -> Batches:
    """Rank's shard of the training set, shuffled once and cycled through `steps` batches."""
    shard = torch.arange(rank, len(y), size)
    shard = shard[torch.randperm(len(shard), generator=torch.Generator().manual_seed(rank))]
    index = shard[torch.arange(steps * batch) % len(shard)].reshape(steps, batch)
    return x[index], y[index]


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: Batches, first: int, count: int) -> float:
    images, labels = data
    loss = torch.zeros(())
    for step in range(first, first + count):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(images[step]), labels[step])
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
    return float(loss.item())


def timed_repeats(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: Batches, warmup: int, steps: int, repeats: int,
    barrier: Callable[[str], None], settle: Callable[[], None],
) -> dict[str, Any]:
    """Seconds of each repetition of `steps` steps, between barriers, and the last step's loss."""
    loss = train(model, optimizer, data, 0, warmup)
    settle()
    seconds = []
    for rep in range(repeats):
        barrier(f"start.{rep}")
        started = time.perf_counter()
        loss = train(model, optimizer, data, warmup, steps)
        settle()
        barrier(f"end.{rep}")
        seconds.append(time.perf_counter() - started)
    return {"seconds": seconds, "loss": loss}


# ---------------------------------------------------------------------------- the two sides
def sluice_demo() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """In a worker of a Sluice job: hvd.init(), the demo model (seeded) and its DistributedOptimizer
    (SGD with momentum), parameters broadcast from rank 0."""
    import sluice.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    make_model, _ = demo()
    torch.manual_seed(0)
    model = make_model()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), named_parameters=model.named_parameters()
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return model, optimizer


def _sluice_worker(x: torch.Tensor, y: torch.Tensor, args: argparse.Namespace) -> dict[str, Any]:
    import sluice.torch as hvd

    model, optimizer = sluice_demo()
    data = worker_batches(x, y, hvd.rank(), hvd.size(), args.batch_size, args.warmup + args.steps)
    result = timed_repeats(model, optimizer, data, args.warmup, args.steps, args.repeats,
                           lambda name: hvd.barrier(name=name), hvd.synchronize_parameters)
    hvd.shutdown()
    return result


def measure_sluice(x: torch.Tensor, y: torch.Tensor, args: argparse.Namespace, optimizer_on: str) -> dict[str, Any]:
    config = {**args.config, "worker": {**args.config["worker"], "optimizer_on": optimizer_on}}
    with LocalCluster(args.workers, args.servers, config) as cluster:
        results = cluster.run(_sluice_worker, x, y, args, timeout=args.timeout)
        cluster.wait()
    out: dict[str, Any] = results[0]
    return out


def _ddp_worker(rank: int, port: int, x: torch.Tensor, y: torch.Tensor, args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.workers,
                            timeout=timedelta(seconds=120))
    make_model, _ = demo()
    torch.manual_seed(0)
    model = DistributedDataParallel(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    keep_alive(model, optimizer)  # no destroy_process_group either: see keep_alive
    data = worker_batches(x, y, rank, args.workers, args.batch_size, args.warmup + args.steps)
    return timed_repeats(model, optimizer, data, args.warmup, args.steps, args.repeats,
                         lambda _name: dist.barrier(), lambda: None)


def measure_ddp(x: torch.Tensor, y: torch.Tensor, args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    with Children() as children:
        for rank in range(args.workers):
            children.start(f"rank {rank}", _ddp_worker, rank, port, x, y, args)
        results = children.collect([f"rank {r}" for r in range(args.workers)], args.timeout)
    out: dict[str, Any] = results["rank 0"]
    return out


# ---------------------------------------------------------------------------- driver
def throughput(args: argparse.Namespace, result: dict[str, Any]) -> Stats:
    samples = args.steps * args.batch_size * args.workers
    return stats([samples / s for s in result["seconds"]])


#: --quick --framework keras: the peer measured (MWMS, Keras' own; sluice.torch, the MWMS loop and Keras alone each
#: start another set of TensorFlow processes, which the full run measures)
QUICK_KERAS_PEERS = ("keras-vs-mwms",)


def keras_cases(args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor, rows: list[list[str]],
                records: list[dict[str, Any]]) -> None:
    """sluice.keras against sluice.torch, MultiWorkerMirroredStrategy and Keras alone x W, same model and batches."""
    def data(rank: int, size: int) -> Batches:
        return worker_batches(x, y, rank, size, args.batch_size, total_steps(args))

    base = f"digits-w{args.workers}-s{args.servers}-b{args.batch_size}"
    t0 = time.perf_counter()
    keras = measure_sluice_keras(data, args)
    ours = throughput(args, keras)
    progress(f"  {base}  sluice.keras {ours.brief(0)} samples/s, loss {keras['loss']:.4g} "
             f"({time.perf_counter() - t0:.1f} s)")
    peers: list[tuple[str, str, str, Callable[[], dict[str, Any]]]] = [
             ("keras-vs-torch", "sluice.torch (same model, optimizer on the workers)", "sluice.torch",
              lambda: measure_sluice(x, y, args, "worker")),
             ("keras-vs-mwms", MWMS, "MWMS", lambda: measure_mirrored(data, args)),
             ("keras-vs-mwmsloop", MWMS_LOOP, "MWMS loop", lambda: measure_keras_mwms(data, args)),
             ("keras-vs-alone", ALONE, "keras alone", lambda: measure_keras_alone(data, args))]
    for name, peer_name, short, measure in peers:
        if args.quick and name not in QUICK_KERAS_PEERS:
            continue
        t0 = time.perf_counter()
        result = measure()
        peer = throughput(args, result)
        progress(f"  {base}  {short} {peer.brief(0)} samples/s, loss {result['loss']:.4g} "
                 f"({time.perf_counter() - t0:.1f} s)")
        case = f"{name}-{base}"
        rows.append([case, ours.brief(0), peer.brief(0), f"{ours.median / peer.median:.2f}x"])
        records.append(record(
            case, ours, peer, peer_name, "samples/s", framework="keras", workers=args.workers,
            servers=args.servers, batch_size=args.batch_size, steps=args.steps, warmup=args.warmup,
            repeats=args.repeats, optimizer_on="worker", ours_loss=keras["loss"], peer_loss=result["loss"],
            settings=args.settings,
        ))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    _, load_data = demo()
    x, y, _, _ = load_data()
    # The first optimizer a process builds imports torch._dynamo (1.3 s here); do it once before forking.
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.05, momentum=0.9)
    progress(f"training throughput: {args.workers} workers, batch {args.batch_size} per worker, "
             f"{args.warmup} warm-up + {args.steps} timed steps x {args.repeats} repeats")
    rows: list[list[str]] = []
    records: list[dict[str, Any]] = []
    started = time.perf_counter()
    for optimizer_on in args.optimizer_on if "torch" in args.framework else []:
        case = f"digits-w{args.workers}-s{args.servers}-b{args.batch_size}-opt_{optimizer_on}"
        t0 = time.perf_counter()
        sluice = measure_sluice(x, y, args, optimizer_on)
        ours = throughput(args, sluice)
        progress(f"  {case}  sluice {ours.brief(0)} samples/s, last loss {sluice['loss']:.4g} "
                 f"({time.perf_counter() - t0:.1f} s)")
        t0 = time.perf_counter()
        ddp = measure_ddp(x, y, args)
        peer = throughput(args, ddp)
        progress(f"  {case}  ddp    {peer.brief(0)} samples/s, last loss {ddp['loss']:.4g} "
                 f"({time.perf_counter() - t0:.1f} s)")
        rows.append([case, ours.brief(0), peer.brief(0), f"{ours.median / peer.median:.2f}x"])
        records.append(record(
            case, ours, peer, DDP, "samples/s", workers=args.workers, servers=args.servers,
            batch_size=args.batch_size, steps=args.steps, warmup=args.warmup, repeats=args.repeats,
            optimizer_on=optimizer_on, ours_loss=sluice["loss"], peer_loss=ddp["loss"], settings=args.settings,
        ))
    if "keras" in args.framework:
        keras_cases(args, x, y, rows, records)
    progress(f"\nglobal samples/s, median [min..max] of {args.repeats} repeats "
             f"({time.perf_counter() - started:.0f} s in all)")
    print_table(["case", "sluice", "peer", "sluice/peer"], rows)
    write_json(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
