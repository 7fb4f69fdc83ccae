"""A stage's gradients averaged over its replicas in buckets, each as soon as the step's last backward made it.

As DDP does: the parameters are cut, in reverse order (the order backward produces their gradients),
into buckets of one dtype and at most `bucket_bytes`. During the stage's last backward of a step
(armed by the schedule) a hook notes each parameter whose gradient is final; a bucket whose gradients
are all final is averaged at once, a ring allreduce over the replicas' data plane, while the backward
goes on. Buckets start in bucket order on every replica (a full one waits for those before it), so
their sequence numbers agree whatever order the hooks fire in. `finish` starts what is left (a
parameter this replica did not use adds zeros, as in DDP), waits for every bucket and writes the
averages back into the gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sluice.worker.collective.data import DataPlane
from sluice.worker.collective.ops import CollectiveHandle
from sluice.worker.staging import Staging, wire_dtype


@dataclass
class _Launched:
    handle: CollectiveHandle
    flat: torch.Tensor
    members: list[torch.nn.Parameter]


def cut_buckets(params: Sequence[torch.nn.Parameter], bucket_bytes: int) -> list[list[torch.nn.Parameter]]:
    """`params` in reverse order, in runs of one dtype of at most `bucket_bytes` (a larger one alone)."""
    buckets: list[list[torch.nn.Parameter]] = []
    size = 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if not buckets or buckets[-1][0].dtype != p.dtype or size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return buckets


class ReplicaAverager:
    def __init__(self, group: DataPlane, params: Sequence[torch.nn.Parameter], priority: int,
                 bucket_bytes: int = 4 << 20) -> None:
        self.group, self.priority = group, priority
        self.buckets = cut_buckets([p for p in params if p.requires_grad], bucket_bytes)
        self._bucket_of = {id(p): index for index, bucket in enumerate(self.buckets) for p in bucket}
        self._ready = [0] * len(self.buckets)
        self._next = 0
        self._armed = False
        self._launched: list[_Launched] = []
        self._seq = 0
        for bucket in self.buckets:
            for p in bucket:
                p.register_post_accumulate_grad_hook(self._final)  # type: ignore[no-untyped-call]

    def arm(self) -> None:
        """The next backward is the step's last on this stage: its gradients are final."""
        self._ready = [0] * len(self.buckets)
        self._next = 0
        self._armed = True

    def _final(self, param: torch.Tensor) -> None:
        index = self._bucket_of.get(id(param))
        if not self._armed or index is None:
            return
        self._ready[index] += 1
        while self._next < len(self.buckets) and self._ready[self._next] >= len(self.buckets[self._next]):
            self._launch(self._next)
            self._next += 1

    def _launch(self, index: int) -> None:
        members = self.buckets[index]
        for p in members:
            if p.grad is None:  # a parameter this replica did not use: it adds zeros, as DDP does
                p.grad = torch.zeros_like(p)
        grads: list[Any] = [p.grad for p in members]
        flat = torch.cat([g.detach().reshape(-1).to("cpu") for g in grads])
        handle = self.group.allreduce(self._seq, Staging(flat).array(), wire_dtype(flat), "average", self.priority)
        self._seq += 1
        self._launched.append(_Launched(handle, flat, members))

    def finish(self) -> None:
        """Start the buckets not started yet, in order; wait for all and write the averages back."""
        self._armed = False
        while self._next < len(self.buckets):
            self._launch(self._next)
            self._next += 1
        launched, self._launched = self._launched, []
        with torch.no_grad():
            for done in launched:
                done.handle.wait()
                offset = 0
                for p in done.members:
                    grad = p.grad
                    assert grad is not None
                    grad.copy_(done.flat[offset:offset + grad.numel()].view_as(grad))
                    offset += grad.numel()
