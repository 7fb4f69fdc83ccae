"""broadcast_object and allgather_object without pickle: msgpack (worker/objects_codec.py), torch tensors too.

An object is msgpack with tagged extension types (worker/objects_codec.py): None, bool, int, float,
str, bytes, lists, tuples, dicts, numpy arrays, and torch tensors (code 3) as [dtype name, shape, raw
bytes] with the dtype from a fixed list. Anything else (a class instance, a function) is refused at
the sender with TypeError, saying what is allowed. Decoding builds only those types: no code runs.
broadcast_optimizer_state sends an optimizer's layout and plain values this way, its tensors by
broadcast.
"""

from __future__ import annotations

from typing import Any

import torch

from sluice.errors import InvalidCallError, SluiceError
from sluice.worker.objects_codec import Codec, TensorType
from sluice.worker.torch.calls import engine, op_name, refusing
from sluice.worker.torch.collectives import allgather_async, broadcast_, broadcast_parameters, synchronize
from sluice.worker.torch.updates import synchronize_parameters

_TORCH_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.bool, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
    torch.float32, torch.float64)}


def _encode_tensor(obj: torch.Tensor) -> tuple[str, list[int], bytes]:
    name = str(obj.dtype).removeprefix("torch.")
    if name not in _TORCH_DTYPES:
        raise TypeError(f"tensors of {obj.dtype} cannot be sent as objects")
    host = obj.detach().cpu().contiguous()
    raw = host.view(torch.int16) if host.dtype == torch.bfloat16 else host
    return name, list(obj.shape), raw.numpy().tobytes()


def _decode_tensor(name: str, shape: list[int], raw: bytes) -> torch.Tensor:
    if name not in _TORCH_DTYPES:
        raise ValueError(f"dtype {name[:20]!r} is not allowed")
    dtype = _TORCH_DTYPES[name]
    storage = torch.int16 if dtype == torch.bfloat16 else dtype
    flat = torch.frombuffer(bytearray(raw), dtype=storage) if raw else torch.empty(0, dtype=storage)
    return flat.view(dtype).reshape(shape)


_CODEC = Codec([TensorType(3, (torch.Tensor,), "torch tensors", _encode_tensor, _decode_tensor)])


def dumps(obj: Any) -> bytes:
    """`obj` as msgpack bytes (TypeError for what the format cannot carry)."""
    return _CODEC.dumps(obj)


def loads(data: bytes) -> Any:
    """The object `dumps` wrote; ValueError on anything else. Sizes are bounded by `data` itself."""
    return _CODEC.loads(data)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None, process_set: Any = None) -> Any:
    """`root_rank`'s object on every rank of `process_set` (the others' `obj` is ignored). An object the
    codec cannot carry raises TypeError on the root, and the call fails on the others too."""
    from sluice.worker.torch.state import require

    on = engine(process_set)
    name = op_name(name, "broadcast_object", on)
    with refusing(f"{name}.length", on):
        payload = dumps(obj) if require().rank == root_rank else b""
    length = broadcast_(torch.tensor([len(payload)], dtype=torch.int64), root_rank, f"{name}.length", process_set)
    buffer = torch.zeros(int(length.item()), dtype=torch.uint8)
    if require().rank == root_rank:
        buffer.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    broadcast_(buffer, root_rank, f"{name}.bytes", process_set)
    try:
        return loads(buffer.numpy().tobytes())
    except ValueError as exc:
        raise SluiceError(f"broadcast_object {name!r}: {exc}") from None


def allgather_object(obj: Any, name: str | None = None) -> list[Any]:
    """Every rank's object, in rank order. An object the codec cannot carry raises TypeError here, and the
    call fails on the others too."""
    name = op_name(name, "allgather_object")
    with refusing(f"{name}.lengths"):
        payload = dumps(obj)
    lengths = synchronize(allgather_async(torch.tensor([len(payload)], dtype=torch.int64), f"{name}.lengths")).tolist()
    mine = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.zeros(0, dtype=torch.uint8)
    data = synchronize(allgather_async(mine, f"{name}.bytes")).numpy().tobytes()
    objects, offset = [], 0
    for length in lengths:
        try:
            objects.append(loads(data[offset: offset + length]))
        except ValueError as exc:
            raise SluiceError(f"allgather_object {name!r}: {exc}") from None
        offset += length
    return objects


def _dtype(name: Any) -> torch.dtype | None:
    """The torch dtype called `name` (a peer's string: only attributes that are dtypes count)."""
    dtype = getattr(torch, name, None) if isinstance(name, str) and not name.startswith("_") else None
    return dtype if isinstance(dtype, torch.dtype) else None


