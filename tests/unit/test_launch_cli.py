"""`sluice launch`'s command line: horovodrun's and torchrun's flags, where the worker command starts, -s's default."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from sluice.launch.cli import _parse, build_parser, main
from sluice.launch.config import HOROVOD_VARS, load_config
from sluice.launch.foreign_flags import HOROVOD_IGNORED_VARS, ignored_variables, python_command, translate
from sluice.launch.hosts import Host
from sluice.launch.launch_job import default_servers, is_elastic, ready_timeout, servers_needed
from sluice.launch.master_port import MasterPortError, bind_probe, choose, parse_answer
from sluice.launch.output import ChildOutput, folder
from sluice.launch.run_options import OutputOptions, log_level, run_options

pytestmark = pytest.mark.timeout(30)


def _parse_launch(*words: str) -> argparse.Namespace:
    return _parse(build_parser(), ["launch", *words])


@pytest.mark.parametrize(("words", "command"), [
    (["-np", "2", "python", "train.py", "--epochs", "3"], ["python", "train.py", "--epochs", "3"]),
    (["-w", "2", "--", "python", "-u", "train.py"], ["python", "-u", "train.py"]),
    (["-w2", "-Hnode1:2", "python", "t.py"], ["python", "t.py"]),
    (["--num-proc=2", "--mpi-args", "--map-by ppr:1:node", "--gloo", "python", "t.py"], ["python", "t.py"]),
    (["-np", "2", "--blacklist-cooldown-range", "1", "5", "-p", "22", "python", "t.py"], ["python", "t.py"]),
])
def test_the_worker_command_starts_at_dashes_or_the_first_word_that_is_no_option(words: list[str],
                                                                                 command: list[str]) -> None:
    args = _parse_launch(*words)
    assert args.worker_command == command
    assert args.workers == 2


# horovodrun's flags from its parse_args, each with a value where it takes one
HOROVODRUN_LINE = [
    "-np", "4", "-H", "a:2,b:2", "-p", "2222", "-i", "/k", "--start-timeout", "45", "--network-interface", "eth0",
    "--output-filename", "/tmp/o", "--verbose", "--disable-cache", "--config-file", "c.toml",
    "--fusion-threshold-mb", "32", "--cycle-time-ms", "2.5", "--cache-capacity", "1024",
    "--hierarchical-allreduce", "--no-hierarchical-allgather", "--torus-allreduce", "--autotune",
    "--autotune-log-file", "x", "--min-np", "2", "--max-np", "8", "--slots-per-host", "2", "--elastic-timeout", "60",
    "--reset-limit", "3", "--blacklist-cooldown-range", "10", "100", "--timeline-filename", "t.json",
    "--timeline-mark-cycles", "--no-stall-check", "--stall-check-warning-time-seconds", "30",
    "--stall-check-shutdown-time-seconds", "90", "--mpi-threads-disable", "--mpi-args=--oversubscribe",
    "--tcp", "--binding-args", "x", "--num-nccl-streams", "2", "--thread-affinity", "1",
    "--gloo-timeout-seconds", "40", "--log-level", "trace", "--log-without-timestamp", "-prefix-timestamp",
    "--host-discovery-script", "d.sh", "--gloo", "python", "train.py",
]


def test_horovodruns_flags_mean_ours_or_are_ignored_with_a_reason() -> None:
    args = _parse_launch(*HOROVODRUN_LINE)
    assert args.worker_command == ["python", "train.py"]
    sets, notes = translate(args, has_hosts=True)
    assert (args.workers, args.hosts, args.ssh_port, args.ssh_identity) == (4, "a:2,b:2", 2222, "/k")
    assert (args.ready_timeout, args.min_workers, args.max_workers, args.reset_limit) == (45, 2, 8, 3)
    assert (args.config, args.timeline, args.output_filename) == ("c.toml", "t.json", "/tmp/o")
    assert args.prefix_output_with_timestamp and args.verbose and args.log_level == "DEBUG"
    assert sets == ["collective.fusion_bytes=33554432", "collective.cycle_ms=2.5", "collective.hierarchical=true",
                    "collective.stall_timeout=90.0", "scheduler.op_timeout=40.0"]
    assert load_config(None, {}, ["collective.hierarchical=false"]).collective.hierarchical is False
    for flag in ("--gloo", "--disable-cache", "--network-interface", "--no-hierarchical-allgather", "--tcp",
                 "--blacklist-cooldown-range", "--mpi-args", "--autotune-log-file"):
        assert any(note.startswith(f"{flag} is ignored: ") for note in notes), flag
    # the settings they stand for load
    load_config(None, {}, sets)


@pytest.mark.parametrize(("words", "elastic", "note"), [
    (["-np", "4"], False, False),
    (["-np", "4", "--elastic"], True, False),
    # horovodrun's _is_elastic: --min-np, or a discovery script, makes the job elastic; --max-np alone does not
    (["-np", "4", "--min-np", "2"], True, False),
    (["-np", "4", "--min-workers", "2"], True, False),
    (["-np", "4", "--min-np", "2", "--max-np", "8"], True, False),
    (["-np", "4", "--host-discovery-script", "d.sh"], True, False),
    (["-np", "4", "--max-np", "8"], False, True),
])
def test_horovodruns_elastic_flags_make_the_job_elastic_as_there(
        words: list[str], elastic: bool, note: bool, capsys: pytest.CaptureFixture[str]) -> None:
    assert is_elastic(_parse_launch(*words, "python", "t.py")) is elastic
    assert ("--max-workers (--max-np) is ignored: the job is not elastic" in capsys.readouterr().err) is note


def test_in_place_alone_says_the_job_must_be_elastic() -> None:
    with pytest.raises(ValueError, match="--in-place needs an elastic job"):
        is_elastic(_parse_launch("-np", "4", "--in-place", "python", "t.py"))


def test_check_build_lists_what_is_installed_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    for flag in ("-cb", "--check-build"):
        assert main(["launch", flag]) == 0
        out = capsys.readouterr().out
        assert out.startswith("Sluice ") and "[X] PyTorch (torch " in out and "[X] ZeroMQ (pyzmq " in out, out


def test_help_lists_horovodruns_and_torchruns_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "--help"]) == 0
    text = capsys.readouterr().out
    group = text[text.index("horovodrun's flags:") : text.index("torchrun's flags:")]
    for flag in ("-np", "--num-proc", "-hostfile", "--fusion-threshold-mb", "--gloo", "--min-np", "--reset-limit",
                 "--timeline-filename", "--start-timeout", "--ssh-identity-file", "--config-file", "--version"):
        assert re.search(rf"(^|[ ,]){re.escape(flag)}[ ,\n]", group), flag
    assert "--output-filename" in group and "--prefix-output-with-timestamp" in group
    torchrun = text[text.index("torchrun's flags:") :]
    for flag in ("--nproc-per-node", "--nproc_per_node", "--log-dir", "--tee", "--redirects", "--master_port"):
        assert flag in torchrun, flag


@pytest.mark.parametrize(("flag", "suggestion"), [("--verbos", "--verbose"), ("--master-prot", "--master-port"),
                                                  ("--hosts-file", "--hostfile"), ("--bogus", None)])
def test_an_unknown_flag_is_named_with_the_nearest_known_one(flag: str, suggestion: str | None,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "-np", "2", flag, "python", "x.py"]) == 2
    err = capsys.readouterr().err
    assert f"unknown option {flag}" in err
    assert (f"did you mean {suggestion}?" in err) if suggestion else "did you mean" not in err


def test_flag_errors_say_what_was_meant(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "-np", "2", "--nproc-per-node", "3", "python", "x.py"]) == 2
    assert "--nproc-per-node 3 and -w 2 disagree" in capsys.readouterr().err
    assert main(["launch", "-np", "2", "--tee", "3", "python", "x.py"]) == 2
    assert "give --log-dir DIR too" in capsys.readouterr().err
    assert main(["launch", "-np", "2", "--log-dir", "d", "--tee", "0:1", "python", "x.py"]) == 2
    assert "a value per rank (0:1,1:2) is not supported" in capsys.readouterr().err
    assert main(["launch", "-np", "2", "--log-level", "loud", "python", "x.py"]) == 2
    assert "'loud' is not a log level" in capsys.readouterr().err
    assert main(["launch", "-w", "1", "-s", "0", "--set", "worker.optimizer_on=server", "python", "x.py"]) == 2
    assert 'worker.optimizer_on = "server" need parameter servers' in capsys.readouterr().err
    assert main(["launch", "python", "x.py"]) == 2
    assert "-w N (or -np N) is required" in capsys.readouterr().err


def test_torchruns_counts_are_workers_here_and_slots_on_hosts() -> None:
    args = _parse_launch("--nproc_per_node", "3", "--master_port", "29500", "--log_dir", "logs", "train.py")
    translate(args, has_hosts=False)
    assert (args.workers, args.master_port, args.output_filename) == (3, 29500, "logs")
    args = _parse_launch("-H", "a,b:4,[::1]", "--nproc-per-node", "2", "train.py")
    translate(args, has_hosts=True)
    assert args.hosts == "a:2,b:4,[::1]"


def test_servers_default_to_what_the_configuration_needs() -> None:
    plain = load_config(None, {}, [])
    assert servers_needed(plain, 0) == [] and default_servers([], [Host("a"), Host("b")], None) == 0
    on_server = load_config(None, {}, ["worker.optimizer_on=server"])
    reasons = servers_needed(on_server, 0)
    assert reasons == ['worker.optimizer_on = "server"']
    assert default_servers(reasons, [], None) == 1  # this machine alone
    assert default_servers(reasons, [Host("a", 4), Host("b", 4)], None) == 2  # one per host
    assert default_servers(reasons, [Host("a"), Host("b"), Host("c")], "b,c") == 2
    assert servers_needed(plain, 2) == ["-a 2"]
    assert len(servers_needed(load_config(None, {}, ["collective.mode=ps", "ps.sync=false"]), 0)) == 2


def test_run_options_from_flags_and_environment() -> None:
    args = _parse_launch("-np", "2", "--log-dir", "d", "--redirects", "1", "--tee", "2", "--verbose", "x")
    translate(args, has_hosts=False)
    options = run_options(args, {"MASTER_PORT": "29400"})
    assert options.output.files == {"stdout", "stderr"} and options.output.console == {"stderr"}
    assert options.log_level == "DEBUG" and options.master_port == 29400
    assert options.environ() == {"SLUICE_LOG_LEVEL": "DEBUG"}
    with pytest.raises(ValueError, match="MASTER_PORT='x' is not a port number"):
        run_options(_parse_launch("-np", "1", "x"), {"MASTER_PORT": "x"})
    assert log_level("fatal") == "CRITICAL" and log_level("Trace") == "DEBUG"


@pytest.mark.parametrize(("environ", "flags", "level"), [
    ({}, (), "INFO"),
    ({"HOROVOD_LOG_LEVEL": "debug"}, (), "DEBUG"),  # a job script's export, horovodrun's names in any case
    ({"HOROVOD_LOG_LEVEL": "trace"}, (), "DEBUG"),
    ({"HOROVOD_LOG_LEVEL": "fatal"}, (), "CRITICAL"),
    ({"HOROVOD_LOG_LEVEL": "loud"}, (), "WARNING"),  # a name Horovod does not know is its default there
    ({"HOROVOD_LOG_LEVEL": "debug", "SLUICE_LOG_LEVEL": "ERROR"}, (), "ERROR"),  # ours first
    ({"HOROVOD_LOG_LEVEL": "debug"}, ("--log-level", "ERROR"), "ERROR"),  # the flag above both
])
def test_horovods_log_level_variable_sets_the_jobs_level(environ: dict[str, str], flags: tuple[str, ...],
                                                         level: str) -> None:
    options = run_options(_parse_launch("-np", "1", *flags, "x"), environ)
    assert options.log_level == level and options.environ()["SLUICE_LOG_LEVEL"] == level


@pytest.mark.parametrize(("flag", "environ", "seconds"), [
    (None, {}, 60.0),
    (None, {"HOROVOD_START_TIMEOUT": "600"}, 600.0),  # a horovodrun job script's export
    (45.0, {"HOROVOD_START_TIMEOUT": "600"}, 45.0),  # the flag first, as there
    (None, {"HOROVOD_START_TIMEOUT": "soon"}, "HOROVOD_START_TIMEOUT='soon' must be a positive number"),
    (None, {"HOROVOD_START_TIMEOUT": "0"}, "HOROVOD_START_TIMEOUT='0' must be a positive number"),
    (-1.0, {}, r"--ready-timeout \(--start-timeout\) must be a positive number"),
])
def test_horovods_start_timeout_variable_is_the_ready_timeouts_default(flag: float | None, environ: dict[str, str],
                                                                       seconds: float | str) -> None:
    if isinstance(seconds, str):
        with pytest.raises(ValueError, match=seconds):
            ready_timeout(flag, environ)
    else:
        assert ready_timeout(flag, environ) == seconds


def test_torchruns_script_and_module_run_with_this_python(tmp_path: Path) -> None:
    plain, tool = tmp_path / "train.py", tmp_path / "tool.py"
    plain.write_text("")
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    py = "/env/bin/python"
    assert python_command([str(plain), "--lr", "1"], False, False, py) == [py, "-u", str(plain), "--lr", "1"]
    assert python_command([str(tool), "x"], False, False, py) == [str(tool), "x"]  # its #! line, as before
    assert python_command([str(plain)], False, True, py) == [str(plain)]  # --no-python: as it is
    assert python_command(["missing.py"], False, False, py) == ["missing.py"]  # its error is the OS's, as before
    assert python_command(["python", "t.py"], False, False, py) == ["python", "t.py"]
    assert python_command(["pkg.train", "--lr", "1"], True, False, py) == [py, "-u", "-m", "pkg.train", "--lr", "1"]
    with pytest.raises(ValueError, match="Don't use both the '--no-python' flag and the '--module' flag"):
        python_command(["pkg.train"], True, True, py)
    args = _parse_launch("--nproc-per-node", "2", "-m", "pkg.train", "--lr", "1")
    translate(args, has_hosts=False)
    assert args.worker_command == [sys.executable, "-u", "-m", "pkg.train", "--lr", "1"] and args.workers == 2


def test_every_torchrun_flag_is_taken_and_those_without_a_meaning_here_are_noted(tmp_path: Path) -> None:
    """Every flag of torch 2.13's torchrun (torch/distributed/run.py): a torchrun command line runs unchanged."""
    script = tmp_path / "train.py"
    script.write_text("")
    script.chmod(0o755)
    args = _parse_launch(
        "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "--rdzv-id",
        "7", "--rdzv-conf", "timeout=9", "--standalone", "--max-restarts", "0", "--monitor-interval", "0.1",
        "--start-method", "spawn", "--event-log-handler", "null", "--role", "trainer", "--run-path", "--log-dir",
        str(tmp_path / "logs"), "--tee", "3", "--local-ranks-filter", "0", "--duplicate-stdout-filters", "a",
        "--duplicate-stderr-filters", "b", "--node-rank", "0", "--master-addr", "h", "--master-port", "29500",
        "--local-addr", "h", "--logs-specs", "x", "--numa-binding", "node", "--signals-to-handle", "SIGTERM",
        "--shutdown-timeout", "5", "--virtual-local-rank", str(script), "--lr", "1")
    _, notes = translate(args, has_hosts=False)
    assert args.worker_command == [sys.executable, "-u", str(script), "--lr", "1"]  # --run-path: this Python
    assert args.workers == 2 and args.master_port == 29500
    ignored = sorted(note.split()[0] for note in notes)
    # --nnodes, --node-rank, --master-addr, --rdzv-endpoint and --rdzv-conf are taken: one launcher per machine
    # (node_group.py)
    assert ignored == sorted(["--rdzv-backend", "--rdzv-id",
                              "--standalone", "--monitor-interval", "--start-method", "--event-log-handler", "--role",
                              "--duplicate-stdout-filters", "--duplicate-stderr-filters",
                              "--local-addr", "--logs-specs", "--numa-binding",
                              "--signals-to-handle", "--shutdown-timeout", "--virtual-local-rank"])
    assert (args.nnodes, args.node_rank, args.master_addr, args.rdzv_endpoint, args.rdzv_conf) == (
        "1", 0, "h", "h:1", "timeout=9")


