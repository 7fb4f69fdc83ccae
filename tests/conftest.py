"""Assertion rewriting for the helper modules whose asserts fail tests (pytest rewrites only test modules itself)."""

import pytest

# before anything imports them: a failed assert there then shows its operands, as in a test module
pytest.register_assert_rewrite("testbed.launch", "testbed.bench_runs", "tests.integration.pipeline_helpers")
