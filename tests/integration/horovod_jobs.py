"""Worker functions for the Horovod-API tests: reduce ops, dtypes, autograd, queries, options, SyncBatchNorm."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32, torch.uint64)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def reduce_ops_and_dtypes() -> dict[str, Any]:
    """Every reduce op, scale factor and dtype once; values chosen so the expected results are exact."""
    import sluice.torch as hvd

    hvd.init()
    rank = hvd.rank()
    out: dict[str, Any] = {}
    values = torch.tensor([rank + 1.0, 5.0 - rank, -2.0 * rank, 0.5])
    for op, name in ((hvd.Sum, "sum"), (hvd.Average, "average"), (hvd.Min, "min"), (hvd.Max, "max"),
                     (hvd.Product, "product")):
        out[f"op.{name}"] = hvd.allreduce(values, name=f"op.{name}", op=op).tolist()
    out["scaled"] = hvd.allreduce(values, name="scaled", op=hvd.Sum, prescale_factor=2.0,
                                  postscale_factor=0.25).tolist()
    for dtype in (*INT_DTYPES, *FLOAT_DTYPES):
        tensor = torch.full((7,), rank + 1).to(dtype)
        out[f"sum.{dtype}"] = (str(hvd.allreduce(tensor, name=f"sum.{dtype}", op=hvd.Sum).dtype),
                               hvd.allreduce(tensor, name=f"s.{dtype}", op=hvd.Sum).double().tolist())
        out[f"max.{dtype}"] = hvd.allreduce(tensor, name=f"max.{dtype}", op=hvd.Max).double().tolist()
        gathered = hvd.allgather(tensor[: rank + 1], name=f"gather.{dtype}")
        out[f"gather.{dtype}"] = (str(gathered.dtype), gathered.double().tolist())
        out[f"bcast.{dtype}"] = hvd.broadcast(tensor, root_rank=1, name=f"bcast.{dtype}").double().tolist()
    for dtype in FLOAT8:
        tensor = torch.full((5,), 0.5 * (rank + 1)).to(dtype)
        summed = hvd.allreduce(tensor, name=f"f8.{dtype}", op=hvd.Sum)
        out[f"sum.{dtype}"] = (str(summed.dtype), summed.float().tolist())
        out[f"bcast.{dtype}"] = hvd.broadcast(tensor, root_rank=2, name=f"f8b.{dtype}").float().tolist()
    flags = torch.tensor([rank == 0, True, False, rank == 1])
    out["bool.max"] = hvd.allreduce(flags, name="bool.max", op=hvd.Max).tolist()
    out["bool.min"] = hvd.allreduce(flags, name="bool.min", op=hvd.Min).tolist()
    out["bool.gather"] = hvd.allgather(flags, name="bool.gather").tolist()
    out["reducescatter"] = hvd.reducescatter(torch.arange(7.0) * (rank + 1), name="rs", op=hvd.Sum).tolist()
    out["grouped_reducescatter"] = [t.tolist() for t in hvd.grouped_reducescatter(
        [torch.arange(7.0) * (rank + 1), torch.ones(3, 2)], name="grs", op=hvd.Sum)]
    out["fp16"] = hvd.allreduce(torch.full((3,), 1.0 + rank), name="fp16", compression=hvd.Compression.fp16,
                                op=hvd.Sum).tolist()
    out["bf16"] = hvd.allreduce(torch.full((3,), 1.0 + rank), name="bf16", compression=hvd.Compression.bf16,
                                op=hvd.Sum).tolist()
    hvd.shutdown()
    return out


def autograd_and_queries() -> dict[str, Any]:
    """Gradients through the collectives (Horovod's own test cases), the topology and build queries,
    what is refused, and shutdown then init."""
    import sluice.torch as hvd
    from sluice.errors import SluiceError

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    out: dict[str, Any] = {}
    x = torch.full((4,), float(rank + 1), requires_grad=True)
    hvd.allreduce(x, name="g.sum", op=hvd.Sum).backward(torch.ones(4) * (rank + 1))
    out["grad.allreduce_sum"] = x.grad.tolist()  # type: ignore[union-attr]
    x = torch.full((3,), float(rank + 1), requires_grad=True)
    hvd.allreduce(x, name="g.max", op=hvd.Max).backward(torch.ones(3))
    out["grad.allreduce_max"] = x.grad.tolist()  # type: ignore[union-attr]
    x = torch.full((rank + 1, 2), 1.0, requires_grad=True)
    gathered = hvd.allgather(x, name="g.gather")
    gathered.backward(torch.cat([torch.full((r + 1, 2), float(r)) for r in range(size)]))
    out["grad.allgather"] = x.grad.tolist()  # type: ignore[union-attr]
    x = torch.ones(3, requires_grad=True)
    hvd.broadcast(x, root_rank=1, name="g.bcast").backward(torch.ones(3))
    out["grad.broadcast"] = x.grad.tolist()  # type: ignore[union-attr]
    out["queries"] = [hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size(), hvd.is_homogeneous(),
                      hvd.mpi_built(), hvd.gloo_built(), hvd.nccl_built(), hvd.ccl_built(), hvd.cuda_built(),
                      hvd.rocm_built(), hvd.mpi_enabled(), hvd.is_initialized()]
    # parallel vectors: Adasum gives their mean, pair by pair: A(A(1, 2), 3) = A(1.5, 3) = 2.25
    out["adasum"] = hvd.allreduce(torch.ones(2) * (hvd.rank() + 1), op=hvd.Adasum).tolist()
    refused = []
    for call in (lambda: hvd.allreduce(torch.ones(2), process_set=object()),
                 lambda: hvd.init(comm=[0, 1])):
        try:
            call()
            refused.append("accepted")
        except SluiceError as exc:
            refused.append(str(exc))
    try:
        hvd.PartialDistributedOptimizer  # noqa: B018
        refused.append("accepted")
    except AttributeError as exc:
        refused.append(str(exc))
    out["refused"] = refused
    hvd.shutdown()
    out["after_shutdown"] = [hvd.is_initialized()]
    try:
        hvd.allreduce(torch.ones(1))
        out["after_shutdown"].append("accepted")
    except SluiceError as exc:
        out["after_shutdown"].append(str(exc))
    hvd.init()
    out["after_init"] = [hvd.is_initialized(), hvd.rank(),
                         hvd.allreduce(torch.ones(2), name="again", op=hvd.Sum).tolist()]
    hvd.shutdown()
    return out


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 2))


def _data(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(batch, 6, generator=generator), torch.randn(batch, 2, generator=generator)


def optimizer_options(option: str, steps: int, batch: int) -> list[float]:
    """Train the small model with one of DistributedOptimizer's options; its parameters at the end."""
    import sluice.torch as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    model = _model()
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    params = list(model.parameters())
    kwargs: dict[str, Any] = {
        "none": {}, "fp16": {"compression": hvd.Compression.fp16}, "bf16": {"compression": hvd.Compression.bf16},
        "sum": {"op": hvd.Sum}, "predivide": {"gradient_predivide_factor": 2.0},
        "passes": {"backward_passes_per_step": 2}, "groups_int": {"groups": 2},
        "groups_list": {"groups": [[params[0], params[3]], [params[1], params[4], params[5]]]},
    }[option]
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), **kwargs)
    x, y = _data(batch)
    shard = batch // size
    xs, ys = x[rank * shard:(rank + 1) * shard], y[rank * shard:(rank + 1) * shard]
    for _ in range(steps):
        opt.zero_grad()
        if option == "passes":  # two half-batches, each loss halved: the same gradient as the whole shard
            half = shard // 2
            for part in (slice(0, half), slice(half, shard)):
                (F.mse_loss(model(xs[part]), ys[part]) / 2).backward()
        else:
            loss = F.mse_loss(model(xs), ys)
            (loss / size if option == "sum" else loss).backward()
        opt.step()
    hvd.synchronize_parameters()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()
    hvd.shutdown()
    return flat


