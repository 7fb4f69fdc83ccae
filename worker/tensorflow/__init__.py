"""Horovod's TensorFlow 2 API over Sluice (published as sluice.tensorflow): see api.py."""

from sluice.errors import require

# the framework is an extra: say which one, not only that an import failed. Found, not imported: the
# framework-free modules here (fused.py's planning) load without TensorFlow's 3 s; api.py imports it
require("tensorflow", "tensorflow", "sluice.tensorflow")
