"""A stage's backward in two (zero-bubble schedules): its inputs' gradient now, its weights' gradient later.

`backward_input` walks the micro-batch's autograd graph from the stage's outputs (or loss) once. The
nodes with a stage input below them make the input path; a node on it with another branch that leads
to leaves only (a Linear's matmul: one branch to its input, one to its weight and bias) is where the
weights' gradient leaves it. Autograd then computes the inputs' gradient alone (`torch.autograd.grad`
to the inputs, the graph kept): the engine skips every branch that leads to no input, and a pre-hook
on each such node keeps the gradient that reached it. `WeightGrads.run` later starts the engine once
from each of them, with the gradient kept, towards the leaves of its own branches: nothing of the
input path runs twice, and the gradients accumulate into `.grad` as a whole backward's would (the same
kernels on the same tensors: bit-identical). Where that cannot be exact (a branch shared by two such
nodes: a weight used twice in the stage) the weights' half is a backward from the outputs towards the
leaves, which runs the input path again; on a stage whose inputs need no gradient (the first) the
inputs' half is empty and the weights' half is the whole backward, as torch's stages do it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


@dataclass
class _Seed:
    """Where the weights' backward starts: a node, the gradients that reached it, the leaves below it."""

    node: Node
    leaves: list[torch.Tensor]
    grads: tuple[torch.Tensor | None, ...] | None = None


@dataclass
class WeightGrads:
    """The weights' half of one micro-batch's backward, to run once."""

    seeds: list[_Seed] = field(default_factory=list)
    #: and/or a backward from these roots (outputs or loss) with these gradients (None: a scalar's), towards
    #: `leaves` (every leaf when empty)
    roots: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor | None] = field(default_factory=list)
    leaves: list[torch.Tensor] = field(default_factory=list)

    def run(self) -> None:
        """Accumulate the weights' gradients into their `.grad` (their post-accumulate hooks fire)."""
        for seed in self.seeds:
            kept = [(GradientEdge(seed.node, i), g) for i, g in enumerate(seed.grads or ()) if g is not None]
            if kept:  # none: the inputs' backward sent no gradient this way (an output nobody used)
                torch.autograd.backward([e for e, _ in kept], [g for _, g in kept], inputs=seed.leaves)
        if self.roots:
            torch.autograd.backward(self.roots, self.grads, inputs=self.leaves or None)
        self.seeds, self.roots, self.grads, self.leaves = [], [], [], []


@functools.cache
def splittable() -> bool:
    """Whether this torch can split a backward: start the engine from a graph edge with a gradient of its
    own (torch.autograd.backward of a GradientEdge, which older releases refuse). Tried once, on a tiny graph."""
    leaf = torch.ones(1, requires_grad=True)
    try:
        torch.autograd.backward([get_gradient_edge(leaf * 2)], [torch.ones(1)], inputs=[leaf])
    except (TypeError, RuntimeError):
        return False
    return leaf.grad is not None and float(leaf.grad[0]) == 2.0


def _children(node: Node) -> list[Node]:
    return [child for child, _ in node.next_functions if child is not None]


def _input_path(roots: Sequence[Node], inputs: set[Node]) -> dict[Node, bool]:
    """Every node below `roots`, and whether a stage input lies below it (post-order, without recursion:
    a stage may be thousands of nodes deep)."""
    leads: dict[Node, bool] = {}
    stack: list[tuple[Node, bool]] = [(root, False) for root in roots]
    while stack:
        node, expanded = stack.pop()
        if node in leads:
            continue
        if not expanded:
            stack.append((node, True))
            stack.extend((child, False) for child in _children(node) if child not in leads)
            continue
        leads[node] = node in inputs or any(leads[child] for child in _children(node))
    return leads


def _claim(starts: Sequence[Node], owner: int, owners: dict[Node, int]) -> list[torch.Tensor] | None:
    """The leaves (tensors) below `starts`, whose nodes all become `owner`'s; None if another owns one."""
    leaves: list[torch.Tensor] = []
    stack = list(starts)
    while stack:
        node = stack.pop()
        held = owners.setdefault(node, owner)
        if held != owner:
            return None
        variable = getattr(node, "variable", None)  # an AccumulateGrad: a leaf's
        if isinstance(variable, torch.Tensor):
            if not any(v is variable for v in leaves):
                leaves.append(variable)
            continue
        stack.extend(child for child in _children(node) if owners.get(child) != owner)
    return leaves


def backward_input(roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                   inputs: Sequence[torch.Tensor], *,
                   whole_if_inexact: bool = False) -> tuple[list[torch.Tensor | None], WeightGrads]:
    """The gradients of `inputs` (None where none reaches one) from `roots` and their `grads` (None for a
    scalar loss), and what computes the other leaves' gradients afterwards. The graph is kept for that.
    `whole_if_inexact`: where the weights' half would run the input path again, run one whole backward
    now instead (the inputs, leaves, take their gradients in `.grad`) and leave nothing for later."""
    wanted = [x for x in inputs if x.requires_grad]
    if not wanted:
        return [None] * len(inputs), WeightGrads(roots=list(roots), grads=list(grads))
    root_nodes = [get_gradient_edge(r).node for r in roots]
    leads = _input_path(root_nodes, {get_gradient_edge(x).node for x in wanted})
    owners: dict[Node, int] = {node: -1 for node, on_path in leads.items() if on_path}
    seeds: list[_Seed] = []
    weights = WeightGrads()
    exact = True
    for node, on_path in leads.items():
        branches = [child for child in _children(node) if not leads[child]] if on_path else []
        leaves = _claim(branches, len(seeds), owners) if branches else []
        if leaves is None:
            exact = False
        elif leaves:
            seeds.append(_Seed(node, leaves))
    for index, root in enumerate(root_nodes):  # an output that no input leads to: its own gradient starts it
        if exact and not leads[root]:
            leaves = _claim([root], len(seeds) + index, owners) if root not in owners else None
            if leaves is None:
                exact = False
            else:
                weights.roots.append(roots[index])
                weights.grads.append(grads[index])
                weights.leaves += leaves
    if not exact and whole_if_inexact and all(x.is_leaf for x in wanted):
        torch.autograd.backward(list(roots), list(grads))
        return [x.grad if x.requires_grad else None for x in inputs], WeightGrads()
    if not exact:  # every leaf off the input path (the inputs have their gradients from here)
        leaves = [v for node, on_path in leads.items() if not on_path
                  and isinstance(v := getattr(node, "variable", None), torch.Tensor)]
        seeds, weights = [], WeightGrads(roots=list(roots), grads=list(grads), leaves=leaves)
    hooks = [seed.node.register_prehook(_keeper(seed)) for seed in seeds]
    try:
        got = torch.autograd.grad(list(roots), wanted, list(grads), retain_graph=True, allow_unused=True)
    finally:
        for hook in hooks:
            hook.remove()
    weights.seeds = seeds
    by_input = {id(x): g for x, g in zip(wanted, got, strict=True)}
    return [by_input.get(id(x)) for x in inputs], weights


def _keeper(seed: _Seed) -> Any:
    def keep(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        seed.grads = tuple(grad_outputs)

    return keep
