"""hvd.elastic.ElasticSampler: the epoch's remaining indices, partitioned over the current workers.

Every worker computes the same order (the seed plus the epoch shuffle all indices), so the job's
batch k is one contiguous run of that order: rank r takes positions r, r + W, r + 2W, ... of what is
left. `record_batch` therefore counts the whole job's samples (batch_size x W), and after a re-form
the remaining positions are dealt again over the new W, from any one worker's committed count.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Iterator, Sized
from typing import Any

import torch.utils.data

from sluice.worker.torch.state import require


class ElasticSampler(torch.utils.data.Sampler[int]):
    """Horovod's ElasticSampler: like DistributedSampler, over the indices this epoch has not processed.

    Put it in the TorchState (`TorchState(model, optimizer, sampler=sampler)`): it is committed and
    restored with the rest. Call `record_batch(batch_idx, batch_size)` after each step and
    `set_epoch(epoch + 1)` at the end of an epoch (not at its start: that forgets the progress made).
    `num_replicas` and `rank` default to the job's size and this worker's rank (hvd.init() first).
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0, *, num_replicas: int | None = None,
                 rank: int | None = None) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        #: samples the whole job processed this epoch, counted from the start of the epoch's order
        self.processed_num = 0
        #: indices recorded one by one (record_indices), left out wherever they are in the order
        self.processed_indices: set[int] = set()
        self._fixed = (num_replicas, rank)
        self.num_replicas = 1
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch`: a new order (with shuffle), nothing processed yet."""
        self.epoch = epoch
        self.processed_num = 0
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """One step of the whole job is done: batch_size samples on each of the num_replicas workers.
        `batch_idx` is accepted for Horovod's sake; every call counts the next batch."""
        self.processed_num += batch_size * self.num_replicas

    def record_indices(self, indices: Iterable[int]) -> None:
        """Leave these indices out of the rest of the epoch. Pass every worker's (e.g. allgathered):
        a re-formed job restores the state one worker committed."""
        self.processed_indices.update(int(i) for i in indices)

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        """This worker's indices of batch `batch_idx` in the current iteration."""
        start = batch_idx * batch_size
        return self.indices[start:start + batch_size]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "processed_num": self.processed_num,
                "processed_indices": sorted(self.processed_indices)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take a committed state and deal the remaining indices over the current workers."""
        self.epoch = int(state_dict["epoch"])
        self.processed_num = int(state_dict["processed_num"])
        self.processed_indices = {int(i) for i in state_dict.get("processed_indices", ())}
        self.reset()

    def reset(self) -> None:
        """Partition what is left of the epoch over the current size and rank."""
        replicas, rank = self._fixed
        if replicas is None or rank is None:
            node = require()
            replicas = node.size if replicas is None else replicas
            rank = node.rank if rank is None else rank
        if not 0 <= rank < replicas:
            raise ValueError(f"ElasticSampler: rank {rank} is not below num_replicas {replicas}")
        self.num_replicas, self.rank = replicas, rank
        order = list(range(len(self.dataset)))
        if self.shuffle:  # the same seed and epoch give the same order on every worker
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining_indices = [i for i in order[self.processed_num:] if i not in self.processed_indices]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        self.indices = self._mine()

    def _mine(self) -> list[int]:
        padded = self.remaining_indices[:]
        while padded and len(padded) < self.total_size:  # repeat from the start so every worker has as many
            padded += padded[:self.total_size - len(padded)]
        return padded[self.rank:self.total_size:self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        self.indices = self._mine()
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples
