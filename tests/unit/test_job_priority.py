"""The job-priority policy: early rounds at the top, MLFQ demotion by bytes pushed, promotion after a starved round."""

from __future__ import annotations

import pytest

from sluice.worker.job_priority import JobLevel, JobsConfig

MIB = 1 << 20


@pytest.mark.parametrize(
    ("pushes", "levels"),
    [
        # (round, MiB pushed, time) per push -> the level each push goes on; 2 early rounds, thresholds 4 and 8 MiB
        ([(1, 3, 0.0), (2, 3, 1.0), (3, 3, 2.0)], [0, 0, 1]),  # round 3: 6 MiB attained > 4
        # 4 MiB reached after round 4: round 5 goes a level lower
        ([(1, 1, 0.0), (2, 1, 1.0), (3, 1, 2.0), (4, 1, 3.0), (5, 1, 4.0)], [0, 0, 0, 0, 1]),
        ([(1, 5, 0.0), (2, 5, 1.0), (3, 5, 2.0), (4, 5, 3.0)], [0, 0, 2, 2]),  # past both thresholds: bottom
        # several tensors a round: every push of a round counts, the round advances once
        ([(1, 2, 0.0), (1, 2, 0.0), (2, 2, 1.0), (2, 2, 1.0), (3, 2, 2.0)], [0, 0, 0, 0, 2]),
        # round 4 starts 100 s after round 3 (starved in a low band): back to the top, bytes from zero
        ([(1, 5, 0.0), (2, 5, 1.0), (3, 5, 2.0), (4, 1, 102.0), (5, 1, 103.0)], [0, 0, 2, 0, 0]),
    ],
)
def test_levels_follow_early_rounds_then_bytes_pushed(pushes: list[tuple[int, int, float]], levels: list[int]) -> None:
    job = JobLevel(JobsConfig(priorities=True, early_rounds=2, thresholds_mib=(4.0, 8.0), promote_after_s=30.0), 3)
    assert [job.on_push(round_, mib * MIB, now) for round_, mib, now in pushes] == levels


def test_a_promotion_is_counted_and_never_happens_when_off() -> None:
    config = JobsConfig(priorities=True, early_rounds=0, thresholds_mib=(1.0,), promote_after_s=10.0)
    job = JobLevel(config, 2)
    for round_, now in ((1, 0.0), (2, 5.0), (3, 50.0)):
        job.on_push(round_, 2 * MIB, now)
    assert job.promotions == 1 and job.attained == 2 * MIB
    never = JobLevel(JobsConfig(priorities=True, early_rounds=0, thresholds_mib=(1.0,), promote_after_s=0.0), 2)
    for round_, now in ((1, 0.0), (2, 500.0), (3, 5000.0)):
        never.on_push(round_, 2 * MIB, now)
    assert never.promotions == 0 and never.level == 1


@pytest.mark.parametrize(
    ("settings", "error"),
    [
        ({"early_rounds": -1}, "early_rounds"),
        ({"thresholds_mib": (8.0, 4.0)}, "ascending"),
        ({"thresholds_mib": (4.0, 4.0)}, "ascending"),
        ({"thresholds_mib": (0.0,)}, "positive"),
        ({"promote_after_s": -1.0}, "promote_after_s"),
    ],
)
def test_invalid_settings_are_refused_saying_which(settings: dict[str, object], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        JobsConfig(**settings)  # type: ignore[arg-type]


def test_more_levels_than_channels_is_refused_saying_what_to_set() -> None:
    with pytest.raises(ValueError, match=r"transport\.channels = 3"):
        JobLevel(JobsConfig(priorities=True, thresholds_mib=(1.0, 2.0)), 2)


def test_the_jobs_section_loads_and_is_checked_against_the_channels() -> None:
    from sluice.launch.config import ConfigError, load_config

    config = load_config(None, {"SLUICE_JOBS_EARLY_ROUNDS": "4"}, ["jobs.priorities=true", "jobs.thresholds_mib=2,8"])
    assert config.jobs == JobsConfig(priorities=True, early_rounds=4, thresholds_mib=(2.0, 8.0))
    with pytest.raises(ConfigError, match=r"\[jobs\].*set transport\.channels = 3"):
        load_config(None, {}, ["transport.channels=2", "jobs.priorities=true", "jobs.thresholds_mib=1,2"])
    load_config(None, {}, ["transport.channels=2", "jobs.thresholds_mib=1,2"])  # off: the channels do not matter