def single_process_training(steps: int, batch: int) -> list[float]:
    """The same model and optimizer on the whole batch in one process: what optimizer_options must match."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = _data(batch)
    for _ in range(steps):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def sparse_embedding(sparse_as_dense: bool, steps: int) -> list[float]:
    """An nn.Embedding(sparse=True) trained with plain SGD; its weights at the end."""
    import sluice.torch as hvd

    hvd.init()
    rank = hvd.rank()
    torch.manual_seed(0)
    embed = torch.nn.Embedding(20, 4, sparse=True)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(embed.parameters(), lr=0.5),
                                   named_parameters=embed.named_parameters(), sparse_as_dense=sparse_as_dense)
    mine = (torch.arange(8) * 3 + rank * 5) % 20  # ranks overlap on some rows: their gradients add
    for step in range(steps):
        opt.zero_grad()
        embed(mine).pow(2).sum().mul(step + 1).backward()
        opt.step()
    hvd.synchronize_parameters()
    weights = embed.weight.detach().reshape(-1).tolist()
    hvd.shutdown()
    return weights


def sync_batch_norm(batches: list[int]) -> dict[str, Any]:
    """A SyncBatchNorm2d on this rank's slice of one global batch (sizes `batches`, which may differ):
    its output, the input's gradient, the affine gradients and the running statistics."""
    import sluice.torch as hvd

    hvd.init()
    rank = hvd.rank()
    torch.manual_seed(0)
    x = torch.randn(sum(batches), 3, 4, 5, dtype=torch.float64)
    start = sum(batches[:rank])
    mine = x[start:start + batches[rank]].clone().requires_grad_(True)
    norm = hvd.SyncBatchNorm(3).double()
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([1.0, 2.0, -0.5]))
        norm.bias.copy_(torch.tensor([0.1, 0.0, 0.3]))
    weights = torch.linspace(-1, 1, x[0].numel(), dtype=torch.float64).view(3, 4, 5)
    y = norm(mine)
    (y * weights).sum().backward()
    norm.eval()
    evaluated = norm(mine.detach()[:1]).sum().item()
    out = {"y": y.detach().tolist(), "dx": mine.grad.tolist(),  # type: ignore[union-attr]
           "dw": norm.weight.grad.tolist(), "db": norm.bias.grad.tolist(),  # type: ignore[union-attr]
           "mean": norm.running_mean.tolist(), "var": norm.running_var.tolist(), "eval": evaluated}  # type: ignore[union-attr]
    hvd.shutdown()
    return out


