"""Keeps one DistributedOptimizer's parameter -> priority map in force on the node.

`worker.priority` picks the source: "forward" derives the map from the torch.fx graph when the model
is given and traceable, else from the first forward pass, recorded as it runs (the first gradient
hook ends the recording, so even the first backward pass pushes with the derived priorities);
"declaration" keeps the declaration order; "none" gives every tensor the same priority (chunks are
then sent first come, first served). `worker.priority_overrides` patterns apply on top. Rank 0 logs
the map in force and writes it to `worker.priority_file` when that is set.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from sluice.errors import SluiceError
from sluice.worker.config import WorkerConfig
from sluice.worker.node import WorkerNode
from sluice.worker.plan.priority import Assigned, describe, override_for, parse_overrides, priority_map, to_json
from sluice.worker.priority_probe import ForwardRecorder, first_use_from_model, names_by_id

log = logging.getLogger("sluice.worker")


class ParameterPriorities:
    def __init__(
        self,
        node: WorkerNode,
        settings: WorkerConfig,
        named: list[tuple[str, torch.Tensor]],
        model: torch.nn.Module | None = None,
    ) -> None:
        self._node, self._settings = node, settings
        self._names = [name for name, _ in named]
        self._named = named
        self._by_id: dict[int, int] = {}
        self._sizes = {name: p.numel() * p.element_size() for name, p in named}
        try:
            self._overrides = parse_overrides(settings.priority_overrides)
        except ValueError as exc:
            raise SluiceError(f"worker.priority_overrides: {exc}") from None
        self._recorder: ForwardRecorder | None = None
        self.assigned: list[Assigned] = []
        if settings.priority == "none":
            self._apply(self._all_equal(), "every tensor equal (worker.priority = none)")
        elif settings.priority == "declaration":
            self._apply(priority_map(self._names, None, self._overrides), "declaration order")
        elif model is not None and (first_use := self._from_graph(model, named)) is not None:
            self._apply(priority_map(self._names, first_use, self._overrides), "the torch.fx graph")
        else:
            self._recorder = ForwardRecorder({id(p): name for name, p in named})
            self._recorder.start()

    def of(self, key: int) -> int:
        """The priority of the parameter with id `key` (0 until the map is made)."""
        return self._by_id.get(key, 0)

    def forward_seen(self) -> None:
        """The first forward pass is over (a gradient is ready): derive the map from what it used."""
        recorder, self._recorder = self._recorder, None
        if recorder is None:
            return
        first_use = recorder.stop()
        if not first_use:
            log.warning("the forward pass used none of the optimizer's parameters through modules; "
                        "keeping the declaration order as priorities")
            self._apply(priority_map(self._names, None, self._overrides), "declaration order")
            return
        self._apply(priority_map(self._names, first_use, self._overrides), "the first forward pass")

    def close(self) -> None:
        if self._recorder is not None:
            self._recorder.stop()
            self._recorder = None

    def _all_equal(self) -> list[Assigned]:
        assigned = []
        for name in self._names:
            override = override_for(name, self._overrides)
            assigned.append(Assigned(name, 0, "none") if override is None else Assigned(name, override, "override"))
        return assigned

    def _from_graph(self, model: torch.nn.Module, named: list[tuple[str, torch.Tensor]]) -> dict[str, float] | None:
        first_use = first_use_from_model(model)
        if first_use is None:
            return None
        ours = {id(p): name for name, p in named}
        model_names = names_by_id(model)
        return {ours[pid]: first_use[name] for pid, name in model_names.items() if pid in ours and name in first_use}

    def _apply(self, assigned: list[Assigned], how: str) -> None:
        self.assigned = assigned
        by_name = {a.name: a.priority for a in assigned}
        self._by_id = {id(p): by_name.get(name, 0) for name, p in self._named}
        # tensors the servers know by name (optimizer on the servers); fused gradients take theirs per group
        self._node.ps.set_priorities({a.name: a.priority for a in assigned if self._node.ps.declared(a.name)})
        if self._node.rank != 0:
            return
        log.info("parameter priorities from %s (0 is the most urgent):", how)
        for line in describe(assigned, self._sizes):
            log.info("  %s", line)
        if self._settings.priority_file:
            Path(self._settings.priority_file).write_text(to_json(assigned) + "\n")
            log.info("priority map written to %s", self._settings.priority_file)
