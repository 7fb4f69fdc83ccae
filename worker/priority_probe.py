"""Priority probe: finds when the forward pass first needs each parameter, for worker/plan/priority.py.

Two ways, both giving name -> first-use time for `priority_map`:

- `graph_ops` traces the model with torch.fx (no data runs) into the planner's `Op` list, so the
  planner's ASAP schedule sees branches: a side branch fed only by the graph inputs starts at time 0.
  fx cannot trace data-dependent control flow (`if x.sum() > 0:`); it returns None there.
- `ForwardRecorder` watches one real forward pass through a global module forward pre-hook and
  numbers parameters in the order their modules are entered. It works on any model, but sees the
  order of one run (no branch timing), and credits a module's direct parameters at the module's
  entry even when its forward uses them late.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from sluice.worker.plan.priority import Op, first_use_times

log = logging.getLogger("sluice.worker")


def names_by_id(model: torch.nn.Module) -> dict[int, str]:
    """id(parameter) -> its name as `model.named_parameters()` gives it (a shared one: its first name)."""
    return {id(param): name for name, param in model.named_parameters()}


def _fetch(model: torch.nn.Module, target: str) -> object:
    value: object = model
    for part in target.split("."):
        value = getattr(value, part)
    return value


def graph_ops(model: torch.nn.Module) -> list[Op] | None:
    """The model's forward graph as planner ops (cost 1 each), or None when fx cannot trace it."""
    try:
        graph = torch.fx.symbolic_trace(model).graph
    except Exception as exc:  # fx fails in many ways (TraceError, TypeError, ...): all mean "use the recorder"
        log.debug("fx cannot trace %s, no graph priorities: %s: %s", type(model).__name__, type(exc).__name__, exc)
        return None

    canonical = names_by_id(model)
    ops: list[Op] = []
    op_index: dict[torch.fx.Node, int] = {}
    # get_attr nodes are not ops: the parameter they fetch is credited to each op that uses the value
    attr_param: dict[torch.fx.Node, str] = {}
    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "get_attr":
            name = canonical.get(id(_fetch(model, str(node.target))))
            if name is not None:
                attr_param[node] = name
            continue
        params: dict[str, None] = {}  # an ordered set: one entry per parameter, in first-seen order
        if node.op == "call_module":
            params.update((canonical[id(p)], None) for p in model.get_submodule(str(node.target)).parameters())
        inputs: dict[int, None] = {}
        for arg in node.all_input_nodes:
            if arg in op_index:
                inputs[op_index[arg]] = None
            elif arg in attr_param:
                params[attr_param[arg]] = None
        op_index[node] = len(ops)
        ops.append(Op(node.name, tuple(inputs), tuple(params)))
    return ops


def first_use_from_model(model: torch.nn.Module) -> dict[str, float] | None:
    """ASAP first-use time of each parameter the traced forward pass uses; None when fx cannot trace."""
    ops = graph_ops(model)
    return None if ops is None else first_use_times(ops)


class ForwardRecorder:
    """Numbers parameters in the order a forward pass enters their modules (0, 1, 2, ...).

    Holds only ids and names, never the model or its parameters, so it keeps nothing alive; no hook
    is installed outside start()..stop(), so it costs nothing when not recording.
    """

    def __init__(self, names: Mapping[int, str]) -> None:
        self._names = dict(names)
        self._order: dict[str, float] = {}
        self._handle: RemovableHandle | None = None

    def start(self) -> None:
        """Install the hook and begin a fresh recording (no-op while already recording)."""
        if self._handle is not None:
            return
        self._order = {}
        self._handle = torch.nn.modules.module.register_module_forward_pre_hook(self._enter)

    def stop(self) -> dict[str, float]:
        """Remove the hook; name -> sequence number of every parameter seen."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        return dict(self._order)

    def seen(self) -> int:
        return len(self._order)

    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        order = self._order
        if len(order) == len(self._names):  # all recorded: the rest of the pass costs one comparison a module
            return
        for param in module._parameters.values():
            if param is None:
                continue
            name = self._names.get(id(param))
            if name is not None and name not in order:
                order[name] = float(len(order))
