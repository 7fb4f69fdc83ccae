"""SyncBatchNorm: batch normalisation with statistics over every worker's batch, as horovod.torch.SyncBatchNorm.

Forward: each rank computes its count, mean and sum of squared deviations per channel; one allgather
carries them (1 + 2C numbers a rank) and every rank combines them with the parallel-variance formula
(stable where sums of squares are not), so every rank normalises with the same global statistics,
even with different batch sizes (a rank with an empty batch counts for nothing). Backward: the sums
of dy and dy * (x - mean) per channel are summed over the ranks in one allreduce, which gives each
rank the exact gradient of its input under the sum of every rank's loss (as torch's own
SyncBatchNorm); the weight and bias gradients are the local ones, which DistributedOptimizer averages.
In eval mode, or alone in a job, it is torch's batch norm.
"""

from __future__ import annotations

from typing import Any

import torch

from sluice.worker.torch.collectives import Sum, allgather_async, grouped_allreduce_async_, synchronize
from sluice.worker.torch.state import require


def _combine(stats: torch.Tensor, channels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows [count, mean (C), M2 (C)] of every rank -> total count, mean and biased variance (C)."""
    counts, means, m2s = stats[:, :1], stats[:, 1 : 1 + channels], stats[:, 1 + channels :]
    total = counts.sum()
    mean = (counts * means).sum(0) / total
    m2 = m2s.sum(0) + (counts * (means - mean) ** 2).sum(0)
    return total, mean, m2 / total


class _SyncBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                module: SyncBatchNorm) -> torch.Tensor:
        channels = x.shape[1]
        dims = [0, *range(2, x.dim())]
        compute = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        xc = x.detach().to(compute)
        count = xc.numel() // channels
        if count:
            local_mean = xc.mean(dims)
            local_m2 = ((xc - local_mean.view(1, -1, *[1] * (x.dim() - 2))) ** 2).sum(dims)
        else:
            local_mean = local_m2 = torch.zeros(channels, dtype=compute)
        row = torch.cat([torch.tensor([float(count)], dtype=compute), local_mean, local_m2]).unsqueeze(0)
        total, mean, var = _combine(synchronize(allgather_async(row)), channels)
        if total < 2:
            raise ValueError(f"SyncBatchNorm needs more than one value per channel over all ranks, got {int(total)}")
        module.update_running_stats(mean, var * total / (total - 1))
        invstd = torch.rsqrt(var + eps)
        shape = [1, -1, *[1] * (x.dim() - 2)]
        xhat = (xc - mean.view(shape)) * invstd.view(shape)
        y = xhat * weight.detach().to(compute).view(shape) if weight is not None else xhat
        if bias is not None:
            y = y + bias.detach().to(compute).view(shape)
        ctx.save_for_backward(xhat, invstd, weight)
        ctx.total, ctx.has_bias, ctx.dtype = total, bias is not None, x.dtype
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> Any:
        xhat, invstd, weight = ctx.saved_tensors
        dims = [0, *range(2, dy.dim())]
        shape = [1, -1, *[1] * (dy.dim() - 2)]
        dyc = dy.to(xhat.dtype)
        sum_dy = dyc.sum(dims)
        sum_dy_xhat = (dyc * xhat).sum(dims)
        grad_weight = sum_dy_xhat.to(ctx.dtype) if weight is not None else None
        grad_bias = sum_dy.to(ctx.dtype) if ctx.has_bias else None
        both = torch.cat([sum_dy, sum_dy_xhat])
        synchronize(grouped_allreduce_async_([both], op=Sum))
        channels = sum_dy.numel()
        mean_dy, mean_dy_xhat = both[:channels] / ctx.total, both[channels:] / ctx.total
        scale = invstd if weight is None else invstd * weight.detach().to(xhat.dtype)
        dx = (dyc - mean_dy.view(shape) - xhat * mean_dy_xhat.view(shape)) * scale.view(shape)
        return dx.to(ctx.dtype), grad_weight, grad_bias, None, None


class SyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """Batch normalisation over the union of every worker's batch (inputs of 2 or more dimensions)."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, device: Any = None, dtype: Any = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected an input of 2 or more dimensions, got {input.dim()}")

    def update_running_stats(self, mean: torch.Tensor, unbiased_var: torch.Tensor) -> None:
        """torch's rule: an exponential average (momentum), or a cumulative one (momentum None)."""
        if not self.track_running_stats or self.running_mean is None or self.running_var is None:
            return
        assert self.num_batches_tracked is not None
        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        with torch.no_grad():
            self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
            self.running_var.mul_(1 - factor).add_(unbiased_var.to(self.running_var.dtype), alpha=factor)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        batch_stats = self.training or not self.track_running_stats
        if not batch_stats or require().size == 1:
            return super().forward(input)
        result: torch.Tensor = _SyncBatchNorm.apply(input, self.weight, self.bias, self.eps, self)  # type: ignore[no-untyped-call]
        return result

