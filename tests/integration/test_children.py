"""Forked test children (testbed/children.py, testbed/cluster.py) leave no temporary file behind."""

from __future__ import annotations

import os
import tempfile
import time

import pytest

from testbed.children import Children


def _leave_a_temporary_file() -> str:
    # as TensorFlow's autograph does: removed by an atexit handler, which a forked child's os._exit skips
    with tempfile.NamedTemporaryFile(prefix="left-behind-", suffix=".py", delete=False) as file:
        return file.name


@pytest.mark.timeout(30)
def test_a_forked_childs_temporary_files_are_removed_as_it_ends() -> None:
    with Children() as children:
        children.start("child", _leave_a_temporary_file)
        path = children.collect(["child"], timeout=20)["child"]
    assert os.path.dirname(os.path.dirname(path)) == tempfile.gettempdir(), path  # in a directory of its own
    assert not os.path.exists(os.path.dirname(path)), path


def _leave_a_file_and_hang(files: object) -> None:
    with tempfile.NamedTemporaryFile(prefix="left-behind-", delete=False) as file:
        files.put(file.name)  # type: ignore[attr-defined]
    time.sleep(60)  # killed before it ends: its own removal never runs


@pytest.mark.timeout(30)
def test_a_killed_forked_childs_directory_is_removed_by_the_parent() -> None:
    with Children() as children:
        files = children.queue()
        children.start("child", _leave_a_file_and_hang, files)
        path = files.get(timeout=20)
        assert os.path.exists(path)
        children.close(grace=0.1)  # kills it
    assert not os.path.exists(os.path.dirname(path)), path
