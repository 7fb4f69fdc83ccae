"""Priority planner and probe: first-use times, ranks, overrides, and what fx and the recorder see."""

from __future__ import annotations

import gc
import json
import logging
import weakref
from collections.abc import Sequence

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sluice.worker.plan.priority import Assigned, Op, describe, first_use_times, parse_overrides, priority_map, to_json
from sluice.worker.priority_probe import ForwardRecorder, first_use_from_model, graph_ops, names_by_id

pytestmark = pytest.mark.timeout(60)


def table(assigned: Sequence[Assigned]) -> dict[str, int]:
    return {a.name: a.priority for a in assigned}


def sources(assigned: Sequence[Assigned]) -> dict[str, str]:
    return {a.name: a.source for a in assigned}


# ---------------------------------------------------------------------------- pure planner
def test_chain() -> None:
    ops = [
        Op("embed", (), ("embed.w",)),
        Op("block", (0,), ("block.w", "block.b"), cost=3.0),
        Op("head", (1,), ("head.w",)),
    ]
    first = first_use_times(ops)
    assert first == {"embed.w": 0.0, "block.w": 1.0, "block.b": 1.0, "head.w": 4.0}
    assigned = priority_map(["head.w", "block.w", "block.b", "embed.w"], first)
    assert assigned == [
        Assigned("head.w", 3, "forward"),
        Assigned("block.w", 1, "forward"),
        Assigned("block.b", 2, "forward"),
        Assigned("embed.w", 0, "forward"),
    ]


def test_branches_scheduled_as_soon_as_possible() -> None:
    #   stem(0-1) -> left(1-4) --\
    #             -> right(1-2) --> join(4-5) -> tail(5-6, reuses stem.w)
    #   side(0-2) ---------------/   (fed by the graph input only: starts at 0, though listed 4th)
    ops = [
        Op("stem", (), ("stem.w",)),
        Op("left", (0,), ("left.w",), cost=3.0),
        Op("right", (0,), ("right.w",)),
        Op("side", (), ("side.w",), cost=2.0),
        Op("join", (1, 2, 3), ("join.w",)),
        Op("tail", (4,), ("tail.w", "stem.w")),
    ]
    first = first_use_times(ops)
    assert first == {"stem.w": 0.0, "left.w": 1.0, "right.w": 1.0, "side.w": 0.0, "join.w": 4.0, "tail.w": 5.0}
    names = ["stem.w", "left.w", "right.w", "side.w", "join.w", "tail.w"]
    # ties (stem/side at 0, left/right at 1) go by declaration order
    assert table(priority_map(names, first)) == {
        "stem.w": 0,
        "side.w": 1,
        "left.w": 2,
        "right.w": 3,
        "join.w": 4,
        "tail.w": 5,
    }


def test_zero_cost_ops_and_empty_graph() -> None:
    ops = [Op("view", (), ()), Op("reshape", (0,), (), cost=0.0), Op("fc", (1,), ("fc.w",))]
    assert first_use_times(ops) == {"fc.w": 1.0}
    assert first_use_times([]) == {}


def test_unused_parameters_come_after_used_ones_in_declaration_order() -> None:
    names = ["aux.w", "fc2.w", "frozen.w", "fc1.w"]
    assigned = priority_map(names, {"fc1.w": 0.0, "fc2.w": 1.0})
    assert assigned == [
        Assigned("aux.w", 2, "unused"),
        Assigned("fc2.w", 1, "forward"),
        Assigned("frozen.w", 3, "unused"),
        Assigned("fc1.w", 0, "forward"),
    ]


def test_declaration_mode() -> None:
    assigned = priority_map(["c", "a", "b"], None)
    assert assigned == [
        Assigned("c", 0, "declaration"),
        Assigned("a", 1, "declaration"),
        Assigned("b", 2, "declaration"),
    ]


def test_overrides_first_match_wins_with_exact_value() -> None:
    names = ["embed.w", "embed.b", "head.w", "head.b", "norm.w"]
    first = {"embed.w": 0.0, "embed.b": 0.0, "head.w": 2.0, "head.b": 2.0, "norm.w": 1.0}
    overrides = parse_overrides(["head.*=0", "*.b=9", "head.b=5"])
    assert overrides == [("head.*", 0), ("*.b", 9), ("head.b", 5)]
    assigned = priority_map(names, first, overrides)
    # head.b matches "head.*" first; the others keep their forward ranks, even where they now collide
    assert table(assigned) == {"embed.w": 0, "embed.b": 9, "head.w": 0, "head.b": 0, "norm.w": 2}
    assert sources(assigned) == {
        "embed.w": "forward",
        "embed.b": "override",
        "head.w": "override",
        "head.b": "override",
        "norm.w": "forward",
    }


