"""Train a LightningModule through Sluice: `Trainer(strategy=SluiceStrategy())`, one process per worker.

Lightning 1.x users of `strategy="horovod"` switch by importing SluiceStrategy (or naming "sluice"
after `import sluice.lightning`); `sluice launch` starts the processes, not Lightning.
Start it with: sluice launch -w 2 -s 1 -- python examples/train_lightning.py
(-s 0: allreduce among the workers instead of a parameter server). Needs pip install 'sluice-ps[lightning]'.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import sluice.torch as hvd
from sluice.lightning import SluiceStrategy


class Regression(pl.LightningModule):
    """A small MLP fitting a fixed random linear map; logs its loss averaged over the workers."""

    def __init__(self, features: int = 16, lr: float = 0.05) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(features, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        self.lr = lr
        self.epoch_losses: list[float] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True, prog_bar=True)
        return loss

    def on_train_epoch_end(self) -> None:
        self.epoch_losses.append(float(self.trainer.callback_metrics["train_loss"]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def dataset(rows: int = 512, features: int = 16) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, features, generator=generator)
    return TensorDataset(x, x @ torch.randn(features, 1, generator=generator))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=5, help="passes over the data set (default 5)")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per worker per step (default 32)")
    parser.add_argument("--out", type=Path, help="write this rank's losses and parameters to OUT.rank<N>.json")
    args = parser.parse_args()
    torch.manual_seed(1)  # rank 0's initial parameters are broadcast anyway; this makes runs repeatable
    model = Regression()
    trainer = pl.Trainer(strategy=SluiceStrategy(), accelerator="cpu", devices=1, max_epochs=args.epochs,
                         logger=False, enable_checkpointing=False, enable_model_summary=False)
    # the Trainer gives each worker its shard (a DistributedSampler over hvd.size() replicas)
    trainer.fit(model, DataLoader(dataset(), batch_size=args.batch_size, shuffle=True))
    if trainer.global_rank == 0:
        print(f"train_loss by epoch: {[round(loss, 4) for loss in model.epoch_losses]}", flush=True)
    if args.out is not None:
        params = [p.detach().flatten().tolist() for p in model.parameters()]
        record = {"rank": hvd.rank(), "size": hvd.size(), "losses": model.epoch_losses, "params": params,
                  "all_params": hvd.allgather_object(params)}
        args.out.with_name(f"{args.out.name}.rank{hvd.rank()}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