def batch_norm_reference(batches: list[int]) -> dict[str, Any]:
    """torch's BatchNorm2d on the whole batch in one process: what sync_batch_norm must match (the input
    gradient is that of the sum of every rank's loss; the affine gradients are per rank's slice)."""
    torch.manual_seed(0)
    x = torch.randn(sum(batches), 3, 4, 5, dtype=torch.float64).requires_grad_(True)
    norm = torch.nn.BatchNorm2d(3).double()
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([1.0, 2.0, -0.5]))
        norm.bias.copy_(torch.tensor([0.1, 0.0, 0.3]))
    weights = torch.linspace(-1, 1, x[0].numel(), dtype=torch.float64).view(3, 4, 5)
    y = norm(x)
    (y * weights).sum().backward()
    mean = x.detach().mean((0, 2, 3))
    xhat = (x.detach() - mean.view(1, 3, 1, 1)) / torch.sqrt(x.detach().var((0, 2, 3), unbiased=False)
                                                            + norm.eps).view(1, 3, 1, 1)
    parts = []
    start = 0
    for count in batches:
        dy = weights.expand(count, 3, 4, 5)
        parts.append({"dw": (dy * xhat[start:start + count]).sum((0, 2, 3)).tolist(),
                      "db": dy.sum((0, 2, 3)).tolist()})
        start += count
    norm.eval()
    return {"y": y.detach().tolist(), "dx": x.grad.tolist(), "mean": norm.running_mean.tolist(),  # type: ignore[union-attr]
            "var": norm.running_var.tolist(), "parts": parts,  # type: ignore[union-attr]
            "eval": [norm(x.detach()[sum(batches[:r]):sum(batches[:r]) + 1]).sum().item() for r in range(len(batches))]}


def sparse_reference(size: int, steps: int) -> list[float]:
    """sparse_embedding's training in one process: every rank's ids, the loss averaged over the ranks."""
    torch.manual_seed(0)
    embed = torch.nn.Embedding(20, 4, sparse=True)
    opt = torch.optim.SGD(embed.parameters(), lr=0.5)
    for step in range(steps):
        opt.zero_grad()
        loss = sum(embed((torch.arange(8) * 3 + r * 5) % 20).pow(2).sum() for r in range(size))
        (loss * (step + 1) / size).backward()  # type: ignore[operator]
        opt.step()
    return embed.weight.detach().reshape(-1).tolist()


