"""A server's part of a PLAN, validated: each tensor's key, name, dtype, optimizer, chunks and who pushes it."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from sluice.ps.optim import Optimizer, make_optimizer
from sluice.ps.ranked_sum import FLOAT_DTYPES
from sluice.transport.dtypes import STORAGE, SUMMABLE
from sluice.transport.wire import MAX_PAYLOAD_BYTES, WireError, brief


def optimizer_of(opt: Any, dtype: str, what: str) -> Optimizer | None:
    """The optimizer of settings from a PLAN or a PUSH (nil or empty: none), or WireError."""
    if opt is None or opt == {}:
        return None
    if type(opt) is not dict:
        raise WireError(f"optimizer settings for {what} must be a map or nil, got {brief(opt)}")
    if dtype not in FLOAT_DTYPES:
        raise WireError(f"{what} holds {dtype}: an optimizer updates floating-point tensors only")
    try:
        return make_optimizer(opt)
    except (ValueError, TypeError, AttributeError, ArithmeticError) as exc:
        raise WireError(f"bad optimizer settings for {what}: {exc}") from None


def parse_plan(tensors: Any, workers: int) -> list[tuple[int, str, str, Optimizer | None, list[tuple[int, int]],
                                                          frozenset[int] | None]]:
    """[[key, name, dtype, optimizer, [[chunk, length], ...]{, ranks}], ...] of a PLAN, validated (WireError);
    `ranks`, where present, are the process set's workers that push the tensor."""
    if type(tensors) is not list:
        raise WireError(f"a plan must be a list of tensors, got {brief(tensors)}")
    parsed = []
    for entry in tensors:
        if type(entry) is not list or len(entry) not in (5, 6):
            raise WireError(f"a plan entry must be [key, name, dtype, optimizer, chunks, ranks?], got {brief(entry)}")
        key, name, dtype, opt, chunks = entry[:5]
        members = None
        if len(entry) == 6:
            ranks = entry[5]
            if (type(ranks) is not list or not ranks or not all(type(r) is int and 0 <= r < workers for r in ranks)
                    or any(a >= b for a, b in itertools.pairwise(ranks))):
                raise WireError(f"the ranks of tensor {brief(name)} must be sorted distinct workers, got "
                                f"{brief(ranks)}")
            members = frozenset(ranks)
        if type(key) is not int or not 0 <= key < 1 << 31 or type(name) is not str:
            raise WireError(f"a plan entry needs a key in [0, 2**31) and a name: got {brief(key)}, {brief(name)}")
        if type(dtype) is not str or dtype not in SUMMABLE:
            raise WireError(f"tensor {brief(name)} of the plan has dtype {brief(dtype)}")
        optimizer = optimizer_of(opt, dtype, f"tensor {brief(name)}")
        if type(chunks) is not list:
            raise WireError(f"the chunks of tensor {brief(name)} must be a list, got {brief(chunks)}")
        itemsize = np.dtype(STORAGE[dtype]).itemsize
        pairs = []
        for pair in chunks:
            if (type(pair) is not list or len(pair) != 2 or not all(type(v) is int for v in pair)
                    or not 0 <= pair[0] < 1 << 31 or not 0 <= pair[1] * itemsize < MAX_PAYLOAD_BYTES):
                raise WireError(f"a chunk of tensor {brief(name)} must be [index, length] in range, got {brief(pair)}")
            pairs.append((pair[0], pair[1]))
        parsed.append((key, name, dtype, optimizer, pairs, members))
    return parsed