def test_horovods_variables_without_a_meaning_here_are_noted_with_why() -> None:
    notes = ignored_variables({"HOROVOD_AUTOTUNE": "1", "HOROVOD_CACHE_CAPACITY": "0", "HOROVOD_CYCLE_TIME": "5",
                               "HOROVOD_GPU_OPERATIONS": "NCCL", "PATH": "/bin"})
    assert notes == ["the variable HOROVOD_CACHE_CAPACITY is ignored: Sluice keeps no response cache to size",
                     "the variable HOROVOD_AUTOTUNE is ignored: Sluice does not autotune: it plans fusion groups "
                     "from the gradients' sizes and order",
                     "the variable HOROVOD_GPU_OPERATIONS is ignored: Sluice does not use NCCL"]
    assert not set(HOROVOD_IGNORED_VARS) & set(HOROVOD_VARS)  # one that means something is never noted


def test_local_ranks_filter_takes_torchruns_list(capsys: pytest.CaptureFixture[str]) -> None:
    options = run_options(_parse_launch("-np", "2", "--local_ranks_filter", "0,2", "x"), {})
    assert options.output.ranks == {0, 2}
    assert run_options(_parse_launch("-np", "2", "x"), {}).output.ranks is None
    for wrong in ("", "a", "-1"):
        with pytest.raises(SystemExit):
            _parse_launch("-np", "2", f"--local-ranks-filter={wrong}", "x")
    assert "give a comma-separated list of local ranks" in capsys.readouterr().err