def async_forms() -> dict[str, Any]:
    """Horovod's async reducescatter, grouped allgather and reducescatter, sparse allreduce, and the
    gradient of reducescatter (test_horovod_reducescatter_grad, _grad_average), on 3 ranks."""
    import sluice.torch as hvd

    hvd.init()
    rank = hvd.rank()
    rows = torch.arange(7.0).unsqueeze(1) * (rank + 1)  # summed over 3 ranks: 6 * row index
    # Horovod's tests check that poll() is False at least once: the call returns before the op is done. Here
    # rank 0, the coordinator tree's root, submits before the others do (the barrier): the root's own call
    # completes an op that every other rank has submitted already, as carried data lets it (carry.py)
    # (named: an unnamed op takes the next number of a count every rank must keep alike)
    handle = hvd.reducescatter_async(rows, op=hvd.Sum, name="first") if rank == 0 else None
    polled = hvd.poll(handle) if handle is not None else None
    hvd.barrier()
    if handle is None:
        handle = hvd.reducescatter_async(rows, op=hvd.Sum, name="first")
        polled = hvd.poll(handle)
    out: dict[str, Any] = {"poll_at_once": polled}
    out["reducescatter"] = hvd.synchronize(handle).reshape(-1).tolist()
    grouped = hvd.synchronize(hvd.grouped_reducescatter_async([rows, torch.ones(3, 2) * rank]))
    out["grouped_reducescatter"] = [t.tolist() for t in grouped]
    gathered = hvd.synchronize(hvd.grouped_allgather_async([torch.full((rank + 1,), float(rank)),
                                                             torch.ones(1, 2) * rank]))
    out["grouped_allgather"] = [t.tolist() for t in gathered]
    sparse = torch.sparse_coo_tensor([[rank, 3]], [1.0 + rank, 2.0], (5,))
    out["sparse"] = hvd.sparse_allreduce_async(sparse, name="sp", op=hvd.Average)().to_dense().tolist()
    # every async and in-place form of Horovod's: the result, and whether the input was written
    value = torch.full((2,), rank + 1.0)
    in_place = value.clone()
    forms = [hvd.synchronize(hvd.allreduce_async_(in_place, op=hvd.Sum)).tolist(), in_place.tolist(),
             hvd.synchronize(hvd.allgather_async(value.reshape(1, 2))).reshape(-1).tolist(),
             hvd.synchronize(hvd.broadcast_async(value, 1)).tolist(), value.tolist()]
    in_place.mul_(rank + 1)  # rank 2's: 18
    hvd.synchronize(hvd.broadcast_async_(in_place, 2))
    grouped = [value.clone(), value.clone() * 2]
    forms += [in_place.tolist(), [t.tolist() for t in hvd.grouped_allreduce_(grouped, op=hvd.Sum)]]
    forms += [[t.tolist() for t in hvd.synchronize(hvd.grouped_allreduce_async([value], op=hvd.Sum))], value.tolist()]
    forms += [[t.tolist() for t in hvd.synchronize(hvd.grouped_allreduce_async_([value.clone()], op=hvd.Sum))]]
    forms += [hvd.synchronize(hvd.alltoall_async(torch.arange(3.0) + 10 * rank))[0].tolist()]  # (rows, splits)
    out["forms"] = forms
    for op, label in ((hvd.Sum, "grad.sum"), (hvd.Average, "grad.average")):
        x = torch.ones(6, 2, requires_grad=True)
        hvd.reducescatter(x, op=op).backward(torch.ones(2, 2))
        out[label] = x.grad.tolist() if x.grad is not None else None
    hvd.shutdown()
    return out


def adasum_vectors(rank: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Rank `rank`'s two tensors for the Adasum test: random, partly aligned across ranks."""
    generator = torch.Generator().manual_seed(100 + rank)
    shared = torch.randn(33, generator=torch.Generator().manual_seed(99))
    return [(shared + torch.randn(33, generator=generator)).to(dtype),
            torch.randn(4, 5, generator=generator).to(dtype)]


def adasum_job() -> dict[str, Any]:
    """A grouped allreduce with op=hvd.Adasum (prescale 0.5, postscale 2) of two tensors per dtype, and the
    gradient of an Adasum allreduce (Horovod's: the Adasum of the output's gradients)."""
    import sluice.torch as hvd

    hvd.init()
    out: dict[str, Any] = {}
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        tensors = adasum_vectors(hvd.rank(), dtype)
        reduced = hvd.grouped_allreduce(tensors, op=hvd.Adasum, prescale_factor=0.5, postscale_factor=2.0)
        out[str(dtype)] = [t.double().reshape(-1).tolist() for t in reduced]
        out[f"{dtype}.dtype"] = [str(t.dtype) for t in reduced]
    x = torch.ones(3, requires_grad=True)
    hvd.allreduce(x, op=hvd.Adasum).backward(torch.ones(3) * (hvd.rank() + 1))
    out["grad"] = x.grad.tolist() if x.grad is not None else None
    hvd.shutdown()
    return out
