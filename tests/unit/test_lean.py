"""Lean saves (worker/torch/lean.py): ReLUs and max-pools save a bitmask and indices, with torch's gradients bit
for bit (NaN, -0.0 and infinite gradients included), and everything else runs unchanged."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from sluice.worker.torch.lean import _index_dtype, lean_saves  # noqa: E402
from sluice.worker.torch.offload import offloaded  # noqa: E402
from sluice.worker.torch.tensor_zvc import pack_bits, shift_pack, shift_unpack, unpack_bits  # noqa: E402


def grads(run: Callable[[Any], Any], x: Any, upstream: Any, lean: bool) -> tuple[Any, Any, int, int]:
    """The output, the input's gradient, the lean calls, and the bytes kept for backward (by an offloader that
    only counts: each tensor once, however many operations saved it)."""
    source = x.detach().clone().requires_grad_(True)
    with offloaded(compress=False, min_bytes=0, lean=lean) as stats:
        out = run(source.clone())  # not a leaf: the offloader leaves leaves that need gradients alone
    out.backward(upstream)
    return out.detach(), source.grad, stats.lean, stats.raw_bytes


def special(shape: tuple[int, ...], seed: int) -> Any:
    """Random values with zeros, -0.0, NaN and infinities among them."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=generator)
    flat = values.view(-1)
    flat[::7] = 0.0
    flat[1::11] = -0.0
    flat[2::13] = float("nan")
    flat[3::17] = float("inf")
    flat[4::19] = -float("inf")
    return values


def same(a: Any, b: Any) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("call", [F.relu, torch.relu, torch.Tensor.relu, lambda x: F.relu(x, False),
                                  lambda x: F.relu(x, inplace=False), torch.nn.ReLU()])
def test_relu_saves_one_bit_per_element_and_gradients_match(call: Any) -> None:
    x, upstream = special((4, 6, 9, 11), 0), special((4, 6, 9, 11), 1)
    out, grad, _, torch_bytes = grads(call, x, upstream, lean=False)
    lean_out, lean_grad, replaced, lean_bytes = grads(call, x, upstream, lean=True)
    assert replaced == 1 and same(out, lean_out) and same(grad, lean_grad)
    assert torch_bytes == 4 * x.numel() and lean_bytes == (x.numel() + 7) // 8


@pytest.mark.parametrize("shape, options", [
    ((2, 3, 8, 8), {"kernel_size": 2}),
    ((2, 3, 9, 7), {"kernel_size": 3, "stride": 2, "padding": 1}),
    ((2, 3, 11, 10), {"kernel_size": (3, 2), "stride": (2, 1), "dilation": 2, "ceil_mode": True}),
    ((3, 10, 10), {"kernel_size": 3, "stride": 1}),  # no batch dimension; overlapping windows add up
])
def test_max_pool_saves_only_indices_and_gradients_match(shape: tuple[int, ...], options: dict[str, Any]) -> None:
    x = special(shape, 2).nan_to_num(posinf=3.0, neginf=-3.0)  # NaN windows are torch's own business
    upstream = torch.randn(F.max_pool2d(x, **options).shape, generator=torch.Generator().manual_seed(3))

    def pool(source: Any) -> Any:
        return F.max_pool2d(source, **options)

    out, grad, _, torch_bytes = grads(pool, x, upstream, lean=False)
    lean_out, lean_grad, replaced, lean_bytes = grads(pool, x, upstream, lean=True)
    assert replaced == 1 and same(out, lean_out) and same(grad, lean_grad)
    assert torch_bytes == 4 * x.numel() + 8 * out.numel()  # the input and int64 indices
    assert lean_bytes == out.numel()  # where in its window each maximum was: one byte


@pytest.mark.parametrize("width, kernel, itemsize", [
    (20000, 2, 2),  # a window spans 20002 elements of the plane: int16 offsets
    (20000, 3, 4),  # 40003: int32, no narrower than indices into the 60000-element plane
    (127, 2, 1),  # the last width whose 2x2 windows fit a byte
    (255, 2, 2),
])
def test_indices_narrow_as_far_as_the_plane_and_window_allow(width: int, kernel: int, itemsize: int) -> None:
    assert [_index_dtype(plane) for plane in (1, 32768, 32769, 1 << 31, (1 << 31) + 1)] == [
        torch.int16, torch.int16, torch.int32, torch.int32, torch.int64]
    x = torch.randn(1, 2, kernel, width)
    upstream = torch.randn(F.max_pool2d(x, kernel).shape)
    _, grad, _, _ = grads(lambda s: F.max_pool2d(s, kernel), x, upstream, lean=False)
    _, lean_grad, _, lean_bytes = grads(lambda s: F.max_pool2d(s, kernel), x, upstream, lean=True)
    assert torch.equal(grad, lean_grad) and lean_bytes == itemsize * upstream.numel()


