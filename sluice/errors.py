"""The one error type a Sluice job raises to its user."""


class SluiceError(RuntimeError):
    """A job-level failure: a lost peer, a missed deadline, a rejected declaration."""