def test_override_patterns_are_case_sensitive_and_split_at_the_last_equals() -> None:
    assert parse_overrides(["a=b=3", "layer[0-2].*=12"]) == [("a=b", 3), ("layer[0-2].*", 12)]
    assigned = priority_map(["Head.w", "head.w", "layer1.w"], None, parse_overrides(["head.*=7", "layer[0-2].*=4"]))
    assert table(assigned) == {"Head.w": 0, "head.w": 7, "layer1.w": 4}


@pytest.mark.parametrize("entry", ["noequals", "=3", "a=", "a=-1", "a=x", "a=1.5", "a= 3", "a=+3"])
def test_bad_override_entries_are_named(entry: str) -> None:
    with pytest.raises(ValueError, match="bad priority override") as info:
        parse_overrides(["ok=1", entry])
    assert repr(entry) in str(info.value)


def test_negative_override_value_rejected() -> None:
    with pytest.raises(ValueError, match=r"priority override 'a\*': priority must be >= 0, got -1"):
        priority_map(["a"], None, [("a*", -1)])


def test_duplicate_names_rejected() -> None:
    with pytest.raises(ValueError, match="must be unique; repeated: a, b"):
        priority_map(["b", "a", "c", "a", "b"], None)


@pytest.mark.parametrize(
    ("ops", "message"),
    [
        ([Op("a", (0,), ())], r"op 0 \('a'\): input 0 is not an earlier op"),
        (
            [Op("a", (), ()), Op("b", (2,), ())],
            r"op 1 \('b'\): input 2 is not an earlier op \(inputs must be in 0..0\)",
        ),
        ([Op("a", (), ()), Op("b", (-1,), ())], r"op 1 \('b'\): input -1 is not an earlier op"),
        ([Op("a", (), (), cost=-1.0)], r"op 0 \('a'\): cost must be a finite number >= 0, got -1.0"),
        ([Op("a", (), (), cost=float("nan"))], r"op 0 \('a'\): cost must be a finite number >= 0, got nan"),
    ],
)
def test_bad_graphs_rejected(ops: list[Op], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        first_use_times(ops)


def test_describe_table() -> None:
    assigned = [Assigned("fc.weight", 1, "forward"), Assigned("conv.w", 0, "override"), Assigned("aux", 1, "unused")]
    assert describe(assigned) == [
        "priority  name       source",
        "       0  conv.w     override",
        "       1  aux        unused",
        "       1  fc.weight  forward",
    ]
    assert describe(assigned, {"fc.weight": 4096, "conv.w": 12, "aux": 100000}) == [
        "priority  name        bytes  source",
        "       0  conv.w         12  override",
        "       1  aux        100000  unused",
        "       1  fc.weight    4096  forward",
    ]


def test_to_json_round_trips() -> None:
    assigned = priority_map(["w2", "w1", "spare", "b1"], {"w1": 0.0, "b1": 0.0, "w2": 1.0}, [("spare", 0)])
    document = json.loads(to_json(assigned))
    assert document == {
        "priorities": [
            {"name": "spare", "priority": 0, "source": "override"},
            {"name": "w1", "priority": 0, "source": "forward"},
            {"name": "b1", "priority": 1, "source": "forward"},
            {"name": "w2", "priority": 2, "source": "forward"},
        ]
    }
    # w1 and b1 tie at time 0: declaration order; the override lands on 0 beside w1
    assert {Assigned(**entry) for entry in document["priorities"]} == set(assigned)


# ---------------------------------------------------------------------------- torch models
def both_tables(model: nn.Module, x: torch.Tensor) -> tuple[dict[str, int], dict[str, int]]:
    """Priority tables from fx + priority_map and from ForwardRecorder + priority_map."""
    names = [name for name, _ in model.named_parameters()]
    traced = first_use_from_model(model)
    assert traced is not None
    recorder = ForwardRecorder(names_by_id(model))
    recorder.start()
    try:
        model(x)
    finally:
        recorded = recorder.stop()
    return table(priority_map(names, traced)), table(priority_map(names, recorded))


def test_sequential_cnn() -> None:
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.ReLU(), nn.Flatten(), nn.Linear(8, 2))
    assert graph_ops(model) == [
        Op("_0", (), ("0.weight", "0.bias")),
        Op("_1", (0,), ("1.weight", "1.bias")),
        Op("_2", (1,), ()),
        Op("_3", (2,), ()),
        Op("_4", (3,), ("4.weight", "4.bias")),
    ]
    expected = {"0.weight": 0, "0.bias": 1, "1.weight": 2, "1.bias": 3, "4.weight": 4, "4.bias": 5}
    assert both_tables(model, torch.zeros(1, 1, 4, 4)) == (expected, expected)


