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
