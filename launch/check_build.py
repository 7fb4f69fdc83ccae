"""`sluice launch --check-build` (horovodrun's -cb): what this installation can run, read without importing it."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os

from sluice import __version__

#: (what, module to look for, distribution whose version to name, the extra that brings it)
_FRAMEWORKS = (("PyTorch", "torch", "torch", "torch"), ("TensorFlow", "tensorflow", "tensorflow", "tensorflow"),
               ("Keras", "keras", "keras", "tensorflow"))
_EXTRAS = (("the aggregation trees' planner (aggregation.mode = \"plan\")", "scipy", "scipy", "planner"),
           ("HiGHS for the planner", "highspy", "highspy", "planner"),
           ("Prometheus metrics (metrics.port)", "prometheus_client", "prometheus-client", "prometheus"),
           ("Ray Train backend (sluice.ray)", "ray", "ray", "ray"),
           ("Lightning strategy (sluice.lightning)", "lightning", "lightning", "lightning"),
           ("uvloop for the launcher", "uvloop", "uvloop", "uvloop"))


def _version(distributions: tuple[str, ...]) -> str | None:
    for name in distributions:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _line(what: str, module: str, distribution: str, extra: str) -> str:
    found = importlib.util.find_spec(module) is not None
    # TensorFlow's CPU build is its own distribution
    version = _version((distribution, f"{distribution}-cpu")) if found else None
    detail = f" ({distribution} {version})" if version else f" (pip install 'sluice-ps[{extra}]')" if not found else ""
    return f"    [{'X' if found else ' '}] {what}{detail}"


def report() -> str:
    """The listing: frameworks, optional pieces, and the transport's, each [X] or [ ] with what to install."""
    import zmq

    curve = zmq.has("curve")
    shm = os.access("/dev/shm", os.W_OK)
    lines = [f"Sluice {__version__}:", "", "Available frameworks:"]
    lines += [_line(*entry) for entry in _FRAMEWORKS]
    lines += ["", "Available extras:"]
    lines += [_line(*entry) for entry in _EXTRAS]
    lines += ["", "Transport:",
              f"    [X] ZeroMQ (pyzmq {zmq.__version__}, libzmq {zmq.zmq_version()})",
              f"    [{'X' if curve else ' '}] CURVE authentication and encryption"
              + ("" if curve else " (this libzmq has no CURVE: only transport.curve = false jobs run)"),
              f"    [{'X' if shm else ' '}] shared memory between processes of a host (/dev/shm)",
              "    [ ] NCCL (CUDA tensors travel through pinned host memory)"]
    return "\n".join(lines)
