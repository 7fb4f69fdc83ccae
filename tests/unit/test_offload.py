"""Offload of saved activations (worker/torch/offload.py): bit-exact gradients, compression, what is packed."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

from sluice.worker.torch.offload import Offloader, OffloadStats, offloaded  # noqa: E402
from sluice.worker.torch.tensor_zvc import (  # noqa: E402
    decode_tensor,
    encode_tensor,
    estimated_saving,
    pack_nonzeros,
    unpack_nonzeros,
)


def cnn() -> Any:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(32 * 8 * 8, 10))


def gradients(model: Any, x: Any, block: Callable[[], Any]) -> tuple[list[Any], Any]:
    model.zero_grad(set_to_none=True)
    with block() as stats:
        loss = model(x).square().sum()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()], stats


@pytest.mark.parametrize("options", [{}, {"prefetch": 2}, {"compress": False}, {"min_bytes": 0}])
def test_gradients_are_bit_identical_and_activations_shrink(options: dict[str, Any]) -> None:
    """ZVC alone (no lean saves, every tensor encoded): ReLU outputs are about half zeros."""
    model, x = cnn(), torch.randn(8, 3, 32, 32)
    plain, _ = gradients(model, x, contextlib.nullcontext)
    ours, stats = gradients(model, x, lambda: offloaded(**options, lean=False, min_saving=0))
    assert all(torch.equal(a, b) for a, b in zip(plain, ours, strict=True))
    assert isinstance(stats, OffloadStats) and stats.packed >= 5
    if options.get("compress", True):
        assert stats.stored_bytes < 0.75 * stats.raw_bytes, stats  # ReLU outputs are about half zeros
        assert stats.ratio > 1.3 and 0.25 < stats.memory_saved < 1
    else:
        assert stats.stored_bytes == stats.raw_bytes
    assert stats.held_bytes == 0 and stats.peak_bytes > 0  # the graph is gone, and so is what it saved
    # on a CPU nothing is decoded ahead unless asked: the decode thread competes with the model for cores
    assert (stats.prefetched > 0) == ("prefetch" in options and options.get("compress", True))


def test_lean_saves_and_skipped_dense_tensors_keep_gradients_exact_and_hold_less() -> None:
    """The defaults: ReLUs and max-pools save bits and window offsets (lean) and nothing is ZVC-encoded on a
    CPU; with `compress`, ZVC too, but not on the max-pools' outputs, about 94% non-zero (min_saving). Both
    hold less at peak than ZVC on everything torch saves."""
    model, x = cnn(), torch.randn(8, 3, 32, 32)
    plain, _ = gradients(model, x, contextlib.nullcontext)
    ours, stats = gradients(model, x, offloaded)
    both, zvc_too = gradients(model, x, lambda: offloaded(compress=True))
    _, zvc_only = gradients(model, x, lambda: offloaded(lean=False, min_saving=0))
    assert all(torch.equal(a, b) for a, b in zip(plain, ours, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(plain, both, strict=True))
    assert stats.lean == zvc_too.lean == 4 and zvc_only.lean == 0
    assert stats.stored_bytes == stats.raw_bytes and zvc_too.stored_bytes < zvc_too.raw_bytes  # ZVC ran
    assert zvc_too.peak_bytes < stats.peak_bytes < 0.8 * zvc_only.peak_bytes, (stats, zvc_too, zvc_only)
    assert zvc_too.kept > zvc_only.kept  # the dense ones
    assert stats.held_bytes == zvc_too.held_bytes == 0


def test_parameters_are_never_packed() -> None:
    model, x = cnn(), torch.randn(4, 3, 32, 32)
    parameters = {p.data_ptr() for p in model.parameters()}
    offloader, packed, passed = Offloader(min_bytes=0), [], []

    def spy(tensor: Any) -> Any:
        result = offloader.pack(tensor)
        (passed if result is tensor else packed).append(tensor.data_ptr())
        return result

    with torch.autograd.graph.saved_tensors_hooks(spy, offloader.unpack):
        loss = model(x).sum()  # linear saves its weight as a transposed view: passed through too
    loss.backward()
    assert packed and not parameters & set(packed)
    assert {p.data_ptr() for name, p in model.named_parameters() if name.endswith("weight")} <= set(passed)


def test_a_tensor_saved_twice_is_stored_once() -> None:
    x = torch.randn(64, 1024, requires_grad=True)
    with offloaded(min_bytes=0) as stats:
        y = torch.relu(x * 2)  # relu saves y, and y * y saves it twice more
        loss = (y * y).sum()
    assert stats.packed == 1 and stats.raw_bytes == y.numel() * 4
    loss.backward()
    assert x.grad is not None and torch.equal(x.grad, 8 * x.detach() * (x.detach() > 0))


def acted(stats: OffloadStats) -> int:
    """Tensors the hooks packed (encoded or kept) and the lean calls: what a block did at all."""
    return stats.packed + stats.kept + stats.lean


def test_nested_and_no_grad_blocks() -> None:
    model, x = cnn(), torch.randn(4, 3, 32, 32)
    plain, _ = gradients(model, x, contextlib.nullcontext)
    model.zero_grad(set_to_none=True)
    with offloaded() as outer:
        with torch.no_grad(), offloaded() as idle:
            model(x)  # nothing is saved without grad
        with offloaded() as inner:
            hidden = model[:3](x)
        loss = model[3:](hidden).square().sum()
    loss.backward()
    assert acted(idle) == 0 and acted(inner) > 0 and acted(outer) > 0
    assert all(torch.equal(a, p.grad) for a, p in zip(plain, model.parameters(), strict=True))


def test_an_exception_inside_the_block_restores_the_hooks() -> None:
    model, x = cnn(), torch.randn(4, 3, 32, 32)
    with pytest.raises(RuntimeError, match="boom"), offloaded() as stats:
        model(x)
        raise RuntimeError("boom")
    count = acted(stats)
    loss = model(x).sum()  # outside the block: saved as usual, by torch's own ReLUs and pools
    loss.backward()
    assert acted(stats) == count > 0 and stats.lean == 4


def test_bfloat16_and_integer_tensors_round_trip() -> None:
    x = torch.randn(256, 256, dtype=torch.bfloat16, requires_grad=True)
    with offloaded(min_bytes=0) as stats:
        loss = torch.relu(x).float().square().sum()
    loss.backward()
    expected = (2 * torch.relu(x.detach()).float()).to(torch.bfloat16)
    assert stats.packed >= 1 and x.grad is not None and torch.equal(x.grad, expected)
    indices = torch.arange(0, 70000, dtype=torch.int64).reshape(70, 1000)  # needs int32, not int16
    values = torch.randn(70000, requires_grad=True)
    with offloaded(min_bytes=0):
        picked = values.take(indices)  # take saves its int64 indices
    picked.sum().backward()
    assert values.grad is not None and torch.equal(values.grad, torch.ones(70000))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64])
@pytest.mark.parametrize("size", [0, 1, 7, 8, 9, 1000])
def test_the_device_packer_round_trips_bit_for_bit(dtype: Any, size: int) -> None:
    """pack_nonzeros / unpack_nonzeros (what a GPU runs before and after its copies) on CPU tensors: odd
    sizes, -0.0 and NaN keep their bits; the mask takes ceil(n / 8) bytes and the values only non-zeros."""
    generator = torch.Generator().manual_seed(size)
    x = (torch.randn(size, generator=generator) * 50).relu().to(dtype)
    if size > 4 and dtype.is_floating_point:
        x[1], x[2] = -0.0, float("nan")
    bits, values = pack_nonzeros(x)
    assert bits.dtype == torch.uint8 and bits.numel() == (size + 7) // 8
    assert values.numel() == int((x != 0).sum()) + (1 if size > 4 and dtype.is_floating_point else 0)  # -0.0
    back = unpack_nonzeros(bits, values, x.shape, x.dtype)
    assert back.dtype == dtype and back.shape == x.shape
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    assert torch.equal(back.view(ints), x.view(ints))


def test_bad_options_are_refused() -> None:
    with pytest.raises(ValueError, match="min_bytes"), offloaded(min_bytes=-1):
        pass
    with pytest.raises(ValueError, match="min_saving"), offloaded(min_saving=1.5):
        pass


def test_the_saving_estimate_decides_what_is_encoded() -> None:
    generator = torch.Generator().manual_seed(0)
    dense = torch.randn(100_000, generator=generator)
    half = dense.relu()
    indices = torch.randint(0, 1000, (100_000,), generator=generator)  # narrowed to int16: 3/4 saved
    assert estimated_saving(dense, dense.dtype) == 0
    assert abs(estimated_saving(half, half.dtype) - (1 - 1 / 32 - 0.5)) < 0.03
    assert estimated_saving(indices, torch.int16) == 0.75
    assert encode_tensor(dense, min_saving=0.2) is None and encode_tensor(half, min_saving=0.2) is not None
    assert encode_tensor(dense) is not None  # without a floor, always a frame (here a raw one)
    encoded = encode_tensor(indices, threads=2, min_saving=0.5)
    assert encoded is not None and encoded[1] == torch.int16
    assert torch.equal(decode_tensor(*encoded[:1], indices.shape, encoded[1], torch.int64, threads=2), indices)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@CUDA
@pytest.mark.parametrize("compress", [True, False])
@pytest.mark.parametrize("prefetch", [None, 0, 5])
def test_cuda_gradients_are_bit_identical(compress: bool, prefetch: int | None) -> None:
    model, x = cnn().cuda(), torch.randn(8, 3, 32, 32, device="cuda")
    torch.backends.cudnn.deterministic = True
    plain, _ = gradients(model, x, contextlib.nullcontext)
    ours, stats = gradients(model, x, lambda: offloaded(compress=compress, min_bytes=0, prefetch=prefetch,
                                                        lean=False))
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(plain, ours, strict=True))
    assert stats.packed >= 5
    # by default (None) two GPU tensors come back ahead of each one backward unpacks: all but the first
    assert (stats.prefetched >= stats.packed - 2) if prefetch != 0 else stats.prefetched == 0, stats
    if compress:
        assert stats.stored_bytes < 0.75 * stats.raw_bytes, stats


@CUDA
def test_cuda_lean_saves_are_exact_and_copy_fewer_bytes() -> None:
    """On a GPU the ReLUs' bitmasks are packed by torch's shifts and the max-pools' indices narrowed to int16,
    both without waiting for the GPU; gradients stay bit-identical and fewer bytes go to the host."""
    model, x = cnn().cuda(), torch.randn(8, 3, 32, 32, device="cuda")
    torch.backends.cudnn.deterministic = True
    plain, _ = gradients(model, x, contextlib.nullcontext)
    ours, lean = gradients(model, x, lambda: offloaded(min_bytes=0))
    _, whole = gradients(model, x, lambda: offloaded(min_bytes=0, lean=False))
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(plain, ours, strict=True))
    assert lean.lean == 4 and lean.raw_bytes < 0.6 * whole.raw_bytes, (lean, whole)


@CUDA
def test_cuda_offload_moves_activations_off_the_gpu() -> None:
    """Peak GPU memory above the model's during a step: the activations leave the GPU during forward (the
    host keeps at most a few copies in flight, so their memory is reused) and come back a couple at a time
    in backward."""
    torch.manual_seed(0)
    layers: list[Any] = []
    for _ in range(16):
        layers += [nn.Conv2d(32, 32, 3, padding=1), nn.ReLU()]
    model, x = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), *layers).cuda(), torch.randn(32, 3, 64, 64, device="cuda")

    def peak(block: Callable[[], Any]) -> int:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        gradients(model, x, block)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    plain, ours = peak(contextlib.nullcontext), peak(lambda: offloaded(compress=False))
    assert ours < 0.4 * plain, (ours, plain)


@CUDA
def test_cuda_keep_last_leaves_the_last_tensors_on_the_gpu() -> None:
    model, x = cnn().cuda(), torch.randn(8, 3, 32, 32, device="cuda")
    torch.backends.cudnn.deterministic = True
    plain, _ = gradients(model, x, contextlib.nullcontext)
    offloader = Offloader(compress=False, min_bytes=0, keep_last=2)
    with torch.autograd.graph.saved_tensors_hooks(offloader.pack, offloader.unpack):
        loss = model(x).square().sum()
    offloader.finish()
    on_gpu = [saved for ref in offloader._order if (saved := ref()) is not None and saved.tensor is not None
              and saved.tensor.is_cuda and saved.host is None]
    assert len(on_gpu) >= 2  # the last two offloaded, besides any small tensor kept
    model.zero_grad(set_to_none=True)
    loss.backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(plain, model.parameters(), strict=True))
