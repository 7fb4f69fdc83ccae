"""Horovod's Keras 3 API over Sluice (published as sluice.keras): see api.py."""
