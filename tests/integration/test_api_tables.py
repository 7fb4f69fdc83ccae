"""docs/horovod_api.md against Sluice's modules: each offered name exists, each one not offered fails
saying why, and some test or example calls each offered name."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: a table's heading names Horovod's module and Sluice's
HEADING = re.compile(r"^## `(horovod[.\w]*)` -> `(sluice[.\w]*)`$", re.M)
ROW = re.compile(r"^\| `(\w+)` \| (offered|not offered) \|", re.M)


def tables() -> dict[str, dict[str, str]]:
    """Sluice's module -> {Horovod's name: its status}, from the doc."""
    text = (ROOT / "docs/horovod_api.md").read_text()
    parts = HEADING.split(text)[1:]
    return {ours: dict(ROW.findall(body)) for _, ours, body in zip(parts[::3], parts[1::3], parts[2::3], strict=True)}


def test_the_tables_cover_all_four_modules_the_runner_and_ray() -> None:
    found = tables()
    frameworks = ["sluice.keras", "sluice.tensorflow", "sluice.tensorflow.keras", "sluice.torch"]
    assert sorted(found) == ["sluice", "sluice.keras", "sluice.ray", "sluice.runner", "sluice.tensorflow",
                             "sluice.tensorflow.keras", "sluice.torch"]
    assert all(len(found[module]) > 30 for module in frameworks)
    assert found["sluice"] == found["sluice.runner"] == {"run": "offered"}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_every_offered_name_exists_and_every_other_fails_saying_why() -> None:
    probe = (
        "import importlib, json, sys\n"
        "tables = json.loads(sys.argv[1])\n"
        "bad = []\n"
        "for module, names in tables.items():\n"
        "    mod = importlib.import_module(module)\n"
        "    for name, status in names.items():\n"
        "        try:\n"
        "            getattr(mod, name)\n"
        "            ok = status == 'offered'\n"
        "        except AttributeError as exc:\n"
        "            ok = status == 'not offered' and len(str(exc)) > 60\n"
        "        if not ok:\n"
        "            bad.append(f'{module}.{name} ({status})')\n"
        "print(json.dumps(bad))\n"
    )
    run = subprocess.run([sys.executable, "-c", probe, json.dumps(tables())], capture_output=True, text=True,
                         timeout=110, cwd=ROOT, env={"TF_CPP_MIN_LOG_LEVEL": "3", "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == []


def test_some_test_or_example_calls_every_offered_name() -> None:
    sources = [p.read_text() for pattern in ("tests/**/*.py", "examples/**/*.py") for p in ROOT.glob(pattern)]
    text = "\n".join(sources)
    uncalled = sorted(f"{module}.{name}" for module, names in tables().items() for name, status in names.items()
                      if status == "offered" and not re.search(rf"[.\s(\[]{re.escape(name)}\b", text))
    assert uncalled == []
