"""sluice.run's arguments: horovodrun's flags for Horovod's run() arguments, the errors Horovod's run() raises, and
the folder a launcher's janitor removes should the caller be killed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sluice.launch.cli import _parse, build_parser
from sluice.launch.janitor import remove_job_state
from sluice.launch.run_func import check_local, launch_argv, run
from sluice.launch.run_task import task_folder


@pytest.mark.parametrize(("options", "argv"), [
    ({}, ["-np", "2"]),
    ({"hosts": "localhost:2", "verbose": True, "use_gloo": True}, ["-np", "2", "-H", "localhost:2", "--verbose",
                                                                   "--gloo"]),
    ({"min_num_proc": 1, "max_num_proc": 4, "reset_limit": 3, "host_discovery_script": "./d.sh"},
     ["-np", "2", "--min-np", "1", "--max-np", "4", "--reset-limit", "3", "--host-discovery-script", "./d.sh"]),
    ({"slots": 2, "start_timeout": 30, "output_filename": "logs", "disable_cache": False},
     ["-np", "2", "--slots-per-host", "2", "--start-timeout", "30", "--output-filename", "logs"]),
    ({"cooldown_range": (10, 100), "network_interfaces": ["eth0", "eth1"], "ssh_port": 2222},
     ["-np", "2", "-p", "2222", "--blacklist-cooldown-range", "10", "100", "--network-interfaces", "eth0,eth1"]),
])
def test_horovods_run_arguments_are_horovodruns_flags(options: dict[str, Any], argv: list[str]) -> None:
    assert launch_argv(2, options) == argv


def test_the_flags_are_ones_sluice_launch_takes() -> None:
    every = {"hosts": "127.0.0.1:2", "min_num_proc": 1, "max_num_proc": 2, "slots": 2, "reset_limit": 1,
             "host_discovery_script": "d.sh", "start_timeout": 30, "ssh_port": 22, "ssh_identity_file": "k",
             "output_filename": "o", "mpi_args": "--map-by ppr:1:node", "disable_cache": True, "verbose": True,
             "use_gloo": True, "cooldown_range": (1, 2), "network_interfaces": ["lo"]}
    args = _parse(build_parser(), ["launch", *launch_argv(2, every), "--", "python", "x.py"])
    assert (args.workers, args.min_workers, args.worker_command) == (2, 1, ["python", "x.py"])


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"hosts": "localhost:2", "hostfile": "h"}, "Argument hosts and hostfile only allow one provided."),
    ({"use_gloo": True, "use_mpi": True}, "Argument use_gloo and use_mpi only allow one set True."),
    ({"hosts": "localhost:1,192.0.2.7:1"}, "192.0.2.7 is another"),
])
def test_run_refuses_what_horovod_refuses_and_other_hosts(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        run(print, num_proc=2, **kwargs)


def test_hosts_of_this_machine_pass(tmp_path: Path) -> None:
    check_local("localhost:2,127.0.0.1:1", None)
    (tmp_path / "hosts").write_text("localhost slots=2\n# another\n")
    check_local(None, str(tmp_path / "hosts"))
    (tmp_path / "far").write_text("192.0.2.7 slots=2\n")
    with pytest.raises(ValueError, match="another"):
        check_local(None, str(tmp_path / "far"))


@pytest.mark.parametrize(("command", "folder"), [
    (["/usr/bin/python3", "-m", "sluice.launch.run_task", "/tmp/sluice-run-ab12"], "/tmp/sluice-run-ab12"),
    (["python", "-m", "sluice.launch.run_task", "/tmp/other"], None),  # not a folder run() made: left alone
    (["python", "-m", "sluice.launch.run_task", "/tmp/sluice-run-ab12", "x"], None),
    (["python", "train.py", "/tmp/sluice-run-ab12"], None),
    (["python", "-m", "sluice.launch.run_task"], None),
])
def test_a_run_jobs_folder_is_read_from_its_worker_command_only(command: list[str], folder: str | None) -> None:
    assert task_folder(command) == folder


def test_the_janitor_removes_a_run_folder_and_nothing_else_named_by_a_path(tmp_path: Path) -> None:
    run_folder, other = tmp_path / "sluice-run-x1", tmp_path / "data"
    for made in (run_folder, other):
        made.mkdir()
        (made / "task.pkl").write_bytes(b"x")
    remove_job_state([str(run_folder), str(other), "sluice-run-relative"])
    assert not run_folder.exists() and (other / "task.pkl").exists()