def test_a_wrong_sluice_log_level_says_which_variable() -> None:
    with pytest.raises(ValueError, match="SLUICE_LOG_LEVEL: 'loud' is not a log level"):
        run_options(_parse_launch("-np", "1", "x"), {"SLUICE_LOG_LEVEL": "loud", "HOROVOD_LOG_LEVEL": "debug"})


def test_per_rank_files_take_horovodruns_layout(tmp_path: Path) -> None:
    assert [folder("worker", r, 12) for r in (0, 11)] == ["rank.00", "rank.11"]
    assert (folder("worker", 0, 1), folder("server", 1, 12), folder("scheduler", 0, 3)) == ("rank.0", "server.1",
                                                                                           "scheduler")
    shown: list[bytes] = []

    class Terminal:
        def write(self, data: bytes) -> None:
            shown.append(data)

    options = OutputOptions(str(tmp_path), console=frozenset({"stdout"}), timestamps=True)
    out = ChildOutput(Terminal(), "worker 1", options, "rank.1")
    out.write("stdout", [b"hello"])
    out.write("stderr", [b"oops"])  # to the file only: redirected
    out.close("stdout")
    out.close("stderr")
    assert re.fullmatch(rb"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3} \[worker 1\] hello\n", b"".join(shown))
    assert (tmp_path / "rank.1" / "stdout").read_text().endswith(" hello\n")
    assert (tmp_path / "rank.1" / "stderr").read_text().endswith(" oops\n")
    again = ChildOutput(Terminal(), "worker 1", options, "rank.1")  # a later generation appends
    again.write("stdout", [b"more"])
    again.close("stdout")
    assert (tmp_path / "rank.1" / "stdout").read_text().count("\n") == 2


