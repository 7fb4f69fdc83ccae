"""What a worker process sees of how it was started, one PROBE line of JSON; run as a script, with -m, or by -c."""

from __future__ import annotations

import json
import os
import sys

PRELOADED = "sluice.worker.node" in sys.modules  # before this script imports anything of Sluice's


def seen() -> dict[str, object]:
    main = sys.modules["__main__"]
    return {
        "argv": sys.argv, "name": __name__, "main_file": getattr(main, "__file__", None),
        "main_package": getattr(main, "__package__", None), "main_spec": getattr(main, "__spec__", None) is not None,
        "main_loader": type(getattr(main, "__loader__", None)).__name__, "path0": sys.path[0], "cwd": os.getcwd(),
        "ranks": [os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "SLUICE_RANK", "WORLD_SIZE")],
        "stdin": os.readlink("/proc/self/fd/0"), "session_leader": os.getsid(0) == os.getpid(),
        "group_leader": os.getpgid(0) == os.getpid(), "unbuffered": sys.stdout.write_through,
        "cmdline": open("/proc/self/cmdline", "rb").read().rstrip(b"\0").decode().split("\0"),
        "secret_fd_set": "SLUICE_SECRET_FD" in os.environ, "flags": [sys.flags.optimize, sys.flags.dont_write_bytecode],
    }


def fail() -> None:
    raise ValueError("a worker's own error")


def draws() -> list[float]:
    """Numbers from the generators a script uses unseeded: every worker's own, not its siblings'."""
    import random

    import numpy as np

    return [random.random(), float(np.random.random())]


if __name__ == "__main__":
    print("PROBE", json.dumps({**seen(), "preloaded": PRELOADED, "draws": draws()}), flush=True)
    if sys.argv[1:2] == ["fail"] and os.environ.get("RANK") == "1":
        fail()
