"""Horovod's TensorFlow 2 API over Sluice (published as sluice.tensorflow): see api.py."""

try:  # the framework is an extra: say which one, not only that an import failed
    import tensorflow as _framework  # noqa: F401
except ImportError as _missing:
    from sluice.errors import MissingExtraError

    raise MissingExtraError("tensorflow", "tensorflow", "sluice.tensorflow") from _missing
