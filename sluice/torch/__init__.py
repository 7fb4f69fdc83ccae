"""Horovod's PyTorch API on Sluice: `import sluice.torch as hvd` (implemented in sluice.worker.torch).

A package, as horovod.torch is: its submodules mpi_ops, compression, functions, optimizer and
sync_batch_norm, which programs import names from (`from horovod.torch.mpi_ops import
allreduce_async_, synchronize`), each hold the whole API here, so those imports work with the
package's name changed.
"""

import sys as _sys

from sluice.torch import compression as compression
from sluice.torch import functions as functions
from sluice.torch import mpi_ops as mpi_ops
from sluice.torch import optimizer as optimizer
from sluice.torch import sync_batch_norm as sync_batch_norm
from sluice.worker.torch.api import *  # noqa: F403
from sluice.worker.torch.api import __all__ as __all__
from sluice.worker.torch.api import elastic

# sluice.worker.torch.elastic under Horovod's name, so that `from sluice.torch.elastic import TorchState` (as from
# horovod.torch.elastic) finds the same module that hvd.elastic is
_sys.modules[f"{__name__}.elastic"] = elastic


def __getattr__(name: str) -> object:
    """Horovod's names Sluice does not offer fail saying so, and what to use instead."""
    from sluice.worker.torch.api import NOT_OFFERED

    if name in NOT_OFFERED:
        raise AttributeError(f"sluice.torch.{name}: {NOT_OFFERED[name]}")
    raise AttributeError(f"module 'sluice.torch' has no attribute {name!r}")
