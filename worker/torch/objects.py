"""broadcast_object and allgather_object without pickle: msgpack with three tagged extension types.

Horovod pickles (cloudpickle) the object, so a peer's bytes run code on unpickling. Here an object
is msgpack: None, bool, int, float, str, bytes, lists and dicts, plus extension types for a tuple
(code 1), a numpy array (2) and a torch tensor (3), the latter two as [dtype name, shape, raw bytes]
with the dtype from a fixed list. Anything else (a class instance, a function) is refused at the
sender with TypeError, saying what is allowed. Decoding builds only those types: no code runs.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import torch

from sluice.errors import SluiceError
from sluice.worker.torch.collectives import allgather_async, broadcast_, broadcast_parameters, synchronize
from sluice.worker.torch.state import NAMES

_TUPLE, _ARRAY, _TENSOR = 1, 2, 3
_NUMPY_DTYPES = frozenset({"bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
                           "float16", "float32", "float64", "complex64", "complex128"})
_TORCH_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.bool, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
    torch.float32, torch.float64)}


def _default(obj: Any) -> Any:
    if isinstance(obj, tuple):
        return msgpack.ExtType(_TUPLE, dumps(list(obj)))
    if isinstance(obj, np.ndarray) and obj.dtype.name in _NUMPY_DTYPES:
        body = [obj.dtype.name, list(obj.shape), np.ascontiguousarray(obj).tobytes()]
        return msgpack.ExtType(_ARRAY, dumps(body))
    if isinstance(obj, torch.Tensor):
        name = str(obj.dtype).removeprefix("torch.")
        if name not in _TORCH_DTYPES:
            raise TypeError(f"tensors of {obj.dtype} cannot be sent as objects")
        host = obj.detach().cpu().contiguous()
        raw = host.view(torch.int16) if host.dtype == torch.bfloat16 else host
        return msgpack.ExtType(_TENSOR, dumps([name, list(obj.shape), raw.numpy().tobytes()]))
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"{type(obj).__name__} cannot be sent without pickle; use None, bool, int, float, str, bytes, "
                    "list, tuple, dict, numpy arrays and torch tensors")


def dumps(obj: Any) -> bytes:
    """`obj` as msgpack bytes (TypeError for what the format cannot carry)."""
    return msgpack.packb(obj, default=_default, use_bin_type=True, strict_types=True)


def _ext(code: int, data: bytes) -> Any:
    if code == _TUPLE:
        value = loads(data)
        if not isinstance(value, list):
            raise ValueError("a tuple extension must hold a list")
        return tuple(value)
    if code not in (_ARRAY, _TENSOR):
        raise ValueError(f"unknown extension type {code}")
    body = loads(data)
    if not (isinstance(body, list) and len(body) == 3 and isinstance(body[0], str) and isinstance(body[1], list)
            and all(isinstance(d, int) and d >= 0 for d in body[1]) and isinstance(body[2], bytes)):
        raise ValueError("an array extension must be [dtype, shape, bytes]")
    name, shape, raw = body
    if code == _ARRAY:
        if name not in _NUMPY_DTYPES:
            raise ValueError(f"dtype {name[:20]!r} is not allowed")
        return np.frombuffer(raw, np.dtype(name)).reshape(shape).copy()
    if name not in _TORCH_DTYPES:
        raise ValueError(f"dtype {name[:20]!r} is not allowed")
    dtype = _TORCH_DTYPES[name]
    storage = torch.int16 if dtype == torch.bfloat16 else dtype
    flat = torch.frombuffer(bytearray(raw), dtype=storage) if raw else torch.empty(0, dtype=storage)
    return flat.view(dtype).reshape(shape)


def loads(data: bytes) -> Any:
    """The object `dumps` wrote; ValueError on anything else. Sizes are bounded by `data` itself."""
    try:
        return msgpack.unpackb(data, ext_hook=_ext, raw=False, strict_map_key=False, use_list=True)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise ValueError(f"not an object sent by broadcast_object/allgather_object: {exc}") from None


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None) -> Any:
    """`root_rank`'s object on every rank (the others' `obj` is ignored)."""
    from sluice.worker.torch.state import require

    name = name or f"broadcast_object.{next(NAMES)}"
    payload = dumps(obj) if require().rank == root_rank else b""
    length = broadcast_(torch.tensor([len(payload)], dtype=torch.int64), root_rank, f"{name}.length")
    buffer = torch.zeros(int(length.item()), dtype=torch.uint8)
    if require().rank == root_rank:
        buffer.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    broadcast_(buffer, root_rank, f"{name}.bytes")
    try:
        return loads(buffer.numpy().tobytes())
    except ValueError as exc:
        raise SluiceError(f"broadcast_object {name!r}: {exc}") from None


def allgather_object(obj: Any, name: str | None = None) -> list[Any]:
    """Every rank's object, in rank order."""
    name = name or f"allgather_object.{next(NAMES)}"
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


_PLAIN = (type(None), bool, int, float, str, tuple, list)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int) -> None:
    """Give every worker `root_rank`'s optimizer state and hyper-parameters. The root's layout (which
    state each parameter has, its shapes and dtypes, its plain values) goes first, as an object, so a
    rank with no state yet (a checkpoint loaded on the root only) takes it in full, as Horovod's does."""
    from sluice.worker.torch.state import require

    params = [p for group in optimizer.param_groups for p in group["params"]]
    layout = None
    if require().rank == root_rank:
        groups = [{k: v for k, v in g.items() if k != "params" and isinstance(v, _PLAIN)}
                  for g in optimizer.param_groups]
        state = []
        for index, param in enumerate(params):
            for key, value in sorted(optimizer.state.get(param, {}).items()):
                if torch.is_tensor(value):
                    state.append([index, key, "tensor", str(value.dtype).removeprefix("torch."), list(value.shape)])
                elif isinstance(value, _PLAIN):
                    state.append([index, key, "value", value, []])
        layout = {"groups": groups, "state": state}
    layout = broadcast_object(layout, root_rank, "optimizer.layout")
    if len(layout["groups"]) != len(optimizer.param_groups):
        raise SluiceError(f"broadcast_optimizer_state: rank {root_rank}'s optimizer has {len(layout['groups'])} "
                          f"parameter groups, this one {len(optimizer.param_groups)}")
    for group, settings in zip(optimizer.param_groups, layout["groups"], strict=True):
        group.update(settings)
    tensors: list[tuple[str, torch.Tensor]] = []
    for index, key, kind, value, shape in layout["state"]:
        param = params[index]
        state = optimizer.state[param]
        if kind == "value":
            state[key] = value
            continue
        dtype = _TORCH_DTYPES.get(value)
        if dtype is None:
            raise SluiceError(f"broadcast_optimizer_state: state {key!r} has dtype {value!r}, which cannot travel")
        held = state.get(key)
        if not torch.is_tensor(held) or held.dtype != dtype or list(held.shape) != shape:
            held = state[key] = torch.zeros(shape, dtype=dtype, device=param.device)
        tensors.append((f"optimizer.state{index}.{key}", held))
    broadcast_parameters(tensors, root_rank)