def test_a_taken_master_port_is_named_with_what_to_do() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(OSError):
            bind_probe(port)

        class Here:
            plan = None

        with pytest.raises(MasterPortError, match=f"MASTER_PORT {port} cannot be used on this machine .*--master-port"):
            asyncio.run(choose(Here(), port))  # type: ignore[arg-type]
    assert 0 < asyncio.run(choose(Here(), None)) < 65536  # type: ignore[arg-type]
    assert parse_answer("noise\nSLUICE_FREE_PORT 29500\n", 0) == 29500
    assert parse_answer("SLUICE_FREE_PORT 29500", 29501) is None and parse_answer("SLUICE_FREE_PORT x", 0) is None


def test_the_remote_stub_takes_split_streams_only_as_a_boolean() -> None:
    from sluice.launch.reach import header_line
    from sluice.launch.remote import parse_header

    assert parse_header(header_line(["python"], {}, "/", b"k" * 16, split=True)).split
    assert not parse_header(header_line(["python"], {}, "/", b"k" * 16)).split
    with pytest.raises(ValueError, match="split and outlive must be true or false"):
        parse_header(b'{"argv": ["p"], "env": {}, "cwd": "/", "secret": "", "split": "yes"}')
    with pytest.raises(ValueError, match="must be an object with argv"):
        parse_header(b'{"argv": ["p"], "env": {}, "cwd": "/", "secret": "", "other": 1}')


