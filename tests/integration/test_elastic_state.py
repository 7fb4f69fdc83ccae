"""hvd.elastic against real worker processes, generation by generation as the elastic launcher runs them: a
generation commits and ends (a lost peer or SIGUSR1: exit status REFORM), the next, of another size, restores
the newest commit everywhere, a worker with no file of its own included, calls the reset callbacks and trains on."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from sluice.worker.torch.elastic_host import ENV_DIR, ENV_GENERATION, REFORM, read_commit
from sluice.worker.torch.elastic_sampler import ElasticSampler
from testbed.cluster import LocalCluster
from tests.integration import prefork

prefork.torch_optimizers()  # once here, not in every forked worker

pytestmark = pytest.mark.slow

SAMPLES, BATCH, BASE_LR = 60, 2, 0.05
_FORK = mp.get_context("fork")
#: a lost worker is noticed within a couple of seconds
FAST_FAILURE = {"scheduler": {"heartbeat_interval": 0.3, "heartbeat_timeout": 2.0}}


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(SAMPLES, 6, generator=generator), torch.randn(SAMPLES, 2, generator=generator)


def _flat(model: torch.nn.Module) -> list[float]:
    return torch.cat([t.detach().reshape(-1).double() for t in model.state_dict().values()]).tolist()


def _job(directories: list[Path] | None, stop: str, stop_rank: int, stop_at: int, until: int) -> dict[str, Any]:
    """Train with a commit after every batch, each rank's elastic directory (its "host") from `directories`.
    `stop`: "crash" (worker stop_rank dies after commit stop_at), "signal" (every worker gets SIGUSR1 before
    commit stop_at) or "" (train until batch `until`)."""
    import sluice.torch as hvd

    hvd.init()
    rank = hvd.rank()
    os.environ[ENV_DIR] = str(directories[rank]) if directories else ""  # none: not an elastic job
    torch.manual_seed(100 + rank)  # every worker starts different: restore() makes them equal
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=BASE_LR, momentum=0.9),
                                         named_parameters=model.named_parameters())
    sampler = ElasticSampler(list(range(SAMPLES)), seed=3)
    hooks: list[str] = []

    class State(hvd.elastic.TorchState):  # type: ignore[misc]
        def reset(self) -> None:  # Horovod's State.reset: called by on_reset, before the callbacks
            hooks.append("reset")

    state = State(model, optimizer, sampler=sampler, batch=0, resets=[])
    x, y = _data()
    out: dict[str, Any] = {}

    def on_reset() -> None:
        hooks.append("callback")
        state.resets.append(hvd.size())
        for group in optimizer.param_groups:
            group["lr"] = BASE_LR * hvd.size()

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state: Any) -> None:
        out["restored"] = {"params": _flat(state.model), "batch": state.batch, "commits": state.commits,
                           "resets": list(state.resets), "hooks": list(hooks), "lr": optimizer.param_groups[0]["lr"],
                           "momentum": [optimizer.state[p]["momentum_buffer"].tolist() for p in model.parameters()
                                        if "momentum_buffer" in optimizer.state[p]],
                           "indices": state.sampler.get_indices(0, BATCH)}
        done_here = 0
        while state.batch < until:
            mine = state.sampler.get_indices(done_here, BATCH)
            optimizer.zero_grad()
            F.mse_loss(model(x[mine]), y[mine]).backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            state.sampler.record_batch(done_here, BATCH)
            state.batch += 1
            done_here += 1
            if stop == "signal" and state.batch == stop_at:
                os.kill(os.getpid(), signal.SIGUSR1)
            state.commit()
            if stop == "crash" and rank == stop_rank and state.batch == stop_at:
                os._exit(1)  # a worker lost right after its commit

    train(state)
    hvd.synchronize_parameters()
    out["final"] = {"params": _flat(model), "batch": state.batch, "commits": state.commits}
    return out


def _reference(commit: dict[str, Any], size: int, steps: int) -> list[float]:
    """The parameters after `steps` more steps from `commit`, in one process on every worker's samples,
    computed in a child: autograd's threads in this process would break the next test's forked workers."""
    results = _FORK.Queue()
    child = _FORK.Process(target=lambda: results.put(_train_reference(commit, size, steps)), daemon=True)
    child.start()
    try:
        return list(results.get(timeout=60))
    finally:
        child.join(10)


def _train_reference(commit: dict[str, Any], size: int, steps: int) -> list[float]:
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    model.load_state_dict(commit["objects"]["model"])
    optimizer = torch.optim.SGD(model.parameters(), lr=BASE_LR, momentum=0.9)
    optimizer.load_state_dict(commit["objects"]["optimizer"])
    optimizer.param_groups[0]["lr"] = BASE_LR * size  # what the reset callback sets
    samplers = [ElasticSampler(list(range(SAMPLES)), seed=3, num_replicas=size, rank=r) for r in range(size)]
    for sampler in samplers:
        sampler.load_state_dict(commit["objects"]["sampler"])
    x, y = _data()
    for step in range(steps):
        batch = [i for sampler in samplers for i in sampler.get_indices(step, BATCH)]
        optimizer.zero_grad()
        F.mse_loss(model(x[batch]), y[batch]).backward()  # type: ignore[no-untyped-call]  # the mean of the workers' equal-sized means
        optimizer.step()
    return _flat(model)


def _exit_codes(cluster: LocalCluster, timeout: float) -> list[int | None]:
    workers = cluster.processes[1 + cluster.servers:]
    for process in workers:
        process.join(timeout)
    return [p.exitcode for p in workers]


def _committed(directory: Path) -> dict[str, Any]:
    return {path.name: read_commit(path) for path in sorted(directory.glob("worker-*.pt"))}


def _keys(directory: Path) -> dict[str, tuple[int, int] | None]:
    """Every file of a host's elastic directory, with its commit's key (none left half-written)."""
    return {path.name: getattr(read_commit(path), "key", None) for path in sorted(directory.iterdir())}


def _model_params(payload: dict[str, Any]) -> list[float]:
    return torch.cat([t.reshape(-1).double() for t in payload["objects"]["model"].values()]).tolist()


@pytest.mark.timeout(120)
def test_elastic_job_loses_a_worker_and_the_next_generation_restores_the_newest_commit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shared, new_host = tmp_path / "host-a", tmp_path / "host-b"
    shared.mkdir(mode=0o700)
    new_host.mkdir(mode=0o700)
    monkeypatch.setenv(ENV_DIR, str(shared))
    monkeypatch.setenv(ENV_GENERATION, "0")
    with LocalCluster(3, 0, FAST_FAILURE) as cluster:
        cluster.start_workers(_job, [shared] * 3, "crash", 2, 4, 10)
        codes = _exit_codes(cluster, timeout=60)
    assert codes == [REFORM, REFORM, 1]  # the survivors ask for a re-form when their peer is lost
    files = _committed(shared)
    assert sorted(files) == ["worker-0.pt", "worker-1.pt", "worker-2.pt"]
    commits = [c for c in files.values() if c is not None]
    assert [c.key for c in commits] == [(0, 4)] * 3  # nobody could commit batch 5 without worker 2
    newest = commits[0].payload
    assert all(_model_params(c.payload) == _model_params(newest) for c in commits)
    assert newest["attributes"]["batch"] == 4 and newest["objects"]["sampler"]["processed_num"] == 4 * 3 * BATCH

    # generation 1: two workers; worker 1 is on a new host whose directory is empty
    monkeypatch.setenv(ENV_GENERATION, "1")
    with LocalCluster(2, 0) as cluster:
        results = cluster.run(_job, [shared, new_host], "", 0, 0, 7, timeout=90)
    for rank, out in enumerate(results):
        restored = out["restored"]
        assert restored["params"] == _model_params(newest), rank
        assert (restored["batch"], restored["commits"]) == (4, 4)
        assert restored["resets"] == [2] and restored["lr"] == BASE_LR * 2  # the reset callback ran once
        assert restored["hooks"] == ["reset", "callback"]  # the state's reset() first, as in Horovod
        assert len(restored["momentum"]) == 4  # the optimizer state came along, to the new host too
        sampler = ElasticSampler(list(range(SAMPLES)), seed=3, num_replicas=2, rank=rank)
        sampler.load_state_dict(newest["objects"]["sampler"])
        assert restored["indices"] == sampler.get_indices(0, BATCH)  # the rest of the epoch, dealt over 2
        assert (out["final"]["batch"], out["final"]["commits"]) == (7, 7)
    assert results[0]["final"]["params"] == results[1]["final"]["params"]
    # training went on from the commit, momentum included: as one process on both workers' batches
    assert results[0]["final"]["params"] == pytest.approx(_reference(newest, size=2, steps=3), abs=1e-6)
    assert _keys(shared) == {"worker-0.pt": (1, 7)}  # generation 0's older files are gone
    assert _keys(new_host) == {"worker-1.pt": (1, 7)}



@pytest.mark.timeout(90)
def test_elastic_job_starts_from_rank_0_and_leaves_for_more_hosts_at_a_commit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing committed yet: rank 0's state is everyone's. SIGUSR1 (hosts updated): every worker leaves with
    status REFORM at its next commit, having saved it; the next generation goes on from there."""
    monkeypatch.setenv(ENV_DIR, str(tmp_path))
    monkeypatch.setenv(ENV_GENERATION, "0")
    with LocalCluster(2, 0) as cluster:
        cluster.start_workers(_job, [tmp_path] * 2, "signal", 0, 3, 10)
        codes = _exit_codes(cluster, timeout=45)
    assert codes == [REFORM, REFORM]
    commits = [read_commit(tmp_path / f"worker-{rank}.pt") for rank in range(2)]
    assert [c.key for c in commits if c is not None] == [(0, 3), (0, 3)]
    assert _model_params(commits[0].payload) == _model_params(commits[1].payload)  # type: ignore[union-attr]

    monkeypatch.setenv(ENV_GENERATION, "1")
    with LocalCluster(3, 0) as cluster:
        results = cluster.run(_job, [tmp_path] * 3, "", 0, 0, 5, timeout=60)
    newest = commits[0].payload  # type: ignore[union-attr]
    for out in results:
        assert out["restored"]["params"] == _model_params(newest)
        assert out["restored"]["resets"] == [3] and out["final"]["commits"] == 5
    assert results[0]["final"]["params"] == pytest.approx(_reference(newest, size=3, steps=2), abs=1e-6)
    assert _keys(tmp_path) == {f"worker-{rank}.pt": (1, 5) for rank in range(3)}


@pytest.mark.timeout(60)
def test_an_elastic_script_under_a_plain_launch_starts_from_rank_0_and_commits_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_DIR, raising=False)
    monkeypatch.chdir(tmp_path)
    with LocalCluster(2, 0) as cluster:
        results = cluster.run(_job, None, "", 0, 0, 3, timeout=45)
    assert results[0]["restored"]["params"] == results[1]["restored"]["params"]  # seeds differ: rank 0's
    assert all(out["restored"]["resets"] == out["restored"]["hooks"] == [] and out["final"]["commits"] == 3
               for out in results)
    assert results[0]["final"]["params"] == results[1]["final"]["params"]
    assert list(tmp_path.iterdir()) == []