@pytest.mark.parametrize("options", [{"kernel_size": 2}, {"kernel_size": 3, "stride": 1, "padding": 1},
                                     {"kernel_size": (3, 2), "stride": 2, "dilation": 2, "ceil_mode": True}])
def test_a_relu_before_a_max_pool_keeps_nothing_and_gradients_match(options: dict[str, Any]) -> None:
    """The max-pool masks the gradient where its output is not positive; the ReLU keeps nothing."""
    x = special((3, 4, 11, 12), 4)
    upstream = special(F.max_pool2d(x, **options).shape, 5)

    def block(source: Any) -> Any:
        return F.max_pool2d(F.relu(source), **options)

    out, grad, _, _ = grads(block, x, upstream, lean=False)
    lean_out, lean_grad, replaced, lean_bytes = grads(block, x, upstream, lean=True)
    assert replaced == 2 and same(out, lean_out) and same(grad, lean_grad)
    assert lean_bytes == out.numel() + (out.numel() + 7) // 8  # byte offsets, a bitmask of the pooled output


@pytest.mark.parametrize("after", [
    lambda r, p: torch.cat([p.flatten(), r.flatten()]),  # a second call takes the ReLU's output
    lambda r, p: torch.cat([p.flatten(), (r * 2).flatten()]),  # one that saves it too
])
def test_a_relu_output_taken_after_its_max_pool_is_masked_again(after: Any) -> None:
    x = special((2, 3, 8, 8), 6)
    upstream = special((2 * 3 * 4 * 4 + x.numel(),), 7)

    def block(source: Any) -> Any:
        relu = F.relu(source)
        return after(relu, F.max_pool2d(relu, 2))

    out, grad, _, _ = grads(block, x, upstream, lean=False)
    lean_out, lean_grad, _, _ = grads(block, x, upstream, lean=True)
    assert same(out, lean_out) and same(grad, lean_grad)


@pytest.mark.parametrize("after, kept", [
    # the max-pool's byte offsets (96) and the bitmask of its output (12), which flatten does not save
    (lambda r, p: p if r.dim() == 4 and r.shape[1] == 3 else None, 96 + 12),  # .dim(), .shape: no call
    # a second lean max-pool masks too (offsets 216, bitmask 27): the ReLU still keeps nothing
    (lambda r, p: torch.cat([p.flatten(), F.max_pool2d(r, 3, 1).flatten()]), 96 + 12 + 216 + 27),
    # an addition takes the output: the ReLU keeps its bitmask (48); the max-pool after it has no mask
    (lambda r, p: torch.cat([p.flatten(), F.max_pool2d(r + 0, 3, 1).flatten()]), 96 + 12 + 48 + 216),
])
def test_what_else_takes_a_relu_output_after_its_max_pool(after: Any, kept: int) -> None:
    x = special((2, 3, 8, 8), 9)

    def block(source: Any) -> Any:
        relu = F.relu(source)
        return after(relu, F.max_pool2d(relu, 2))

    upstream = special(block(x).shape, 10)
    out, grad, _, _ = grads(block, x, upstream, lean=False)
    lean_out, lean_grad, _, lean_bytes = grads(block, x, upstream, lean=True)
    assert same(out, lean_out) and same(grad, lean_grad)
    assert lean_bytes == kept


def test_a_relu_output_alive_after_the_block_keeps_its_bitmask() -> None:
    """What takes the output next, outside the block, is not watched: the ReLU masks its gradient too."""
    x, expected = special((2, 3, 8, 8), 8), []
    for block in (contextlib.nullcontext, lean_saves, offloaded):
        source = x.clone().requires_grad_(True)
        with block():
            relu = F.relu(source * 1)
            pooled = F.max_pool2d(relu, 2)
        (pooled.sum() + (relu * relu).sum()).backward()
        expected.append(source.grad)
    assert same(expected[0], expected[1]) and same(expected[0], expected[2])


def test_a_relu_output_changed_in_place_after_its_max_pool_is_refused() -> None:
    source = torch.randn(2, 3, 8, 8, requires_grad=True)
    with lean_saves():
        relu = F.relu(source * 1)
        pooled = F.max_pool2d(relu, 2)
        relu.mul_(-1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (pooled.sum() + relu.sum()).backward()


@pytest.mark.parametrize("after, tensors, bitmask", [
    (lambda r, conv: conv(r), 1, 0),  # the convolution saves the output: the ReLU shares it, no bitmask
    (lambda r, conv: conv(r) if r.dim() == 4 and r.shape[1] == 3 else None, 1, 0),  # .dim(), .shape: no call
    (lambda r, conv: conv(r + 0), 2, 1),  # the first call that takes it does not save it: a bitmask
])
def test_a_relu_shares_an_output_that_the_next_call_saves(after: Any, tensors: int, bitmask: int) -> None:
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 4, 3)
    x, upstream = torch.randn(2, 3, 8, 8), torch.randn(2, 4, 6, 6)
    out, grad, _, torch_bytes = grads(lambda s: after(F.relu(s), conv), x, upstream, lean=False)
    lean_out, lean_grad, replaced, lean_bytes = grads(lambda s: after(F.relu(s), conv), x, upstream, lean=True)
    assert replaced == 1 and same(out, lean_out) and same(grad, lean_grad)
    assert torch_bytes == tensors * 4 * x.numel()  # torch: the ReLU's output, saved by the ReLU and the conv
    assert lean_bytes == 4 * x.numel() + bitmask * (x.numel() + 7) // 8  # what the conv saves, and a bitmask


