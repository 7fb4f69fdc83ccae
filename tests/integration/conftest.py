"""Fixtures shared by the integration tests: launched jobs that are always stopped."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integration.slurm_bed import slurm  # noqa: F401 - the one-node SLURM bed, one per session
from tests.integration.test_launch import Launch


@pytest.fixture
def launch() -> Iterator[type[Launch]]:
    started: list[Launch] = []

    class Tracked(Launch):
        def __init__(self, args: list[str]) -> None:
            super().__init__(args)
            started.append(self)

    try:
        yield Tracked
    finally:
        for job in started:
            job.close()
