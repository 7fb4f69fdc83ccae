"""The small helpers horovod.tensorflow re-exports (split_list, refs, version checks, ...), and its TF1 session hook."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, TypeVar

import tensorflow as tf
from packaging import version

from sluice.worker.tensorflow.calls import Average, Sum
from sluice.worker.tensorflow.extras import broadcast_global_variables

T = TypeVar("T")


def split_list(items: Sequence[T], parts: int) -> list[Sequence[T]]:
    """`items` split into `parts` runs as even as they can be, the first ones one longer (Horovod's)."""
    each, extra = divmod(len(items), parts)
    return [items[i * each + min(i, extra):(i + 1) * each + min(i + 1, extra)] for i in range(parts)]


def check_num_rank_power_of_2(num_rank: int) -> bool:
    """Whether `num_rank` is a power of two (Horovod's check for its GPU Adasum; Sluice's takes any size)."""
    return num_rank != 0 and (num_rank & (num_rank - 1)) == 0


def handle_average_backwards_compatibility(op: str | None, average: bool | None) -> str:
    """Horovod's rule for the deprecated `average=`: `op` wins, and both given is a ValueError."""
    if op is not None:
        if average is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one of them.")
        return op
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed in v1.0",
                      DeprecationWarning, stacklevel=2)
        return Average if average else Sum
    return Average


def vars_to_refs(variables: Any) -> Any:
    """Hashable references of a variable or a (nested) list of them, as Horovod's: tuples of `v.ref()`."""
    if isinstance(variables, list):
        return tuple(vars_to_refs(v) for v in variables)
    return variables.ref()


def refs_to_vars(refs: Any) -> Any:
    """The variables of `vars_to_refs`' references."""
    if isinstance(refs, tuple):
        return [refs_to_vars(r) for r in refs]
    return refs.deref()


def is_version_greater_equal_than(ver: str, target: str) -> bool:
    """`ver` >= `target` ("major.minor.patch"), with Horovod's ValueErrors for other arguments."""
    if not isinstance(ver, str) or not isinstance(target, str):
        raise ValueError(f"This function only accepts string arguments, got {type(ver)} and {type(target)}")
    if len(target.split(".")) != 3:
        raise ValueError(f"We only accepts target version values in the form of: major.minor.patch. Received: "
                         f"{target}")
    return version.parse(ver) >= version.parse(target)


def gpu_available(ext_base_name: str = "tensorflow", verbose: bool = False) -> bool:
    """Whether TensorFlow sees a GPU (Horovod asks its extension; Sluice has none, so it asks TensorFlow)."""
    return bool(tf.config.list_physical_devices("GPU"))


def check_extension(ext_name: str, ext_env_var: str, pkg_path: str, *args: Any) -> None:
    """Horovod raises ImportError when its compiled extension is missing; Sluice has no extension to check."""
    return None


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):  # type: ignore[misc]
    """Horovod's TF1 hook: every global variable broadcast from `root_rank` once the session exists."""

    def __init__(self, root_rank: int, device: str = "") -> None:
        super().__init__()
        self.root_rank, self.device = root_rank, device
        self.bcast_op: Any = None

    def begin(self) -> None:
        if self.bcast_op is None or self.bcast_op.graph != tf.compat.v1.get_default_graph():
            with tf.device(self.device):
                self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session: Any, coord: Any) -> None:
        session.run(self.bcast_op)