def test_channels_last_pooling_keeps_its_layout() -> None:
    x = torch.randn(2, 4, 8, 8).to(memory_format=torch.channels_last)
    upstream = torch.randn(2, 4, 4, 4)
    _, grad, _, _ = grads(lambda s: F.max_pool2d(s, 2), x, upstream, lean=False)
    _, lean_grad, replaced, _ = grads(lambda s: F.max_pool2d(s, 2), x, upstream, lean=True)
    assert replaced == 1 and torch.equal(grad, lean_grad)
    assert lean_grad.is_contiguous(memory_format=torch.channels_last) == grad.is_contiguous(
        memory_format=torch.channels_last)


def test_a_cnn_trains_identically_and_keeps_less() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                                torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3),
                                torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Linear(8 * 16, 3))
    x = torch.randn(5, 3, 20, 20)
    results = []
    for lean in (False, True):
        model.zero_grad(set_to_none=True)
        _, _, replaced, saved = grads(model, x, torch.ones(5, 3), lean)
        results.append(([p.grad.clone() for p in model.parameters()], replaced, saved))
    (plain, _, plain_bytes), (ours, replaced, lean_bytes) = results
    assert replaced == 5 and all(torch.equal(a, b) for a, b in zip(plain, ours, strict=True))
    assert lean_bytes < 0.7 * plain_bytes, (lean_bytes, plain_bytes)


def test_what_is_not_lean_runs_unchanged() -> None:
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    with lean_saves() as mode:
        F.relu(x.clone(), inplace=True)  # in place: torch's own
        torch.relu_(x.clone())
        F.max_pool2d(x, 2, return_indices=True)  # the caller wants the indices
        F.max_pool1d(x[0], 2)
        with torch.no_grad():
            F.relu(x)
        F.relu(x.detach())  # nothing to save
        F.leaky_relu(x)
        F.relu(x.to_sparse())  # not a dense tensor
    assert mode.replaced == 0


@pytest.mark.parametrize("change", [lambda r: r.mul_(-1), lambda r: F.dropout(r, 0.5, True, True)])
def test_an_output_changed_in_place_is_refused_as_torch_refuses_it(change: Any) -> None:
    """Torch refuses a backward through a ReLU whose output changed in place (its version counter moved);
    so does a lean ReLU, whatever its choice would have been."""
    for block in (contextlib.nullcontext, lean_saves, offloaded):
        source = torch.randn(4, 8, requires_grad=True)
        with block():
            out = F.relu(source * 1)
            change(out)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()


def test_second_derivatives_match() -> None:
    x = torch.randn(2, 2, 6, 6, dtype=torch.float64, requires_grad=True)
    with lean_saves():
        assert torch.autograd.gradgradcheck(lambda s: F.max_pool2d(F.relu(s), 2) ** 2, (x,))


@pytest.mark.parametrize("count", [0, 1, 7, 8, 9, 1001])
def test_bits_pack_alike_with_numpy_and_torch(count: int) -> None:
    mask = torch.rand(count, generator=torch.Generator().manual_seed(count)) > 0.5
    bits = pack_bits(mask)
    assert bits.dtype == torch.uint8 and bits.numel() == (count + 7) // 8
    assert torch.equal(bits, shift_pack(mask))  # a GPU's path, run here on the CPU
    shape = torch.Size([count])
    assert torch.equal(unpack_bits(bits, shape), mask.to(torch.uint8))
    assert torch.equal(shift_unpack(bits, shape), mask.to(torch.uint8))


@pytest.mark.parametrize("compress", [False, None])
def test_what_lean_saves_share_is_freed_with_the_graph_without_the_garbage_collector(compress: Any) -> None:
    """A ReLU or max-pool sharing its output's entry must not make a cycle through the graph."""
    import gc

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                                torch.nn.Conv2d(8, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3))
    gc.disable()
    try:
        with offloaded(compress=compress, min_bytes=0) as stats:
            loss = model(torch.randn(2, 3, 20, 20)).sum()
        loss.backward()
        del loss
        assert stats.peak_bytes > 0 and stats.held_bytes == 0, stats
    finally:
        gc.enable()