class Reordered(nn.Module):
    """Declared head, norm, body; runs body, norm, head."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 2)
        self.norm = nn.LayerNorm(8)
        self.body = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.head(torch.relu(self.norm(self.body(x))))
        return y


def test_declaration_order_differs_from_run_order() -> None:
    model = Reordered()
    names = [name for name, _ in model.named_parameters()]
    assert names == ["head.weight", "head.bias", "norm.weight", "norm.bias", "body.weight", "body.bias"]
    expected = {"body.weight": 0, "body.bias": 1, "norm.weight": 2, "norm.bias": 3, "head.weight": 4, "head.bias": 5}
    assert both_tables(model, torch.zeros(2, 4)) == (expected, expected)
    assert table(priority_map(names, None)) == {
        "head.weight": 0,
        "head.bias": 1,
        "norm.weight": 2,
        "norm.bias": 3,
        "body.weight": 4,
        "body.bias": 5,
    }


class SideBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.side = nn.Linear(4, 4)
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.out(self.b(self.a(x)) + self.side(x))
        return y


def test_side_branch_fed_by_input_ranks_with_first_layer_under_fx_only() -> None:
    traced, recorded = both_tables(SideBranch(), torch.zeros(1, 4))
    # fx: side starts at 0 with a; the recorder sees the run order a, b, side, out
    assert traced == {"a.weight": 0, "a.bias": 1, "side.weight": 2, "side.bias": 3,
                      "b.weight": 4, "b.bias": 5, "out.weight": 6, "out.bias": 7}  # fmt: skip
    assert recorded == {"a.weight": 0, "a.bias": 1, "b.weight": 2, "b.bias": 3,
                        "side.weight": 4, "side.bias": 5, "out.weight": 6, "out.bias": 7}  # fmt: skip


class Affine(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3, 4))
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight) * self.scale


class Functional(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.post = nn.Linear(3, 3)
        self.affine = Affine()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.post(self.affine(x))
        return y


def test_parameter_used_functionally() -> None:
    model = Functional()
    # get_attr nodes are not ops: each parameter is credited to the op that consumes it
    assert graph_ops(model) == [
        Op("linear", (), ("affine.weight",)),
        Op("mul", (0,), ("affine.scale",)),
        Op("post", (1,), ("post.weight", "post.bias")),
    ]
    expected = {"affine.weight": 0, "affine.scale": 1, "post.weight": 2, "post.bias": 3}
    assert both_tables(model, torch.zeros(1, 4)) == (expected, expected)


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.c = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        y: torch.Tensor = self.b(h) if x.sum() > 0 else self.c(h)
        return y


def test_untraceable_model_falls_back_to_recorder(caplog: pytest.LogCaptureFixture) -> None:
    model = Gated()
    with caplog.at_level(logging.DEBUG, logger="sluice.worker"):
        assert graph_ops(model) is None
        assert first_use_from_model(model) is None
    assert "fx cannot trace Gated" in caplog.text
    recorder = ForwardRecorder(names_by_id(model))
    recorder.start()
    model(torch.ones(1, 4))  # takes the b branch
    assert recorder.seen() == 4
    recorded = recorder.stop()
    assert recorded == {"a.weight": 0.0, "a.bias": 1.0, "b.weight": 2.0, "b.bias": 3.0}
    assigned = priority_map([name for name, _ in model.named_parameters()], recorded)
    assert table(assigned) == {"a.weight": 0, "a.bias": 1, "c.weight": 4, "c.bias": 5, "b.weight": 2, "b.bias": 3}
    assert sources(assigned)["c.weight"] == "unused"


class Tied(nn.Module):
    """out shares inp's weight; named_parameters() calls it by its first name, out.weight."""

    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(4, 4, bias=False)
        self.mid = nn.Linear(4, 4)
        self.inp = nn.Linear(4, 4, bias=False)
        self.inp.weight = self.out.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.out(self.mid(self.inp(x)))
        return y


def test_shared_parameter_keeps_its_earliest_use() -> None:
    model = Tied()
    assert graph_ops(model) == [
        Op("inp", (), ("out.weight",)),
        Op("mid", (0,), ("mid.weight", "mid.bias")),
        Op("out", (1,), ("out.weight",)),
    ]
    expected = {"out.weight": 0, "mid.weight": 1, "mid.bias": 2}
    assert both_tables(model, torch.zeros(1, 4)) == (expected, expected)


def test_recorder_hook_removed_and_model_not_kept_alive() -> None:
    hooks = torch.nn.modules.module._global_forward_pre_hooks
    before = len(hooks)
    model = Reordered()
    recorder = ForwardRecorder(names_by_id(model))
    assert recorder.stop() == {}  # never started
    recorder.start()
    recorder.start()  # already recording: one hook only
    assert len(hooks) == before + 1
    model(torch.zeros(1, 4))
    model(torch.zeros(1, 4))  # a second pass adds nothing
    assert recorder.seen() == 6
    alive = weakref.ref(model)
    gc.disable()  # the model must go by reference counting alone: no cycle through the recorder
    try:
        del model
        assert alive() is None
    finally:
        gc.enable()
    recorded = recorder.stop()
    assert len(hooks) == before
    assert recorded == {"body.weight": 0.0, "body.bias": 1.0, "norm.weight": 2.0, "norm.bias": 3.0,
                        "head.weight": 4.0, "head.bias": 5.0}  # fmt: skip
