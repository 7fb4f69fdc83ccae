"""Server-side optimizers in numpy, in place, with torch.optim's exact update rules (SGD, Adam)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sluice.transport.wire import brief

State = dict[str, Any]


def _number(settings: Mapping[str, Any], name: str, default: float, low: float = 0.0) -> float:
    value = settings.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < low:
        raise ValueError(f"optimizer setting {name!r} must be a finite number >= {low}, got {brief(value)}")
    return float(value)


@dataclass(frozen=True)
class SGD:
    lr: float
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    def step(self, param: np.ndarray, grad: np.ndarray, state: State) -> None:
        """param -= lr * d, torch.optim.SGD's d; `grad` may be overwritten."""
        if self.weight_decay:
            grad += self.weight_decay * param
        if self.momentum:
            buf = state.get("momentum")
            if buf is None:
                buf = state["momentum"] = grad.copy()
            else:
                buf *= self.momentum
                buf += (1.0 - self.dampening) * grad
            if self.nesterov:
                grad += self.momentum * buf
            else:
                grad = buf
        param -= np.asarray(self.lr, dtype=param.dtype) * grad


@dataclass(frozen=True)
class Adam:
    lr: float
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0

    def step(self, param: np.ndarray, grad: np.ndarray, state: State) -> None:
        """torch.optim.Adam (no amsgrad): bias-corrected first and second moments."""
        if self.weight_decay:
            grad += self.weight_decay * param
        if "m" not in state:
            state["m"] = np.zeros_like(param)
            state["v"] = np.zeros_like(param)
            state["t"] = 0
        state["t"] += 1
        m, v, t = state["m"], state["v"], state["t"]
        m += (grad - m) * (1.0 - self.beta1)
        v *= self.beta2
        v += (1.0 - self.beta2) * grad * grad
        bias1 = 1.0 - self.beta1**t
        bias2 = 1.0 - self.beta2**t
        denom = np.sqrt(v) / math.sqrt(bias2)
        denom += self.eps
        param -= (self.lr / bias1) * m / denom


Optimizer = SGD | Adam


def make_optimizer(settings: Mapping[str, Any]) -> Optimizer:
    """An optimizer from a DECLARE/PUSH settings map such as {"name": "sgd", "lr": 0.1}."""
    name = settings.get("name")
    lr = _number(settings, "lr", -1.0)
    weight_decay = _number(settings, "weight_decay", 0.0)
    if name == "sgd":
        nesterov = settings.get("nesterov", False)
        if not isinstance(nesterov, bool):
            raise ValueError("optimizer setting 'nesterov' must be a bool")
        return SGD(lr, _number(settings, "momentum", 0.0), _number(settings, "dampening", 0.0), weight_decay, nesterov)
    if name == "adam":
        return Adam(
            lr,
            _number(settings, "beta1", 0.9),
            _number(settings, "beta2", 0.999),
            _number(settings, "eps", 1e-8),
            weight_decay,
        )
    raise ValueError(f"unknown server optimizer {brief(name)}: the servers apply 'sgd' or 'adam'")


# ---------------------------------------------------------------------- state files (ps.recover)
#: the arrays a chunk's optimizer state may hold, in the order a state file keeps them: SGD's momentum
#: (made at its first step) and Adam's moments. A job that switches optimizers may hold both kinds.
STATE_ARRAYS = ("momentum", "m", "v")
#: optimizer codes in a state file; 0 is none
_CODES: dict[type, int] = {SGD: 1, Adam: 2}
SETTINGS_COUNT = 5


def optimizer_code(optimizer: Optimizer | None) -> int:
    return 0 if optimizer is None else _CODES[type(optimizer)]


def optimizer_settings(optimizer: Optimizer | None) -> tuple[float, ...]:
    """The SETTINGS_COUNT numbers that rebuild `optimizer` with from_settings (nesterov as 0 or 1)."""
    if optimizer is None:
        return (0.0,) * SETTINGS_COUNT
    # the fields in their declared order (vars of a dataclass): astuple's deep copy costs 10x as much, per commit
    return tuple(float(value) for value in vars(optimizer).values())


def from_settings(code: int, settings: Sequence[float]) -> Optimizer | None:
    """The optimizer optimizer_code and optimizer_settings describe; ValueError for an unknown code."""
    if code == 0:
        return None
    if code == 1:
        lr, momentum, dampening, weight_decay, nesterov = settings
        return SGD(lr, momentum, dampening, weight_decay, bool(nesterov))
    if code == 2:
        return Adam(*settings)
    raise ValueError(f"unknown optimizer code {code}")


def state_bits(state: State) -> int:
    """Which STATE_ARRAYS `state` holds, one bit each (bit 0: momentum)."""
    return sum(1 << i for i, name in enumerate(STATE_ARRAYS) if name in state)


def declared_state_bits(optimizer: Optimizer | None) -> int:
    """The state_bits `optimizer` will hold once it has stepped: a state file reserves room for them up front."""
    if isinstance(optimizer, Adam):
        return 0b110
    return 0b001 if isinstance(optimizer, SGD) and optimizer.momentum else 0


def load_state(bits: int, arrays: Sequence[np.ndarray], t: int) -> State:
    """An optimizer state from copies of the arrays state_bits names, and Adam's step count `t`."""
    state: State = {name: np.array(arrays[i]) for i, name in enumerate(STATE_ARRAYS) if bits >> i & 1}
    if "m" in state:
        state["t"] = t
    return state
