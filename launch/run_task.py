"""The worker side of `sluice.run`: the caller's function read from its folder, run, its return value left there."""

from __future__ import annotations

import os
import pickle
import socket
import sys
from pathlib import Path
from typing import Any

#: in the folder: what the workers run, and each one's return value (RESULT.format(rank))
TASK, RESULT = "task.pkl", "result.{}.pkl"
#: how the caller's folder for one run is named (tempfile.mkdtemp's prefix)
FOLDER_PREFIX = "sluice-run-"
#: the worker command's words before the folder
_MODULE = ["-m", "sluice.launch.run_task"]


def task_folder(command: list[str]) -> str | None:
    """The folder of a `sluice.run` job's worker command (PYTHON -m sluice.launch.run_task FOLDER), else None."""
    if len(command) == 4 and command[1:3] == _MODULE and Path(command[3]).name.startswith(FOLDER_PREFIX):
        return os.path.abspath(command[3])
    return None


def pickler() -> Any:
    """cloudpickle where installed (by value: functions of __main__ or a notebook, lambdas, closures), else pickle."""
    try:
        import cloudpickle
    except ImportError:
        return pickle
    return cloudpickle


def main(argv: list[str]) -> int:
    """`python -m sluice.launch.run_task FOLDER`: run the function; its value goes to FOLDER/result.RANK.pkl."""
    folder = Path(argv[0])
    try:
        with open(folder / TASK, "rb") as task:
            func, args, kwargs = pickle.load(task)  # written by the caller, a process of this user on this host
    except FileNotFoundError:
        print(f"sluice.run: {folder} is not on this host ({socket.gethostname()}): its workers run on the "
              "caller's host only", file=sys.stderr)
        return 2
    try:
        value = func(*args, **kwargs)
    except Exception as exc:  # shown from the function's frame down, as if it were the script, and exit 1
        tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        return 1
    rank = os.environ.get("RANK", "0")
    partial = folder / f".{RESULT.format(rank)}.{os.getpid()}"
    with open(partial, "wb") as out:
        pickler().dump(value, out)
    os.replace(partial, folder / RESULT.format(rank))  # whole or absent: a worker killed mid-write leaves none
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
