"""docs/architecture.md's layout table against the tree: every package folder is named, every name exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SKIP = {".venv", "build", ".git", "node_modules"}


def _listed() -> set[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    cells = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `")]
    return {name.rstrip("/") for cell in cells for name in re.findall(r"`([^`]+)`", cell)}


def _packages() -> set[str]:
    """Folders that hold a Python package with at least one module besides its __init__.py."""
    found = set()
    for init in ROOT.rglob("__init__.py"):
        folder = init.parent
        relative = folder.relative_to(ROOT)
        if (relative.parts and relative.parts[0] in SKIP) or folder.is_symlink() or "sluice" in relative.parts[1:]:
            continue
        if any(p.name != "__init__.py" for p in folder.glob("*.py")):
            found.add(relative.as_posix())
    return found


def test_every_package_folder_is_in_the_layout_table() -> None:
    missing = _packages() - _listed()
    assert not missing, f"docs/architecture.md's layout table does not name {sorted(missing)}"


def test_every_folder_the_layout_table_names_exists() -> None:
    absent = sorted(name for name in _listed() if not (ROOT / name).is_dir())
    assert not absent, f"docs/architecture.md's layout table names folders that do not exist: {absent}"
