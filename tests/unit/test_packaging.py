"""Sluice installs one top-level name, `sluice`, and its code imports itself only under that name."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("ps", "worker", "transport", "scheduler", "launch")
BARE_IMPORT = re.compile(rf"^\s*(from|import)\s+({'|'.join(FOLDERS)})(\.|\s|$)", re.M)


@pytest.mark.timeout(120)
def test_the_wheel_holds_only_the_sluice_package(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (wheel,) = tmp_path.glob("sluice-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        top_level = archive.read(next(n for n in names if n.endswith(".dist-info/top_level.txt"))).decode().split()
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"sluice"}
    assert top_level == ["sluice"]
    for folder in FOLDERS:  # the links became real files
        assert f"sluice/{folder}/__init__.py" in names
    assert "sluice/torch.py" in names and "sluice/worker/collective/engine.py" in names
    assert "sluice/worker/torch/api.py" in names


def test_no_module_imports_a_folder_by_its_bare_name() -> None:
    offenders = []
    for folder in (*FOLDERS, "bench", "testbed", "tests", "examples", "sluice"):
        for path in (ROOT / folder).rglob("*.py"):
            if any((ROOT / p).is_symlink() for p in path.relative_to(ROOT).parents if str(p) != "."):
                continue
            for match in BARE_IMPORT.finditer(path.read_text()):
                offenders.append(f"{path.relative_to(ROOT)}: {match.group(0).strip()}")
    assert not offenders, "import these as sluice.<folder>...: " + "; ".join(offenders[:10])