def _lazy_gradients(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None) -> None:
    """Horovod's side effect on an optimizer with no state yet: every parameter that requires a
    gradient gets a zero one (sparse for SparseAdam, and for SGD on a sparse embedding of `model`);
    the others keep theirs (None). Horovod then takes a local step on them to create the state, which
    counts a step and changes the state (horovod#2805), and with weight decay the parameters too:
    here the state comes from the root instead."""
    sparse = {id(p) for m in (model.modules() if model is not None else ()) if isinstance(m, torch.nn.Embedding)
              and m.sparse for p in m.parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
                if isinstance(optimizer, torch.optim.SparseAdam) or (
                        isinstance(optimizer, torch.optim.SGD) and id(p) in sparse):
                    p.grad = p.grad.to_sparse()


def _layout(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> dict[str, Any]:
    """The root's hyper-parameters, the size of each group, and its state: per parameter and key,
    a tensor's dtype, shape and place (CPU or the parameter's device) or a plain value."""
    groups, state = [], []
    for group in optimizer.param_groups:
        settings = {k: v for k, v in group.items() if k != "params"}
        for key, value in settings.items():
            try:
                dumps(value)
            except TypeError as exc:
                return {"error": f"hyper-parameter {key!r}: {exc}"}
        groups.append(settings)
    for index, param in enumerate(params):
        for key, value in optimizer.state.get(param, {}).items():
            if torch.is_tensor(value):
                name = str(value.dtype).removeprefix("torch.")
                place = "cpu" if value.device.type == "cpu" else "param"
                state.append([index, key, "tensor", name, list(value.shape), place])
                continue
            try:
                dumps(value)
            except TypeError as exc:
                return {"error": f"state {key!r} of parameter {index}: {exc}"}
            state.append([index, key, "value", value, [], ""])
    return {"groups": groups, "sizes": [len(g["params"]) for g in optimizer.param_groups], "state": state}


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              model: torch.nn.Module | None = None) -> None:
    """Give every worker `root_rank`'s optimizer state and hyper-parameters, as Horovod's does: after
    it, every rank's `optimizer.state_dict()` equals the root's, tensors and plain values alike (types
    kept: a step count stays an int or a tensor, betas a tuple). The root's layout goes first, as an
    object, so a rank with no state yet (a checkpoint loaded on the root only) takes it in full, and
    state the root lacks is dropped. As in Horovod, a rank whose state is empty gives each parameter
    that requires a gradient a zero one (parameters that do not keep None); LBFGS raises ValueError.
    `model` is Horovod's argument (it marks sparse embeddings, whose zero gradients are sparse)."""
    from sluice.worker.torch.state import require

    if isinstance(optimizer, torch.optim.LBFGS):
        raise InvalidCallError("cannot broadcast torch.optim.LBFGS state")
    synchronize_parameters()  # updates still in flight (worker.overlap_step) land in the state first
    if len(optimizer.state) == 0:
        _lazy_gradients(optimizer, model)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    root = require().rank == root_rank
    layout = broadcast_object(_layout(optimizer, params) if root else None, root_rank, "optimizer.layout")
    if "error" in layout:
        raise InvalidCallError(f"broadcast_optimizer_state: rank {root_rank}'s optimizer cannot be sent: "
                               f"{layout['error']}")
    sizes = [len(g["params"]) for g in optimizer.param_groups]
    problem = None if sizes == layout["sizes"] else (f"rank {require().rank}'s optimizer has parameter groups of "
                                                     f"sizes {sizes}, rank {root_rank}'s {layout['sizes']}")
    unknown = [value for _, _, kind, value, *_ in layout["state"] if kind == "tensor" and _dtype(value) is None]
    if unknown and problem is None:
        problem = f"rank {require().rank}'s torch has no dtype {str(unknown[0])[:40]!r}"
    problems = [p for p in allgather_object(problem, "optimizer.layout.check") if p is not None]
    if problems:  # every rank raises, so none is left waiting in the broadcasts below
        raise InvalidCallError(f"broadcast_optimizer_state: {problems[0]}")
    if root:  # the root's own objects stay as they are
        broadcast_parameters([(f"optimizer.state{i}.{k}", optimizer.state[params[i]][k])
                              for i, k, kind, *_ in layout["state"] if kind == "tensor"], root_rank)
        return
    for group, settings in zip(optimizer.param_groups, layout["groups"], strict=True):
        for key, value in settings.items():
            current = group.get(key)
            if torch.is_tensor(value) and torch.is_tensor(current):
                value = value.to(current.device)
            group[key] = value
    wanted: dict[int, set[Any]] = {}
    tensors: list[tuple[str, torch.Tensor]] = []
    for index, key, kind, value, shape, place in layout["state"]:
        param = params[index]
        wanted.setdefault(index, set()).add(key)
        state = optimizer.state[param]
        if kind == "value":
            state[key] = value
            continue
        dtype = _dtype(value)
        device = torch.device("cpu") if place == "cpu" else param.device
        held = state.get(key)
        if not (torch.is_tensor(held) and held.dtype == dtype and list(held.shape) == shape
                and held.device == device):
            held = state[key] = torch.zeros(shape, dtype=dtype, device=device)
        tensors.append((f"optimizer.state{index}.{key}", held))
    for index, param in enumerate(params):  # state the root does not have
        if index not in wanted:
            optimizer.state.pop(param, None)
            continue
        for key in [k for k in optimizer.state[param] if k not in wanted[index]]:
            del optimizer.state[param][key]
    broadcast_parameters(tensors, root_rank)
