"""A job whose buffers do not fit in /dev/shm fails saying how much it needed and how to give it that: no SIGBUS."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHM_BYTES = 4 << 20

# A real training step: 8 MiB of float32 gradients, whose two fusion buffers (16 MiB) do not fit in
# the 4 MiB /dev/shm of this mount namespace. Before reservation this died of SIGBUS in backward.
WORKER = """
import os
import torch
import sluice.torch as hvd
hvd.init()
found = os.statvfs("/dev/shm")
print("shm bytes", found.f_blocks * found.f_frsize, flush=True)
model = torch.nn.Linear(1024, 2048)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters())
model(torch.ones(2, 1024)).sum().backward()
optimizer.step()
print("stepped", flush=True)
"""
# in a private mount namespace: a small tmpfs on /dev/shm, the job, then what the job left there
SHELL = f"""mount -t tmpfs -o size={SHM_BYTES} tmpfs /dev/shm || exit 99
"$@"
code=$?
echo "left in /dev/shm: [$(ls -A /dev/shm)]"
exit $code
"""


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_job_whose_buffers_do_not_fit_in_dev_shm_fails_naming_the_size_and_the_fix(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="needs torch (the job trains a model): pip install torch")
    if os.geteuid() != 0:
        pytest.skip("needs root, to mount a small tmpfs on /dev/shm in a private mount namespace")
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux), for a private mount namespace")
    script = tmp_path / "train.py"
    script.write_text(WORKER)
    job = [sys.executable, "-m", "sluice.launch.cli", "launch", "-w", "1", "-s", "0", "--", sys.executable,
           str(script)]
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", SHELL, "sh", *job], cwd=ROOT,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=80)
    out = done.stdout + done.stderr
    assert done.returncode != 99, f"could not mount a tmpfs on /dev/shm: {out[-2000:]}"
    assert f"[worker 0] shm bytes {SHM_BYTES}" in out  # the job ran on the small /dev/shm
    assert done.returncode == 1, out[-4000:]  # the worker's error: not a signal (SIGBUS: 135, or -7)
    assert "worker 0 (pid " in out and "exited with code 1; stopping the job" in out
    # the size it needed, what was free, and the fix
    assert ("SluiceError: a shared array of 2099200 float32 (fusion buffers, a server's or aggregator's sums) needs "
            "8396800 bytes (8.0 MiB) more of shared memory in /dev/shm") in out, out[-4000:]
    assert f"/dev/shm has {SHM_BYTES} bytes (4.0 MiB) free of {SHM_BYTES} bytes (4.0 MiB)" in out
    assert "mount a larger /dev/shm (docker run --shm-size=SIZE; on Kubernetes an emptyDir with medium: Memory" in out
    assert "stepped" not in out
    for crash in ("SIGBUS", "Bus error", "signal 7", "Fatal Python error", "core dumped"):
        assert crash not in out, out[-4000:]
    # nothing of the job is left in its /dev/shm (and the real one it never saw: the fixture checks that)
    assert "left in /dev/shm: []" in out
