"""Horovod's Keras 3 API over Sluice, published as sluice.keras (api.py) and sluice.tensorflow.keras (tf_api.py)."""

try:  # the framework is an extra: say which one, not only that an import failed
    import tensorflow as _framework  # noqa: F401
except ImportError as _missing:
    from sluice.errors import MissingExtraError

    raise MissingExtraError("tensorflow", "tensorflow", "sluice.keras") from _missing
