"""Assertion rewriting for the helper modules whose asserts fail tests (pytest rewrites only test modules itself)."""

import pytest

# before anything imports them: a failed assert there then shows its operands, as in a test module
pytest.register_assert_rewrite("testbed.launch", "tests.integration.pipeline_helpers")


#: the files that took longest on a 2-core machine (seconds of tests, 2026-11-29), to start first: `make test` hands
#: whole files to its two workers in collection order, and a long file started last leaves one worker running it
#: alone while the other has nothing left
LONGEST = {"tests/integration/test_failover.py": 157, "tests/integration/test_bench_quick_jobs.py": 140,
           "tests/integration/test_bench_netbed_trees.py": 130, "tests/integration/test_bench_quick.py": 110,
           "tests/integration/test_elastic_launch.py": 107, "tests/integration/test_ssh_launch.py": 104,
           "tests/integration/test_bench_netbed.py": 90, "tests/integration/test_replicas.py": 60,
           "tests/integration/test_ssh_security.py": 60, "tests/integration/test_recovery.py": 56,
           "tests/integration/test_pipeline.py": 45, "tests/integration/test_keras.py": 39,
           "tests/integration/test_ray_train.py": 37}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest files first, in LONGEST's order; the rest after them as collected."""
    items.sort(key=lambda item: -LONGEST.get(item.nodeid.split("::")[0], 0))  # stable: each file keeps its order
