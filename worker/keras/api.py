"""Horovod's Keras API over Sluice, published as `sluice.keras`: `import sluice.keras as hvd`.

For Keras 3 on the TensorFlow backend. The process set-up and collectives are sluice.tensorflow's
(allreduce, allgather and broadcast take numpy values as well as tensors); DistributedOptimizer
wraps a Keras 3 optimizer (optimizer.py) and `callbacks` holds Horovod's callbacks (callbacks.py).
"""

from __future__ import annotations

from sluice.worker.keras import callbacks
from sluice.worker.keras.optimizer import DistributedOptimizer, load_model
from sluice.worker.tensorflow.api import (
    Average,
    Compression,
    Sum,
    allgather,
    allreduce,
    barrier,
    broadcast,
    broadcast_variables,
    cross_rank,
    cross_size,
    grouped_allreduce,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    metrics,
    rank,
    shutdown,
    size,
)

__all__ = [
    "Average", "Compression", "DistributedOptimizer", "Sum", "allgather", "allreduce", "barrier", "broadcast",
    "broadcast_variables", "callbacks", "cross_rank", "cross_size", "grouped_allreduce", "init", "is_homogeneous",
    "is_initialized", "load_model", "local_rank", "local_size", "metrics", "rank", "shutdown", "size",
]
