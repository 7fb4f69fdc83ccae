"""The error types a Sluice job raises to its user (Horovod's names are aliases of these in the shims)."""


class SluiceError(RuntimeError):
    """A job-level failure: a lost peer, a missed deadline, a rejected declaration."""


class CollectiveError(SluiceError):
    """A collective failed on every rank that called it (Horovod's HorovodInternalError): the ranks
    disagreed on it, one of them refused its call, or the job failed. The ranks stay in step: the next
    collectives run."""


class InvalidCallError(SluiceError, ValueError):
    """A call whose arguments no rank could run (Horovod raises ValueError for these): a duplicate name
    in flight, bad alltoall splits, a root that is no rank, an unsupported dtype."""


class MissingExtraError(SluiceError, ImportError):
    """An optional piece of Sluice was used without the package it needs: names the extra to install."""

    def __init__(self, extra: str, package: str, use: str) -> None:
        super().__init__(f"{use} needs the package {package!r}, which is not installed: "
                         f"pip install 'sluice-ps[{extra}]'")
        self.extra = extra


def require(module: str, extra: str, use: str) -> None:
    """Raises MissingExtraError when `module` cannot be imported (checked before a lazy import)."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise MissingExtraError(extra, module, use)
