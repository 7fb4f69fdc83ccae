"""`sluice launch --preload`: a worker forked from the preloader runs as one started afresh would, and starts sooner.

Each check runs the same job both ways and compares what the workers saw (tests/integration/preload_probe/):
argv, __main__, sys.path[0], the environment, descriptors, session, the command line `ps` shows, and an
uncaught exception's traceback. The launcher's own reports (exit codes, signals, a killed launcher) are
test_launch.py's, run both ways there.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys

import pytest

from testbed.launch import Launch

PROBE = "tests/integration/preload_probe/probe.py"
PROBE_MODULE = "tests.integration.preload_probe.probe"
PROBE_CODE = ("import json; from tests.integration.preload_probe.probe import seen; "
              "print('PROBE', json.dumps(seen()), flush=True)")
PRELOAD = ["--preload", "sluice.worker.node"]
#: the probes never join their job: without this the launcher gives its scheduler 10 s to leave by itself
NO_GRACE = ["--grace", "0"]
FORMS = {"script": [PROBE, "a", "-b"], "module": ["-m", PROBE_MODULE, "a"], "code": ["-c", PROBE_CODE, "a"]}


def _probes(job: Launch) -> dict[int, dict[str, object]]:
    """rank -> what that worker printed on its PROBE line."""
    return {int(m.group(1)): json.loads(m.group(2))
            for m in re.finditer(r"^\[worker (\d+)\] PROBE (.*)$", job.stdout(), re.M)}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("form", [*FORMS, "script-safe-path"])
def test_a_forked_worker_sees_what_a_started_one_sees(launch: type[Launch], form: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Each form of a Python command; and a script under PYTHONSAFEPATH=1 (python -P: no sys.path[0] at all)."""
    if form == "script-safe-path":
        monkeypatch.setenv("PYTHONSAFEPATH", "1")
        form = "script"
    seen = {}
    for start in ([], PRELOAD):
        job = launch(["-w", "2", "-s", "0", *NO_GRACE, *start, "--", sys.executable, "-u", *FORMS[form]])
        assert job.finish(45) == 0, job.stderr()
        seen["preload" if start else "exec"] = _probes(job)
        job.assert_none_left()
    if form != "code":  # it says whether Sluice's worker module was there before its first import
        assert [seen["exec"][r].pop("preloaded") for r in (0, 1)] == [False, False]
        assert [seen["preload"][r].pop("preloaded") for r in (0, 1)] == [True, True]
        for how in ("exec", "preload"):  # unseeded generators: each worker draws its own numbers
            first, second = (seen[how][r].pop("draws") for r in (0, 1))
            assert first[0] != second[0] and first[1] != second[1], (how, first, second)
    assert seen["preload"] == seen["exec"]
    assert seen["exec"][1]["ranks"] == ["1", "1", "1", "2"] and seen["exec"][0]["session_leader"] is True
    assert seen["exec"][0]["cmdline"][1:] == ["-u", *FORMS[form]]  # what `ps` shows: the worker's command line


@pytest.mark.timeout(90)
def test_a_forked_workers_uncaught_exception_reads_as_pythons_and_ends_the_job_alike(launch: type[Launch]) -> None:
    told = {}
    for start in ([], PRELOAD):
        job = launch(["-w", "2", "-s", "0", *start, "--", sys.executable, PROBE, "fail"])
        assert job.finish(45) == 1
        report = re.sub(r"pid \d+", "pid N", job.stderr()).replace('"preloaded": true', '"preloaded": false')
        report = re.sub(r'"draws": \[[^]]*\]', '"draws": []', report)
        told["preload" if start else "exec"] = report
        job.assert_none_left()
    assert told["preload"] == told["exec"]
    assert "worker 1 (pid N) exited with code 1" in told["exec"]
    traceback = told["exec"][told["exec"].index("Traceback"):]
    assert "preloader" not in traceback and "runpy" not in traceback
    assert re.search(r'File ".*probe\.py", line \d+, in fail\n\s+raise ValueError', traceback), traceback
    assert "ValueError: a worker's own error" in traceback


@pytest.mark.timeout(60)
def test_a_module_that_cannot_be_imported_stops_the_job_before_any_worker(launch: type[Launch]) -> None:
    job = launch(["-w", "2", "-s", "1", "--preload", "sluice.worker.node,no_such_module", "--", sys.executable,
                  PROBE])
    assert job.finish(45) == 2
    assert ("sluice launch: --preload sluice.worker.node,no_such_module: it could not import the modules: "
            "ModuleNotFoundError: No module named 'no_such_module'; fix the module names, or leave it out"
            ) in job.stderr()
    assert "PROBE" not in job.stdout()
    job.assert_none_left()


@pytest.mark.timeout(60)
def test_ctrl_c_while_the_preloader_imports_stops_the_job_at_once(launch: type[Launch]) -> None:
    job = launch(["-w", "2", "-s", "1", "--preload", "tests.integration.preload_probe.slow_import", "--",
                  sys.executable, PROBE])
    job.wait_line(r"^\[launch\] scheduler ready at ", timeout=30)
    job.snapshot()
    os.kill(job.proc.pid, signal.SIGINT)
    assert job.finish(10) == 130
    assert "PROBE" not in job.stdout()
    job.assert_none_left()


@pytest.mark.timeout(60)
def test_a_command_the_preloader_cannot_run_starts_as_before(launch: type[Launch]) -> None:
    """Another program (here a shell running the probe): started afresh, the preloader unused but harmless."""
    job = launch(["-w", "1", "-s", "0", *NO_GRACE, *PRELOAD, "--", "sh", "-c", f"exec {sys.executable} {PROBE}"])
    assert job.finish(45) == 0, job.stderr()
    assert _probes(job)[0]["preloaded"] is False
