"""Horovod-style scripts (examples/horovod/) run under `sluice launch`, and differ from Horovod scripts only in
their import line."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration import preloads

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "horovod"
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("script", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_only_the_import_line_names_sluice(script: str) -> None:
    source = (EXAMPLES / script).read_text()
    tree = ast.parse(source)
    docstring_end = tree.body[0].end_lineno if isinstance(tree.body[0], ast.Expr) else 0
    lines = source.splitlines()[docstring_end or 0:]
    mentions = [line for line in lines if "sluice" in line.lower()]
    assert mentions == ["import sluice.torch as hvd"]  # `import horovod.torch as hvd` makes it a Horovod script


def _launch(servers: int, script: str, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "sluice.launch.cli", "launch", *preloads.TORCH,
                           "-w", "2", "-s", str(servers), "--",
                           sys.executable, str(EXAMPLES / script), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.timeout(200)
def test_synthetic_resnet_benchmark_with_sync_batch_norm_and_fp16() -> None:
    out = _launch(0, "pytorch_synthetic_benchmark.py", "--sync-bn", "--fp16-allreduce", "--num-warmup-batches", "1",
                  "--num-iters", "1", "--num-batches-per-iter", "2")
    assert "[worker 0] Total img/sec on 2 CPU(s):" in out
    assert "sync BN: True" in out


@pytest.mark.timeout(200)
def test_mnist_style_script_with_fp16_and_mixed_precision_reaches_95_percent() -> None:
    out = _launch(1, "pytorch_mnist.py", "--fp16-allreduce", "--use-mixed-precision", "--epochs", "6")
    accuracies = [float(line.rsplit(" ", 1)[1].rstrip("%")) for line in out.splitlines()
                  if line.startswith("[worker 0] Test set:")]
    assert len(accuracies) == 6 and accuracies[-1] >= 95.0  # the script exits 1 below 95% as well
