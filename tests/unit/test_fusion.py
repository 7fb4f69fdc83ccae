"""The balanced fusion planner and its online split, as literal tables and on real models' shapes."""

from __future__ import annotations

import math

import pytest

from sluice.worker.plan.fusion import FusionPlan, Group, OnlineFusion, Slot, group_layout, plan_fusion

MIB = 1 << 20


def resnet50_shapes() -> list[tuple[int, ...]]:
    """torchvision's ResNet-50 parameters, in declaration (forward) order: 161 tensors."""
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    inplanes = 64
    for planes, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for block in range(blocks):
            width, out = planes, planes * 4
            shapes += [(width, inplanes, 1, 1), (width,), (width,), (width, width, 3, 3), (width,), (width,),
                       (out, width, 1, 1), (out,), (out,)]
            if block == 0:
                shapes += [(out, inplanes, 1, 1), (out,), (out,)]
            inplanes = out
    return [*shapes, (1000, 2048), (1000,)]


def bert_base_shapes() -> list[tuple[int, ...]]:
    """BERT-base's parameters in declaration order: 199 tensors."""
    hidden, inner = 768, 3072
    shapes: list[tuple[int, ...]] = [(30522, hidden), (512, hidden), (2, hidden), (hidden,), (hidden,)]
    for _ in range(12):
        shapes += [(hidden, hidden), (hidden,)] * 4 + [(hidden,), (hidden,)]
        shapes += [(inner, hidden), (inner,), (hidden, inner), (hidden,), (hidden,), (hidden,)]
    return [*shapes, (hidden, hidden), (hidden,)]


def float32_bytes(shapes: list[tuple[int, ...]]) -> list[int]:
    return [4 * math.prod(shape) for shape in shapes]


def test_a_literal_plan() -> None:
    # produced in reverse order; slots aligned to 64 bytes; 1152 bytes in 3 groups of 384
    plan = plan_fusion([100, 200, 300, 400], order=[3, 2, 1, 0], buffer_bytes=512)
    assert plan == FusionPlan(
        slots=(Slot(3, 0, 400), Slot(2, 448, 300), Slot(1, 768, 200), Slot(0, 1024, 100)),
        groups=(Group(0, 0, 384, (3,)), Group(1, 384, 768, (3, 2)), Group(2, 768, 1152, (1, 0))),
        total_bytes=1152,
    )


def test_a_groups_layout_names_its_gradients_parts_and_padding() -> None:
    # the literal plan above, in float32 elements (4 bytes): tensor 3 (100 elements) is split by the
    # first group boundary; tensor 2 starts after 12 elements of padding
    plan = plan_fusion([100, 200, 300, 400], order=[3, 2, 1, 0], buffer_bytes=512)
    shapes = [(5, 5), (50,), (3, 25), (10, 10)]
    assert [group_layout(plan, g, shapes, 4) for g in range(3)] == [
        ((96,),),  # the first 96 elements of tensor 3 (a part: its length, not its shape)
        ((4,), (12,), (3, 25), (5,)),  # its last 4, the padding, tensor 2 whole, the padding to 768
        ((50,), (14,), (5, 5), (7,)),  # tensor 1 whole, padding, tensor 0 whole, the buffer's tail
    ]
    # two ranks whose tensor 2 differs in shape but not in size differ in the layout
    assert group_layout(plan, 1, [*shapes[:2], (25, 3), shapes[3]], 4) != group_layout(plan, 1, shapes, 4)


