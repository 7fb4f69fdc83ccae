"""Train a small CNN on scikit-learn's bundled digits as a pipeline: its layers cut into stages on workers.

Each worker builds the same model (same seed), keeps its stage (stage = rank % stages) and runs the
1F1B schedule over micro-batches; with more workers than stages, the pipeline is replicated and each
stage averages its gradients with its replicas (pipeline + data parallel).
Start it with: sluice launch -w 2 -s 0 -- python examples/train_digits_pipeline.py --stages 2
           or: sluice launch -w 4 -s 0 -- python examples/train_digits_pipeline.py --stages 2   (2 replicas)
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F
from train_digits import load_data, make_model  # the same model and data as the data-parallel example

import sluice.torch as hvd
from sluice.worker.torch.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, split_model


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages (workers must be a multiple; default 2)")
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step (default 4)")
    parser.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b", help="(default 1f1b)")
    parser.add_argument("--epochs", type=int, default=10, help="passes over the training set (default 10)")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per replica per step (default 32)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    parser.add_argument("--compress", choices=["auto", "on", "off"], default="auto",
                        help="ZVC for activations and gradients (auto: towards other hosts; default auto)")
    parser.add_argument("--offload", action="store_true", help="offload saved activations to host memory")
    parser.add_argument("--target", type=float, default=0.95, help="exit 1 if final test accuracy is lower")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(0)  # every worker builds the same model, then keeps its stage
    parts = split_model(make_model(), args.stages)  # cut where the parameter bytes balance
    stage = PipelineStage(parts[hvd.rank() % args.stages], None, args.stages, compress=args.compress,
                          offload=args.offload)
    kind = Schedule1F1B if args.schedule == "1f1b" else ScheduleGPipe
    schedule = kind(stage, args.micro_batches, loss_fn=F.cross_entropy)
    optimizer = torch.optim.SGD(stage.submod.parameters(), lr=args.lr, momentum=0.9)
    replica, replicas = stage.place.replica, stage.place.replicas
    x_train, y_train, x_test, y_test = load_data()
    steps = len(y_train) // (args.batch_size * replicas)
    if hvd.rank() == 0:
        print(f"{args.stages} stages x {replicas} replicas, {args.schedule}, {args.micro_batches} micro-batches; "
              f"stage 0 has {len(stage.submod)} layers; {steps} steps per epoch", flush=True)
    accuracy = 0.0
    for epoch in range(1, args.epochs + 1):
        started = time.perf_counter()
        order = torch.randperm(len(y_train), generator=torch.Generator().manual_seed(epoch))  # same on all workers
        losses: list[torch.Tensor] = []
        for step in range(steps):
            batch = order[step * args.batch_size * replicas:(step + 1) * args.batch_size * replicas]
            mine = batch[replica * args.batch_size:(replica + 1) * args.batch_size]
            optimizer.zero_grad()
            if stage.is_first and stage.is_last:
                schedule.step(x_train[mine], target=y_train[mine], losses=losses)
            elif stage.is_first:
                schedule.step(x_train[mine])
            elif stage.is_last:
                schedule.step(target=y_train[mine], losses=losses)
            else:
                schedule.step()
            optimizer.step()
        elapsed = time.perf_counter() - started
        # evaluation: every replica runs the forwards of its share of the test set through its pipeline
        mine = torch.arange(replica, len(y_test), replicas)
        outputs = schedule.eval(x_test[mine]) if stage.is_first else schedule.eval()
        if stage.is_last:
            correct = (outputs.argmax(1) == y_test[mine]).sum().item()
            accuracy = correct / len(mine)
            print(f"replica {replica} epoch {epoch:2d}  loss {torch.stack(losses).mean().item():.4f}  test accuracy "
                  f"{accuracy:6.2%}  {steps * args.batch_size / elapsed:7.0f} samples/s", flush=True)
    ratio = stage.compression_ratio()  # raw bytes / bytes sent: ReLU activations are about half zeros
    print(f"stage {stage.stage_index} of replica {replica}: ZVC ratio {ratio['forward']:.2f} for the activations it "
          f"sent, {ratio['backward']:.2f} for the gradients", flush=True)
    hvd.shutdown()
    if stage.is_last and accuracy < args.target:
        print(f"test accuracy {accuracy:.2%} is below the target {args.target:.0%}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
