"""Train a small CNN on scikit-learn's bundled digits through Sluice (`make demo` runs this).

A Horovod script switches to Sluice by changing its import to `import sluice.torch as hvd`.
Start it with: sluice launch -w 4 -s 2 -- python examples/train_digits.py
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F
from digits import load_digits  # examples/digits.py: scikit-learn's bundled digits

import sluice.torch as hvd


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=12, help="passes over the training set (default 12)")
    parser.add_argument("--batch-size", type=int, default=16, help="samples per worker per step (default 16)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker (default 1)")
    parser.add_argument("--target", type=float, default=0.95, help="exit 1 if final test accuracy is lower")
    return parser.parse_args()


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(32 * 4 * 4, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10),
    )


def load_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    images_8x8, targets = load_digits()
    images = torch.tensor(images_8x8, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(targets, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    test, train = order[:360], order[360:]
    return images[train], labels[train], images[test], labels[test]


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    x_train, y_train, x_test, y_test = load_data()
    shard = torch.arange(rank, len(y_train), size)
    steps = (len(y_train) // size) // args.batch_size

    torch.manual_seed(rank)  # different starting points on purpose: broadcast_parameters aligns them
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    if rank == 0:
        print(f"training on {len(y_train)} digits with {size} workers, {steps} steps per epoch", flush=True)

    accuracy = 0.0
    for epoch in range(1, args.epochs + 1):
        started = time.perf_counter()
        model.train()
        order = shard[torch.randperm(len(shard), generator=torch.Generator().manual_seed(epoch * 1000 + rank))]
        loss_sum = torch.zeros(1)
        for step in range(steps):
            batch = order[step * args.batch_size : (step + 1) * args.batch_size]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x_train[batch]), y_train[batch])
            loss.backward()
            optimizer.step()
            loss_sum += loss.detach()
        elapsed = time.perf_counter() - started
        hvd.synchronize_parameters()
        model.eval()
        with torch.no_grad():
            mine = torch.arange(rank, len(y_test), size)
            correct = (model(x_test[mine]).argmax(1) == y_test[mine]).sum().to(torch.float32).reshape(1)
        correct = hvd.allreduce(correct, name="test.correct", average=False)
        mean_loss = hvd.allreduce(loss_sum / steps, name="train.loss")
        accuracy = correct.item() / len(y_test)
        if rank == 0:
            samples = steps * args.batch_size * size
            print(
                f"epoch {epoch:2d}  loss {mean_loss.item():.4f}  test accuracy {accuracy:6.2%}  "
                f"{samples / elapsed:8.0f} samples/s",
                flush=True,
            )
    hvd.shutdown()
    if accuracy < args.target:
        print(f"test accuracy {accuracy:.2%} is below the target {args.target:.0%}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
