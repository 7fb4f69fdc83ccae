"""Horovod's import paths and signatures of horovod.torch work with the package's name changed to sluice.torch."""

from __future__ import annotations

import importlib
import inspect

import pytest

import sluice.torch as hvd
from sluice.errors import InvalidCallError

#: what programs import from horovod.torch's submodules (seen in public training code), by submodule
FROM_SUBMODULES = {
    "mpi_ops": ["allreduce", "allreduce_async", "allreduce_", "allreduce_async_", "allgather_async", "synchronize",
                "Average", "Sum", "size", "poll"],
    "compression": ["Compression"],
    "functions": ["broadcast_object", "broadcast_parameters", "broadcast_optimizer_state", "allgather_object"],
    "optimizer": ["DistributedOptimizer"],
    "sync_batch_norm": ["SyncBatchNorm"],
    "elastic": ["TorchState", "ElasticSampler", "run"],
}


@pytest.mark.parametrize("submodule", sorted(FROM_SUBMODULES))
def test_names_import_from_horovods_submodules(submodule: str) -> None:
    module = importlib.import_module(f"sluice.torch.{submodule}")
    assert getattr(hvd, submodule) is module  # hvd.mpi_ops, as after `import horovod.torch as hvd`
    for name in FROM_SUBMODULES[submodule]:
        assert getattr(module, name) is getattr(hvd if submodule != "elastic" else hvd.elastic, name), name


def test_signatures_take_horovods_positional_order() -> None:
    assert next(iter(inspect.signature(hvd.barrier).parameters)) == "process_set"  # hvd.barrier(ps)
    assert list(inspect.signature(hvd.ProcessSet).parameters) == ["ranks_or_comm"]
    assert callable(hvd.elastic.TorchState.reset) and "sys" not in dir(hvd)  # a State's hook to override


def test_a_barrier_named_where_the_set_goes_says_where_a_name_goes() -> None:
    with pytest.raises(InvalidCallError, match=r"barrier\(name='start'\)"):
        hvd.barrier("start")  # before init: the argument is checked first
