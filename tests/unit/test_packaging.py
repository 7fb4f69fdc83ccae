"""Sluice's code imports itself only under the one name it installs, `sluice` (the wheel: test_package.py)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("ps", "worker", "transport", "scheduler", "launch")
BARE_IMPORT = re.compile(rf"^\s*(from|import)\s+({'|'.join(FOLDERS)})(\.|\s|$)", re.M)


def test_no_module_imports_a_folder_by_its_bare_name() -> None:
    offenders = []
    for folder in (*FOLDERS, "bench", "testbed", "tests", "examples", "sluice"):
        for path in (ROOT / folder).rglob("*.py"):
            if any((ROOT / p).is_symlink() for p in path.relative_to(ROOT).parents if str(p) != "."):
                continue
            for match in BARE_IMPORT.finditer(path.read_text()):
                offenders.append(f"{path.relative_to(ROOT)}: {match.group(0).strip()}")
    assert not offenders, "import these as sluice.<folder>...: " + "; ".join(offenders[:10])
