"""Horovod's process sets in the TensorFlow and Keras shims: add and remove, over the node's ProcessSets."""

from __future__ import annotations

from collections.abc import Sequence

from sluice.worker.collective import process_set as process_set_api
from sluice.worker.collective.process_set import ProcessSet as ProcessSet
from sluice.worker.collective.process_set import global_process_set as global_process_set
from sluice.worker.tensorflow.state import require


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Horovod's: a set of ranks that runs collectives on its own (`process_set=`); every worker calls it alike,
    in the same order. ValueError where a set of the same ranks exists."""
    return process_set_api.add_process_set(require(), process_set)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Horovod's: every worker calls it alike; False for the global set or a set not registered."""
    return process_set_api.remove_process_set(require(), process_set)
