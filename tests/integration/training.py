"""Training functions the integration tests run inside forked worker processes."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_post_hook

FEATURES, HIDDEN, OUTPUTS = 12, 16, 3


def make_model(strided: bool = False) -> torch.nn.Module:
    """`strided`: the first weight is a non-contiguous (transposed) tensor, so Sluice must stage it
    through a host buffer: on the CPU, the same path a CUDA tensor takes."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUTPUTS)
    )
    if strided:
        first = model[0]
        assert isinstance(first, torch.nn.Linear)
        first.weight = torch.nn.Parameter(first.weight.detach().t().contiguous().t())
        assert not first.weight.is_contiguous()
    return model


def make_optimizer(model: torch.nn.Module, name: str) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=0.01)
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def global_batches(steps: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(steps * batch, FEATURES, generator=generator)
    y = torch.randn(steps * batch, OUTPUTS, generator=generator)
    return x, y


def train_single(steps: int, batch: int, optimizer: str, strided: bool = False) -> list[torch.Tensor]:
    """The reference: one process training on the whole global batch of every step."""
    model = make_model(strided)
    opt = make_optimizer(model, optimizer)
    x, y = global_batches(steps, batch)
    for step in range(steps):
        opt.zero_grad()
        F.mse_loss(model(x[step * batch : (step + 1) * batch]), y[step * batch : (step + 1) * batch]).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


class StepHooks(Protocol):
    """What a test may do around the training of train_distributed (e.g. attack the servers)."""

    def before_broadcast(self) -> None: ...

    def before_step(self) -> None: ...

    def finish(self) -> Any: ...


def train_distributed(
    steps: int,
    batch: int,
    optimizer: str,
    hooks: Callable[[], StepHooks | None] | None = None,
    strided: bool = False,
) -> dict[str, Any]:
    """Each worker trains on its slice of every global batch through Sluice.

    `hooks`, if given, is called once the optimizer is wrapped; what it returns is run around the
    broadcast and every step, and its `finish()` is returned as "extra".
    """
    import sluice.torch as hvd
    from sluice.worker.torch.state import PENDING

    hvd.init()
    model = make_model(strided)
    if hvd.rank() != 0:  # different start: broadcast_parameters must fix it
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    opt = hvd.DistributedOptimizer(make_optimizer(model, optimizer), named_parameters=model.named_parameters())
    around = hooks() if hooks is not None else None
    if around is not None:
        around.before_broadcast()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    x, y = global_batches(steps, batch)
    per = batch // hvd.size()
    digests, waits_in_forward, optimizer_steps = [], 0, 0

    def count(*_: Any) -> None:
        nonlocal optimizer_steps
        optimizer_steps += 1

    counting = register_optimizer_step_post_hook(count)  # every step() of every optimizer
    for step in range(steps):
        start = step * batch + hvd.rank() * per
        if around is not None:
            around.before_step()
        opt.zero_grad()
        waits_in_forward += len(PENDING)
        # with the optimizer on the servers, the forward pre-hooks wait for each layer's parameters
        loss = F.mse_loss(model(x[start : start + per]), y[start : start + per])
        assert not PENDING
        if step:
            digests.append(digest(model))  # the parameters after step - 1
        loss.backward()
        opt.step()
    hvd.synchronize_parameters()
    counting.remove()
    digests.append(digest(model))
    extra = around.finish() if around is not None else None
    params = [p.detach().clone().numpy() for p in model.parameters()]
    hvd.shutdown()
    return {"params": params, "digests": digests, "waits_in_forward": waits_in_forward,
            "optimizer_steps": optimizer_steps, "extra": extra}


def record_pushes(steps: int) -> list[tuple[str, bool]]:
    """(tensor name, pushed while backward() was still running) for every push of every step."""
    import sluice.torch as hvd
    from sluice.worker.torch.state import require

    hvd.init()
    model = make_model()
    opt = hvd.DistributedOptimizer(make_optimizer(model, "sgd"), named_parameters=model.named_parameters())
    node = require()
    pushes: list[tuple[str, bool]] = []
    in_backward = False
    engine = node.collectives
    assert engine is not None
    original_push, original_allreduce = node.ps.push_pull, engine.allreduce

    def recording(name: str, *args: Any, **kwargs: Any) -> Any:
        pushes.append((name, in_backward))
        return original_push(name, *args, **kwargs)

    def recording_allreduce(name: str, *args: Any, **kwargs: Any) -> Any:
        pushes.append((name, in_backward))
        return original_allreduce(name, *args, **kwargs)

    node.ps.push_pull = recording  # type: ignore[method-assign]
    engine.allreduce = recording_allreduce  # type: ignore[method-assign]
    x, y = global_batches(steps, 8)
    for step in range(steps):
        opt.zero_grad()
        loss = F.mse_loss(model(x[step * 8 : step * 8 + 8]), y[step * 8 : step * 8 + 8])
        in_backward = True
        loss.backward()
        in_backward = False
        opt.step()
    hvd.shutdown()
    return pushes


def train_scheduled(steps: int, batch: int, distributed: bool) -> list[Any]:
    """SGD with an LR schedule, and on odd steps Horovod's clipping idiom (`synchronize()`, clip,
    `skip_synchronize()`), in one process on global batches or as one worker of several."""
    model = make_model()
    opt: Any = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    rank, size = 0, 1
    if distributed:
        import sluice.torch as hvd

        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    x, y = global_batches(steps, batch)
    per = batch // size
    for step in range(steps):
        start = step * batch + rank * per
        opt.zero_grad()
        F.mse_loss(model(x[start : start + per]), y[start : start + per]).backward()
        if step % 2:
            if distributed:
                opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            if distributed:
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
        else:
            opt.step()  # overlapped: the update runs in the next forward pass, with this step's LR
        schedule.step()
    if distributed:
        hvd.synchronize_parameters()
        hvd.shutdown()
    return [p.detach().clone().numpy() for p in model.parameters()]