_THREADS_AT_IMPORT = ("import os, sys; sys.argv = ['sluice', *sys.argv[1:]]; import sluice.launch.cli, numpy; "
                      "print(os.environ.get('OPENBLAS_NUM_THREADS'), len(os.listdir('/proc/self/task')))")


@pytest.mark.parametrize(("command", "preset", "blas", "threads"), [
    ("scheduler", None, "1", 1),
    ("server", "3", "3", None),  # the user's value is kept
    ("launch", None, None, None),  # the launcher's environment is its workers': theirs to choose
])
def test_a_roles_process_starts_openblas_with_one_thread(command: str, preset: str | None, blas: str | None,
                                                        threads: int | None) -> None:
    """numpy's OpenBLAS pool (a spinning thread per core) costs a role 0.2 of its 0.54 CPU-s start here,
    and a role's BLAS work is too small to share among threads (launch/lean_roles.py)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    if preset is not None:
        env["OPENBLAS_NUM_THREADS"] = preset
    done = subprocess.run([sys.executable, "-c", _THREADS_AT_IMPORT, command], env=env, capture_output=True,
                          text=True, timeout=25, check=True)
    seen_blas, seen_threads = done.stdout.split()
    assert seen_blas == str(blas)
    if threads is not None:
        assert int(seen_threads) == threads  # no pool: the main thread alone after numpy's import
