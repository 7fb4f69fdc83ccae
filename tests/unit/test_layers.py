"""The import rules of docs/architecture.md, read from every module's imports (function-level ones too)."""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OURS = ("launch", "ps", "worker", "scheduler", "transport")
FRAMEWORKS = ("torch", "tensorflow", "keras")

#: folder -> the packages of ours its modules may import (besides their own folder and sluice.errors)
ALLOWED = {
    "transport": set(),
    "scheduler": {"transport"},
    "ps": {"scheduler", "transport"},
    "worker": {"scheduler", "transport"},
    "launch": {"ps", "worker", "scheduler", "transport"},
}


def _modules(folder: str) -> Iterator[Path]:
    yield from sorted((ROOT / folder).rglob("*.py"))


@functools.cache
def _imports(path: Path) -> tuple[str, ...]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
    return tuple(names)


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_each_layer_imports_only_the_layers_below_it(folder: str) -> None:
    wrong = []
    for path in _modules(folder):
        for name in _imports(path):
            parts = name.split(".")
            ours = parts[0] == "sluice" and len(parts) > 1 and parts[1] in OURS
            if ours and parts[1] != folder and parts[1] not in ALLOWED[folder]:
                wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not wrong, wrong


@pytest.mark.parametrize("folder", ["launch", "ps", "scheduler", "transport", "sluice"])
def test_only_the_worker_imports_a_framework(folder: str) -> None:
    """Servers, aggregators, the scheduler and the launcher work on numpy and bytes (a framework costs
    seconds to import); sluice/'s own modules reach one only through worker/."""
    paths = (ROOT / "sluice").glob("*.py") if folder == "sluice" else _modules(folder)
    wrong = [f"{path.relative_to(ROOT)} imports {name}" for path in paths
             for name in _imports(path) if name.split(".")[0] in FRAMEWORKS]
    assert not wrong, wrong


@pytest.mark.parametrize(("folder", "forbidden"), [("tests", "bench"), ("bench", "tests"), ("testbed", "tests"),
                                                  ("testbed", "bench")])
def test_tests_and_benchmarks_share_only_the_testbed(folder: str, forbidden: str) -> None:
    wrong = [f"{path.relative_to(ROOT)} imports {name}" for path in _modules(folder)
             for name in _imports(path) if name.split(".")[0] == forbidden]
    assert not wrong, wrong


def test_no_test_module_or_conftest_imports_a_test_module() -> None:
    wrong = [f"{path.relative_to(ROOT)} imports {name}" for path in _modules("tests")
             for name in _imports(path) if name.split(".")[-1].startswith("test_")]
    assert not wrong, wrong
