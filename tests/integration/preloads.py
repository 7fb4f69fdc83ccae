"""What the tests' torch and TensorFlow jobs preload (`sluice launch --preload`, launch/preload.py): the imports
each worker would make afresh (torch's first optimizer imports torch._dynamo), made once per job instead."""

from __future__ import annotations

TORCH = ["--preload", "torch,torch._dynamo,sluice.torch"]
LIGHTNING = ["--preload", "torch,torch._dynamo,sluice.torch,lightning.pytorch,sluice.lightning"]
KERAS = ["--preload", "tensorflow,keras,sluice.tensorflow.keras"]
