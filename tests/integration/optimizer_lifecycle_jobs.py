"""Worker functions for DistributedOptimizer's lifecycle as Horovod has it, each with its one-process reference.

From Horovod's test_torch.py: optimizers made one after another (a script that rebuilds its model)
and two alive at once that take turns with requires_grad switched (test_dynamic_requires_grad, a
GAN); no named_parameters (test_no_named_parameters; Horovod's default names, unique and the same on
every rank); named_parameters incomplete, duplicated or not tuples (ValueError); a parameter whose
gradient one rank never computes (test_force_allreduce: the others' gradients still count). Every
worker trains on its shard of one batch, so the mean of the shards' gradients is the whole batch's,
and the parameters must equal those of one process training on the whole batch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

STEPS, BATCH = 3, 12


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, 6, generator=generator), torch.randn(BATCH, 2, generator=generator)


def _flat(*models: torch.nn.Module) -> list[float]:
    return torch.cat([p.detach().reshape(-1) for m in models for p in m.parameters()]).tolist()


def _shard(rank: int, size: int, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    part = BATCH // size
    return tuple(t[rank * part:(rank + 1) * part] for t in tensors)


def _gan_steps(gen: torch.nn.Module, disc: torch.nn.Module, opt_g: Any, opt_d: Any,
               data: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Horovod's test_dynamic_requires_grad, as a loop: each step trains one of two models, the other frozen."""
    x, y = data
    for step in range(2 * STEPS):
        train_g = step % 2 == 0
        for p in gen.parameters():
            p.requires_grad_(train_g)
        for p in disc.parameters():
            p.requires_grad_(not train_g)
        (opt_g if train_g else opt_d).zero_grad()
        F.mse_loss(disc(torch.tanh(gen(x))), y).backward()
        (opt_g if train_g else opt_d).step()


def _plain_steps(model: torch.nn.Module, opt: Any, data: tuple[torch.Tensor, torch.Tensor],
                 skip_last: bool = False) -> None:
    """STEPS steps of MSE on `data`; `skip_last`: a loss that never reaches the last layer (no gradient there)."""
    x, y = data
    for _ in range(STEPS):
        opt.zero_grad()
        loss = model[:2](x).pow(2).mean() if skip_last else F.mse_loss(model(x), y)
        loss.backward()
        opt.step()


def lifecycle() -> dict[str, Any]:
    """Every case on this rank; parameters after training, names, and what the bad calls raised."""
    import sluice.torch as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    out: dict[str, Any] = {}
    # one after another: a script that rebuilds its model and optimizer
    flats = []
    for seed in (1, 2):
        model = _model(seed)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters())
        _plain_steps(model, opt, _shard(rank, size, _data(seed)))  # type: ignore[arg-type]
        hvd.synchronize_parameters()
        flats.append(_flat(model))
    out["sequential"] = flats
    # two at once, taking turns with requires_grad switched; no named_parameters for either
    gen, disc = _model(3), _model(4)
    gen[2] = torch.nn.Linear(8, 6)
    opt_g = hvd.DistributedOptimizer(torch.optim.SGD(gen.parameters(), lr=0.1))
    opt_d = hvd.DistributedOptimizer(torch.optim.Adam(disc.parameters(), lr=0.01))
    _gan_steps(gen, disc, opt_g, opt_d, _shard(rank, size, _data(5)))  # type: ignore[arg-type]
    hvd.synchronize_parameters()
    out["gan"] = _flat(gen, disc)
    # default names: Horovod's, unique, the same on every rank, two parameter groups
    model = _model(6)
    groups = [{"params": list(model[0].parameters())}, {"params": list(model[2].parameters()), "lr": 0.05}]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(groups, lr=0.1))
    out["default_names"] = sorted(opt._parameter_names.values())
    out["bad_named"] = []
    for bad in (list(model.named_parameters())[:1], [*model.named_parameters(), ("0.weight", model[0].weight)],
                list(model.parameters())):
        try:
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=bad)
            out["bad_named"].append("ok")
        except ValueError as exc:
            out["bad_named"].append(f"ValueError: {str(exc)[:40]}")
    # a parameter rank 0 never computes a gradient for: the others' still count, averaged over all
    model = _model(7)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    _plain_steps(model, opt, _shard(rank, size, _data(7)), skip_last=rank == 0)  # type: ignore[arg-type]
    hvd.synchronize_parameters()
    out["force"] = _flat(model)
    hvd.shutdown()
    return out


def reference(size: int) -> dict[str, Any]:
    """The same cases in one process, each worker's gradient computed apart and averaged by hand."""
    out: dict[str, Any] = {}
    flats = []
    for seed in (1, 2):
        model = _model(seed)
        _plain_steps(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), _data(seed))
        flats.append(_flat(model))
    out["sequential"] = flats
    gen, disc = _model(3), _model(4)
    gen[2] = torch.nn.Linear(8, 6)
    _gan_steps(gen, disc, torch.optim.SGD(gen.parameters(), lr=0.1), torch.optim.Adam(disc.parameters(), lr=0.01),
               _data(5))
    out["gan"] = _flat(gen, disc)
    model = _model(7)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data(7)
    for _ in range(STEPS):
        grads = []
        for rank in range(size):
            model.zero_grad()
            xs, ys = _shard(rank, size, (x, y))
            out_ = model[:2](xs)
            (out_.pow(2).mean() if rank == 0 else F.mse_loss(model[2](out_), ys)).backward()
            grads.append([p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()])
        for p, *per_rank in zip(model.parameters(), *grads, strict=True):
            p.grad = sum(per_rank) / size
        opt.step()
    out["force"] = _flat(model)
    return out


def adasum_training() -> list[float]:
    """DistributedOptimizer(op=hvd.Adasum) with plain SGD: Horovod's delta optimizer; parameters at the end."""
    import sluice.torch as hvd

    hvd.init()
    model = _model(8)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum,
                                   named_parameters=model.named_parameters())
    _plain_steps(model, opt, _shard(hvd.rank(), hvd.size(), _data(8)))  # type: ignore[arg-type]
    raised = ""
    try:
        with opt.skip_synchronize():  # type: ignore[attr-defined]
            pass
    except AssertionError as exc:
        raised = str(exc)
    hvd.shutdown()
    return [*_flat(model), raised]  # type: ignore[list-item]


def adasum_reference(size: int) -> list[float]:
    """Each worker's SGD step on its own shard from the same parameters, the steps combined by Adasum's
    formula (a tree of adjacent ranks, written out here), added to the parameters."""
    model = _model(8)
    x, y = _data(8)
    for _ in range(STEPS):
        deltas = []
        for rank in range(size):
            model.zero_grad()
            xs, ys = _shard(rank, size, (x, y))
            F.mse_loss(model(xs), ys).backward()
            deltas.append([-0.1 * p.grad.double() for p in model.parameters()])  # type: ignore[union-attr]
        with torch.no_grad():
            for index, p in enumerate(model.parameters()):
                level = [d[index].reshape(-1) for d in deltas]
                while len(level) > 1:
                    pairs = [(1 - (a @ b) / (2 * (a @ a))) * a + (1 - (a @ b) / (2 * (b @ b))) * b
                             for a, b in zip(level[::2], level[1::2], strict=False)]
                    level = pairs + ([level[-1]] if len(level) % 2 else [])
                p += level[0].reshape(p.shape).to(p.dtype)
    return _flat(model)
