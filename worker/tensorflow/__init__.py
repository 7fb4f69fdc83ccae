"""Horovod's TensorFlow 2 API over Sluice (published as sluice.tensorflow): see api.py."""
