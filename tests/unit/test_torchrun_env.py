"""torchrun's variables for a worker, and --max-restarts (or torchrun's PET_MAX_RESTARTS) read: literal tables."""

from __future__ import annotations

import pytest

from sluice.launch.restarts import max_restarts
from sluice.launch.torchrun_env import torchrun_env


def test_a_worker_gets_every_variable_torchrun_sets() -> None:
    assert torchrun_env(5, 8, 1, 4, 1, 2, restart=2, max_restarts=3) == {
        "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2", "ROLE_RANK": "5", "ROLE_NAME": "default", "ROLE_WORLD_SIZE": "8",
        "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RUN_ID": "none",
        "TORCHELASTIC_USE_AGENT_STORE": "False"}


@pytest.mark.parametrize(("given", "environ", "want"), [
    (None, {}, 0), (3, {}, 3), (None, {"PET_MAX_RESTARTS": "2"}, 2), (0, {"PET_MAX_RESTARTS": "2"}, 0)])
def test_restarts_from_the_flag_else_torchruns_variable(given: int | None, environ: dict[str, str], want: int) -> None:
    assert max_restarts(given, environ) == want


@pytest.mark.parametrize(("given", "environ"), [(-1, {}), (None, {"PET_MAX_RESTARTS": "many"})])
def test_a_negative_or_unreadable_count_says_what_to_give(given: int | None, environ: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="give the number of restarts, 0 or more"):
        max_restarts(given, environ)
