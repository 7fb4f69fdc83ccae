"""PyTorch shim: Horovod's API (api.py) over the Sluice node, its collectives, optimizer and state."""

try:  # the framework is an extra: say which one, not only that an import failed
    import torch as _framework  # noqa: F401
except ImportError as _missing:
    from sluice.errors import MissingExtraError

    raise MissingExtraError("torch", "torch", "sluice.torch") from _missing
