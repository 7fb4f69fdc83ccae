"""Warnings logged to this process's stderr, where forked children inherit it: `warnings_to_stderr`."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def warnings_to_stderr() -> Iterator[None]:
    """Warnings (and the servers' and scheduler's exit summaries) to this process's stderr, for forked
    children to inherit.

    A handler of our own rather than logging.basicConfig(force=True): that would close pytest's own
    logging handlers for the rest of the session. Entered inside the test, where sys.stderr is capfd's.
    """
    root = logging.getLogger()
    summaries = [logging.getLogger("sluice.server"), logging.getLogger("sluice.scheduler")]
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s:%(name)s:%(message)s"))
    saved = [root.level, *(log.level for log in summaries)]
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    for log in summaries:
        log.setLevel(logging.INFO)
    try:
        yield
    finally:
        root.removeHandler(handler)
        for log, level in zip([root, *summaries], saved, strict=True):
            log.setLevel(level)
