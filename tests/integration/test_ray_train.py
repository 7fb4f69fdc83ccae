"""Sluice on a local Ray cluster, under Ray Train (`TorchTrainer(..., torch_config=SluiceConfig(servers=1))`) and
through Horovod's RayExecutor: `import sluice.torch as hvd` in the training function trains as single-process SGD
does, one parameter through the server and one by allreduce; a rank that raises fails the run naming that rank;
nothing of the job outlives it."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration import ray_jobs

# found, not imported: importing Ray would cost every test process that collects this module seconds
pytestmark = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                                reason="Ray is not installed: pip install 'sluice-ps[ray]'")

ROOT = Path(__file__).resolve().parents[2]
STEPS = 5


def _environ_of(pid: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # gone, or another user's
        return b""


def _left_of(scheduler: str) -> list[str]:
    """What of the job still runs: its servers (started with SLUICE_SCHEDULER set to the scheduler's endpoint;
    the Ray workers set it later, which /proc/PID/environ does not show), and its scheduler, by its port."""
    mark = f"SLUICE_SCHEDULER={scheduler}".encode()
    left = [f"pid {pid}" for pid in os.listdir("/proc") if pid.isdigit() and mark in _environ_of(pid).split(b"\0")]
    host, _, port = scheduler.removeprefix("tcp://").rpartition(":")
    with socket.socket() as probe:
        if probe.connect_ex((host, int(port))) == 0:
            left.append(f"a listener on {scheduler}")
    return left


def _records_of(folder: Path, ranks: int, wait_s: float = 15.0) -> list[dict[str, Any]]:
    """Each rank's record; ray.get raises the failed rank's error as soon as it has it, while another rank may still
    be writing its record after the same last collective."""
    deadline = time.monotonic() + wait_s
    paths = [folder / f"rank{rank}.json" for rank in range(ranks)]
    while not all(path.exists() for path in paths) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [json.loads(path.read_text()) for path in paths]


def _check_trained(records: list[dict[str, Any]]) -> None:
    expected = ray_jobs.reference(STEPS)
    for rank, record in enumerate(records):
        assert (record["rank"], record["size"], record["local_rank"], record["env_rank"]) == (rank, 2, rank, str(rank))
        assert record["routes"] == {"weight": "ps", "bias": "allreduce"}
        assert record["all_params"] == [records[0]["params"]] * 2  # the ranks agree
        assert record["losses"][-1] < record["losses"][0] / 4
        assert not record["secret_in_environ"]
        for got, want in zip(record["params"], expected, strict=True):
            assert got == pytest.approx(want, rel=1e-5, abs=1e-6)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """A Ray cluster of its own ("local", 2 CPUs), never one a `ray start` left on this machine, for this module's
    tests; its session files in a folder of its own, removed after it (a short path: Ray's Unix sockets live there)."""
    import ray

    ray_dir = tempfile.mkdtemp(prefix="sluice-ray-")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=ray_dir,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}})
    try:
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(ray_dir, ignore_errors=True)


#: both routes in one job: the weight through the server, the bias by allreduce among the workers
ROUTES = ["collective.ps_patterns=weight", "collective.allreduce_patterns=bias"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ray_train_through_a_server_and_by_allreduce_then_a_failing_rank(tmp_path: Path, ray_cluster: None) -> None:
    from ray.train import RunConfig, ScalingConfig, TrainingFailedError
    from ray.train.torch import TorchTrainer

    from sluice.ray import SluiceConfig

    # a configuration mistake fails on the driver, at once, saying what is wrong
    with pytest.raises(ValueError, match="server count"):
        SluiceConfig(servers=-1)
    with pytest.raises(ValueError, match=r"collective\.no_such_field"):
        SluiceConfig(settings=["collective.no_such_field=1"])
    with pytest.raises(ValueError, match="FailureConfig"):
        SluiceConfig(servers=1, settings=["ps.recover=true"])

    trainer = TorchTrainer(ray_jobs.train, torch_config=SluiceConfig(servers=1, settings=ROUTES),
                           scaling_config=ScalingConfig(num_workers=2),
                           train_loop_config={"steps": STEPS, "out": str(tmp_path), "fail_rank": 1},
                           run_config=RunConfig(storage_path=str(tmp_path / "storage")))
    with pytest.raises(TrainingFailedError, match=r"(?s)Rank 1.*deliberate failure on rank 1"):
        trainer.fit()
    records = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    _check_trained(records)
    assert not _left_of(records[0]["scheduler"])


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ray_executor_as_horovods_tests_use_it(tmp_path: Path, ray_cluster: None) -> None:
    """Horovod's test/single/test_ray.py cases, with `from sluice.ray import RayExecutor` for horovod.ray's."""
    from sluice.ray import BaseHorovodWorker, RayExecutor

    class Mixin(BaseHorovodWorker):  # Horovod's test_horovod_mixin
        pass

    assert Mixin().hostname() == socket.gethostname()
    # Horovod's test_infeasible_placement: 4 workers on 2 CPUs cannot be placed, start() times out, shutdown() works
    infeasible = RayExecutor(RayExecutor.create_settings(timeout_s=30, placement_group_timeout_s=2), num_workers=4)
    with pytest.raises(TimeoutError, match="could not place 4 workers"):
        infeasible.start()
    infeasible.shutdown()
    settings = RayExecutor.create_settings(timeout_s=30)
    with pytest.raises(ValueError, match="Both `min_workers` and `num_workers` provided"):
        RayExecutor(settings, num_workers=2, min_workers=1)
    with pytest.raises(ValueError, match="elastic RayExecutor is not offered"):
        RayExecutor(settings, min_workers=1)

    executor = RayExecutor(settings, num_hosts=1, num_workers_per_host=2, servers=1, config=ROUTES)
    executor.start(executable_cls=ray_jobs.Executable, executable_args=[2], extra_env_vars={"TEST": "7"})
    try:
        assert executor.execute(lambda w: w.rank_epoch()) == [0, 2]  # test_ray_executable
        assert executor.run(ray_jobs.rank_times, args=[3]) == [0, 3]  # test_ray_exec_func
        import ray

        assert ray.get(executor.run_remote(ray_jobs.rank_times, args=[5])) == [0, 5]  # test_ray_exec_remote_func
        assert executor.execute_single(lambda w: w.hvd.rank()) == 0
        assert executor.execute(lambda _: (socket.gethostname(), os.environ["TEST"])) == [(socket.gethostname(),
                                                                                            "7")] * 2
        # a training function through run(), a failing rank raising from run() as ray.get raises it
        with pytest.raises(RuntimeError, match="deliberate failure on rank 1"):
            executor.run(ray_jobs.train, args=[{"steps": STEPS, "out": str(tmp_path), "fail_rank": 1}])
        records = _records_of(tmp_path, 2)
        _check_trained(records)
        assert executor.run(ray_jobs.rank_times, args=[1]) == [0, 1]  # the job goes on after the error
    finally:
        executor.shutdown()
    assert not _left_of(records[0]["scheduler"])
