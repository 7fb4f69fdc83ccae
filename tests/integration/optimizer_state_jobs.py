"""Worker functions for the broadcast_optimizer_state and broadcast_parameters conformance tests."""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

#: the root's hyper-parameters and every other rank's (only those a class takes are used)
ROOT_OPTIONS: dict[str, Any] = {"weight_decay": 0.01, "momentum": 0.9, "betas": (0.8, 0.95), "etas": (0.4, 1.3),
                                "step_sizes": (1e-6, 40), "nesterov": True}
OTHER_OPTIONS: dict[str, Any] = {"weight_decay": 0.0, "momentum": 0.5, "betas": (0.9, 0.999), "etas": (0.5, 1.2),
                                 "step_sizes": (1e-5, 50.0), "nesterov": False}


class Net(nn.Module):
    """An embedding and a linear layer, a frozen parameter, and one that only some forward passes use."""

    def __init__(self, sparse: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(6, 3, sparse=sparse)
        self.fc = nn.Linear(3, 2)
        self.frozen = nn.Parameter(torch.linspace(0.5, 1.5, 6).reshape(2, 3), requires_grad=False)
        self.unused = nn.Parameter(torch.full((2, 3), 0.25))

    def forward(self, index: torch.Tensor, use_unused: bool) -> torch.Tensor:
        hidden = self.embed(index)
        out = self.fc(hidden) * self.frozen[:, 0]
        return out + hidden @ self.unused.t() if use_unused else out  # type: ignore[no-any-return]


def optimizer_classes() -> list[type[torch.optim.Optimizer]]:
    """Every torch.optim optimizer but LBFGS, by name (the same order on every rank)."""
    classes = [c for c in torch.optim.Optimizer.__subclasses__()
               if c.__module__.startswith("torch.optim") and c is not torch.optim.LBFGS]
    return sorted(classes, key=lambda c: c.__name__)


def cases() -> list[tuple[str, type[torch.optim.Optimizer]]]:
    """Each optimizer class, and SGD once more without momentum (stateless)."""
    return [(cls.__name__, cls) for cls in optimizer_classes()] + [("SGD.stateless", torch.optim.SGD)]


def build(name: str, cls: type[torch.optim.Optimizer], root: bool, seed: int) -> tuple[Net, torch.optim.Optimizer]:
    """A model and its optimizer with two parameter groups (one for SparseAdam, 2-D only for Muon)."""
    torch.manual_seed(seed)
    model = Net(sparse=cls is torch.optim.SparseAdam)
    rest = [] if cls is torch.optim.SparseAdam else [model.fc.weight, model.fc.bias, model.unused]
    if cls.__name__ == "Muon":
        rest = [p for p in rest if p.dim() == 2]
    accepted = inspect.signature(cls.__init__).parameters
    options = {k: v for k, v in (ROOT_OPTIONS if root else OTHER_OPTIONS).items() if k in accepted}
    if name == "SGD.stateless":
        options = {"weight_decay": options["weight_decay"]}
    scale = 1.0 if root else 3.0
    groups: list[dict[str, Any]] = [{"params": [model.embed.weight, model.frozen], "lr": 0.01 * scale}]
    if rest:
        groups.append({"params": rest, "lr": 0.02 * scale})
    return model, cls(groups, **options)


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(0, 6, (5,), generator=generator), torch.randn(5, 2, generator=generator)


def train_locally(model: Net, optimizer: torch.optim.Optimizer, rank: int, steps: int, use_unused: bool) -> None:
    for step in range(steps):
        index, target = batch(10 * rank + step)
        optimizer.zero_grad()
        F.mse_loss(model(index, use_unused), target).backward()  # type: ignore[no-untyped-call]
        optimizer.step()


def describe(value: Any) -> Any:
    """A value as plain data that keeps its type: a tensor's dtype, shape, device, layout and values."""
    if isinstance(value, torch.Tensor):
        dense = value.to_dense() if value.is_sparse else value
        return ["tensor", str(value.dtype), list(value.shape), value.device.type, value.is_sparse,
                dense.detach().cpu().double().tolist()]
    if isinstance(value, (tuple, list)):
        return [type(value).__name__, [describe(v) for v in value]]
    if isinstance(value, dict):
        return ["dict", {k: describe(v) for k, v in value.items()}]
    return [type(value).__name__, value]


def describe_optimizer(optimizer: torch.optim.Optimizer) -> Any:
    return describe(optimizer.state_dict())


def flat_parameters(model: nn.Module) -> list[float]:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double().tolist()


def every_optimizer(root_rank: int) -> dict[str, Any]:
    """For each optimizer: the root loads a checkpoint, the next rank is fresh, any others hold state of
    their own (some the root lacks); after broadcast_parameters and broadcast_optimizer_state, each rank's
    state, hyper-parameters and gradients, then one distributed step and the root's one-process reference."""
    import sluice.torch as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    fresh = rank == (root_rank + 1) % size
    out: dict[str, Any] = {}
    for name, cls in cases():
        model, optimizer = build(name, cls, rank == root_rank, seed=rank)
        train_locally(model, optimizer, rank, 2, use_unused=rank != root_rank)
        checkpoint = copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
        reference = reference_step(name, cls, copy.deepcopy(checkpoint), size) if rank == root_rank else None
        model, plain = build(name, cls, rank == root_rank, seed=50 + rank)
        optimizer = hvd.DistributedOptimizer(plain, named_parameters=model.named_parameters())
        if not fresh:
            model.load_state_dict(checkpoint["model"])
            optimizer.load_state_dict(checkpoint["optimizer"])
        before = describe_optimizer(optimizer)
        empty = len(optimizer.state_dict()["state"]) == 0
        hvd.broadcast_parameters(model.state_dict(), root_rank=root_rank)
        hvd.broadcast_optimizer_state(optimizer, root_rank=root_rank, model=model)
        case: dict[str, Any] = {"before": before, "after": describe_optimizer(optimizer), "empty_before": empty,
                                "grads": {n: None if p.grad is None else describe(p.grad)
                                          for n, p in model.named_parameters()}}
        index, target = batch(500 + rank)
        optimizer.zero_grad()
        F.mse_loss(model(index, True), target).backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        hvd.synchronize_parameters()
        case["trained"] = flat_parameters(model)
        case["reference"] = reference
        out[name] = case
    hvd.shutdown()
    return out


def reference_step(name: str, cls: type[torch.optim.Optimizer], checkpoint: dict[str, Any], size: int) -> list[float]:
    """One process: the root's checkpoint, one step on the gradient averaged over every rank's batch."""
    model, optimizer = build(name, cls, True, seed=0)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    optimizer.zero_grad()
    total = sum((F.mse_loss(model(*_pair(batch(500 + r))), batch(500 + r)[1]) for r in range(size)),
                torch.zeros(()))
    (total / size).backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    return flat_parameters(model)


def _pair(data: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, bool]:
    return data[0], True


class NoGrad(nn.Module):
    """Horovod's ModelNoGrad: an integer parameter without gradient indexes a trained one."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor) -> None:
        super().__init__()
        self.a = nn.Parameter(a.int(), requires_grad=False)
        self.b = nn.Parameter(b)


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}|{isinstance(exc, ValueError)}|{exc}"


def horovod_cases() -> dict[str, Any]:
    """Horovod's test_broadcast_state_no_grad (wrapped and plain), sparse zero gradients through `model=`,
    plain state values and extra group keys, LBFGS, and the calls every rank must refuse together."""
    import sluice.torch as hvd

    hvd.init()
    rank = hvd.rank()
    out: dict[str, Any] = {}
    for wrapped in (True, False):
        torch.manual_seed(rank)
        model = NoGrad(torch.tensor([1.0, 3.0]), torch.rand(4))
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.001, weight_decay=1e-6,
                                                     momentum=0.9, nesterov=True)
        if wrapped:
            opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        try:
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            hvd.broadcast_optimizer_state(opt, root_rank=0)
            grad = opt.param_groups[0]["params"][1].grad
            same = bool(torch.equal(grad, hvd.broadcast(grad, root_rank=0, name=f"bgrad.{wrapped}")))
            out[f"no_grad.{wrapped}"] = [opt.param_groups[0]["params"][0].grad is None, describe(grad), same,
                                         describe_optimizer(opt)]
        except Exception as exc:  # the failure, reported instead of ending the job
            out[f"no_grad.{wrapped}"] = _error(exc)
    for with_model in (True, False):
        net = Net(sparse=True)
        sgd = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        hvd.broadcast_optimizer_state(sgd, 0, model=net if with_model else None)
        out[f"sparse.{with_model}"] = {n: None if p.grad is None else [p.grad.is_sparse, float(p.grad.abs().sum())]
                                       for n, p in net.named_parameters()}
    out["values"] = plain_values(rank)
    for wrapped in (False, True):
        lbfgs: torch.optim.Optimizer = torch.optim.LBFGS(nn.Linear(2, 1).parameters())
        if wrapped:
            lbfgs = hvd.DistributedOptimizer(lbfgs)
        try:
            hvd.broadcast_optimizer_state(lbfgs, 0)
            out[f"lbfgs.{wrapped}"] = "no error"
        except Exception as exc:
            out[f"lbfgs.{wrapped}"] = _error(exc)
    layer = nn.Linear(2, 2)
    groups: list[dict[str, Any]] = [{"params": [layer.weight]}, {"params": [layer.bias]}]
    odd = torch.optim.SGD(groups if rank == 0 else [{"params": list(layer.parameters())}], lr=0.1)
    unsendable = torch.optim.SGD(layer.parameters(), lr=0.1)
    unsendable.param_groups[0]["schedule"] = slice(1, 2)  # no plain value: Sluice sends no pickle
    for key, refused in (("mismatch", odd), ("unsendable", unsendable)):
        try:
            hvd.broadcast_optimizer_state(refused, 0)
            out[key] = "no error"
        except Exception as exc:
            out[key] = _error(exc)
    out["in_step"] = hvd.allreduce(torch.ones(1), name="after.refusals", op=hvd.Sum).tolist()
    hvd.shutdown()
    return out


def plain_values(rank: int) -> dict[str, Any]:
    """Adam whose state and groups hold plain values and a tensor besides torch's own; every rank but the
    root has state of its own, with a key the root lacks. Returns the root's before and this rank's after."""
    import sluice.torch as hvd

    torch.manual_seed(7)
    layer = nn.Linear(3, 2)
    groups: list[dict[str, Any]] = [{"params": [layer.weight], "lr": 0.1 if rank == 0 else 0.5},
                                    {"params": [layer.bias]}]
    opt = torch.optim.Adam(groups, betas=(0.8, 0.9) if rank == 0 else (0.5, 0.6))
    layer(torch.ones(1, 3) * (rank + 1)).sum().backward()
    opt.step()
    first = opt.state[layer.weight]
    if rank == 0:
        first.update({"note": ("tag", 3, 2.5, None, True), "count": 7, "history": [1.5, 2.5]})
        opt.param_groups[0].update({"name": "head", "scale": 2, "milestones": [10, 20],
                                    "lr_scale": torch.tensor(0.5, dtype=torch.float64)})
    else:
        first.update({"count": 7.0, "stale": 1})
        opt.param_groups[0].update({"name": "other", "scale": 2.0})
    before = describe_optimizer(opt)
    hvd.broadcast_optimizer_state(opt, 0)
    after = describe_optimizer(opt)
    layer(torch.ones(1, 3)).sum().backward()
    opt.step()  # the values taken from the root work in a step
    return {"before": before, "after": after}


def parameter_forms(root_rank: int) -> dict[str, Any]:
    """broadcast_parameters with a state_dict (its keys in another order on some ranks), a list of
    (name, tensor), a generator of them and a list of bare tensors; every rank's values after each."""
    import sluice.torch as hvd

    hvd.init()
    rank = hvd.rank()
    out: dict[str, Any] = {}
    for form in ("dict", "tuples", "generator", "bare"):
        torch.manual_seed(rank)
        model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 5))  # no first dimension of 2
        out[f"{form}.before"] = flat_parameters(model)
        state = model.state_dict()
        params: Any = {"dict": dict(reversed(state.items())) if rank % 2 else state,
                       "tuples": list(model.named_parameters()), "generator": model.named_parameters(),
                       "bare": list(model.parameters())}[form]
        try:
            hvd.broadcast_parameters(params, root_rank=root_rank)
            out[form] = flat_parameters(model)
        except Exception as exc:
            out[form] = _error(exc)
    hvd.shutdown()
    return out


def warm_up() -> None:
    """Step every optimizer once in the test process, so the workers it forks find torch's lazy imports made."""
    for name, cls in cases():
        model, optimizer = build(name, cls, True, seed=0)
        train_locally(model, optimizer, 0, 1, use_unused=False)