@pytest.mark.parametrize(
    ("sizes", "buffer_bytes", "groups"),
    [
        ([64], 64, [(0, 64, (0,))]),  # exactly one buffer
        ([10, 10, 10], 1 << 20, [(0, 192, (0, 1, 2))]),  # everything fits in one group
        ([0, 64, 0], 64, [(0, 64, (0, 1, 2))]),  # empty tensors ride along where they lie
        ([256, 64], 128, [(0, 128, (0,)), (128, 256, (0,)), (256, 320, (1,))]),  # a big one is shared
        ([64] * 4, 100, [(0, 64, (0,)), (64, 128, (1,)), (128, 192, (2,)), (192, 256, (3,))]),  # 100 -> 64
    ],
)
def test_small_tables(sizes: list[int], buffer_bytes: int, groups: list[tuple[int, int, tuple[int, ...]]]) -> None:
    plan = plan_fusion(sizes, order=list(range(len(sizes))), buffer_bytes=buffer_bytes)
    assert [(g.start, g.end, g.tensors) for g in plan.groups] == groups


@pytest.mark.parametrize(("model", "count"), [(resnet50_shapes, 161), (bert_base_shapes, 199)])
@pytest.mark.parametrize("buffer_mib", [1, 4, 16, 64])
def test_real_models_are_balanced_within_the_buffer(model: object, count: int, buffer_mib: int) -> None:
    assert callable(model)
    sizes = float32_bytes(model())
    assert len(sizes) == count
    backward = list(reversed(range(len(sizes))))
    plan = plan_fusion(sizes, backward, buffer_mib * MIB)
    assert len(plan.groups) == math.ceil(plan.total_bytes / (buffer_mib * MIB))
    assert plan.balance() <= 1.2
    assert max(g.nbytes for g in plan.groups) <= buffer_mib * MIB
    # every byte in exactly one group, every tensor in a group, in backward order
    assert [(g.start, g.end) for g in plan.groups] == list(zip([0, *[g.end for g in plan.groups[:-1]]],
                                                               [g.end for g in plan.groups], strict=True))
    assert plan.groups[-1].end == plan.total_bytes
    seen = [t for g in plan.groups for t in g.tensors]
    assert sorted(set(seen)) == list(range(count))
    assert [t for i, t in enumerate(seen) if i == 0 or seen[i - 1] != t] == backward  # contiguous, in order


def test_the_same_inputs_give_the_same_plan() -> None:
    sizes = float32_bytes(bert_base_shapes())
    order = list(reversed(range(len(sizes))))
    assert plan_fusion(sizes, order, 8 * MIB) == plan_fusion(list(sizes), list(order), 8 * MIB)


def test_online_split_sends_complete_groups_and_defers_the_rest() -> None:
    plan = plan_fusion([64] * 6, order=list(range(6)), buffer_bytes=128)  # groups (0,1) (2,3) (4,5)
    online = OnlineFusion(plan)
    table = [
        # newly ready -> groups sent, deferred groups
        ([0], [], [0]),
        ([1, 2], [0], [1]),
        ([4], [], [1, 2]),
        ([3, 5], [1, 2], []),
    ]
    for ready, sent, deferred in table:
        assert [g.index for g in online.cycle(ready)] == sent
        assert online.deferred == deferred
    assert online.finish() == []
    online.next_step()
    assert [g.index for g in online.cycle(range(6))] == [0, 1, 2]


def test_a_gradient_that_never_comes_is_flushed_at_the_end_of_backward() -> None:
    plan = plan_fusion([64] * 4, order=[3, 2, 1, 0], buffer_bytes=128)  # groups (3,2) (1,0)
    online = OnlineFusion(plan)
    assert [g.tensors for g in online.cycle([3, 2, 1])] == [(3, 2)]
    assert online.deferred == [1]  # waiting for tensor 0, an unused parameter this step
    assert [g.tensors for g in online.finish()] == [(1, 0)]


@pytest.mark.parametrize(("sizes", "order", "buffer_bytes"), [([1, 2], [0, 0], 64), ([1], [0], 32), ([-1], [0], 64)])
def test_bad_inputs_are_refused(sizes: list[int], order: list[int], buffer_bytes: int) -> None:
    with pytest.raises(ValueError):
        plan_fusion(sizes, order, buffer_bytes)
