"""Horovod's PyTorch API on Sluice: `import sluice.torch as hvd` (implemented in sluice.worker.torch)."""

import sys as _sys

from sluice.worker.torch.api import *  # noqa: F403
from sluice.worker.torch.api import __all__ as __all__
from sluice.worker.torch.api import elastic

# this module is no package, so `from sluice.torch.elastic import TorchState` (as from horovod.torch.elastic)
# finds the submodule only here
_sys.modules[f"{__name__}.elastic"] = elastic


def __getattr__(name: str) -> object:
    """Horovod's names Sluice does not offer fail saying so, and what to use instead."""
    from sluice.worker.torch.api import NOT_OFFERED

    if name in NOT_OFFERED:
        raise AttributeError(f"sluice.torch.{name}: {NOT_OFFERED[name]}")
    raise AttributeError(f"module 'sluice.torch' has no attribute {name!r}")
