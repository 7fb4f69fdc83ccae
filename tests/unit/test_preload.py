"""`sluice launch --preload`: which worker commands are forked, the preloader's requests, the option's names."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from sluice.launch.cli import _parse, build_parser
from sluice.launch.preload import forkable
from sluice.launch.preloader import parse_request
from sluice.launch.run_options import run_options

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def python_dir(tmp_path: Path) -> Path:
    """A bin directory with `python` and `python3` linked to one interpreter file, and `other` beside it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    real = tmp_path / "python3.11"
    real.write_text("")
    real.chmod(0o755)
    for name in ("python", "python3"):
        (bin_dir / name).symlink_to(real)
    (bin_dir / "other").write_text("")
    (bin_dir / "other").chmod(0o755)
    (tmp_path / "train.py").write_text("")
    (tmp_path / "app.zip").write_text("")
    return bin_dir


@pytest.mark.parametrize(("argv", "command"), [
    (["{bin}/python", "train.py", "--epochs", "3"], ["train.py", "--epochs", "3"]),
    (["python", "train.py"], ["train.py"]),  # found on the PATH given
    (["{bin}/python3", "train.py"], ["train.py"]),  # python3 beside it: the same file, the same environment
    (["{bin}/python", "-u", "train.py"], ["train.py"]),  # -u changes nothing: workers are unbuffered already
    (["{bin}/python", "-m", "pkg.main", "-x"], ["-m", "pkg.main", "-x"]),
    (["{bin}/python", "-c", "print(1)", "a"], ["-c", "print(1)", "a"]),
    (["{bin}/python", "-O", "train.py"], None),  # an option the preloader's interpreter does not run with
    (["{bin}/python", "missing.py"], None),  # python's own error says it better
    (["{bin}/python", "app.zip"], None),  # not a .py file
    (["{bin}/python", "-m"], None),
    (["{bin}/python"], None),
    (["{bin}/other", "train.py"], None),  # another program
    (["{tmp}/python3.11", "train.py"], None),  # the same file outside the environment's bin: another sys.prefix
    (["bash", "-c", "python train.py"], None),
    ([], None),
])
def test_forkable_commands_are_this_python_on_a_script_module_or_code(
        python_dir: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str], command: list[str] | None) -> None:
    monkeypatch.chdir(python_dir.parent)
    words = [w.format(bin=python_dir, tmp=python_dir.parent) for w in argv]
    assert forkable(words, str(python_dir / "python"), str(python_dir)) == command


def _request(**fields: object) -> bytes:
    base: dict[str, object] = {"id": 1, "argv": ["python", "t.py"], "command": ["t.py"], "env": {"A": "1"},
                               "cwd": "/"}
    base.update(fields)
    return json.dumps({k: v for k, v in base.items() if v is not ...}).encode()


def test_a_request_is_read_with_its_fields() -> None:
    request = parse_request(_request(command=["-m", "pkg", "x"]))
    assert (request.id, request.argv, request.command, request.env, request.cwd) == \
        (1, ["python", "t.py"], ["-m", "pkg", "x"], {"A": "1"}, "/")


@pytest.mark.parametrize("raw", [
    _request(id="1"), _request(id=...), _request(extra=1), _request(command=[]), _request(command="t.py"),
    _request(command=["t.py", 3]), _request(argv=[]), _request(env={"A": 1}), _request(env=[["A", "1"]]),
    _request(cwd=None), _request(command=["-m"]), _request(command=["-c"]), b"[1, 2]", b"\x80not json",
])
def test_a_malformed_request_is_refused(raw: bytes) -> None:
    with pytest.raises(ValueError):
        parse_request(raw)


def test_preload_takes_names_comma_separated_or_repeated() -> None:
    args = _parse(build_parser(), ["launch", "-np", "2", "--preload", "torch, sluice.torch", "--preload", "numpy",
                                   sys.executable, "t.py"])
    assert run_options(args, {}).preload == ("torch", "sluice.torch", "numpy")
    bad = _parse(build_parser(), ["launch", "-np", "2", "--preload", "torch;rm -rf", sys.executable, "t.py"])
    with pytest.raises(ValueError, match="not a module name"):
        run_options(bad, {})


def test_the_interpreter_running_the_tests_is_its_own_forkable_python(tmp_path: Path) -> None:
    script = tmp_path / "t.py"
    script.write_text("")
    assert forkable([sys.executable, str(script)], sys.executable, os.environ.get("PATH")) == [str(script)]
