"""Horovod's Keras 3 API over Sluice, published as sluice.keras (api.py) and sluice.tensorflow.keras (tf_api.py)."""
