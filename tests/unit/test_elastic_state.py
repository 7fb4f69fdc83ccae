"""The elastic API's parts that need no running job: commit files, the sampler's partitions, SIGUSR1, `run` outside
an elastic job."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from sluice.worker.config import WorkerConfig
from sluice.worker.torch import elastic, elastic_host
from sluice.worker.torch.elastic import ElasticSampler, HostsUpdatedInterrupt, ObjectState, TorchState
from sluice.worker.torch.elastic_host import (
    ENV_DIR,
    ENV_GENERATION,
    commit_path,
    elastic_env,
    newest_commit,
    read_commit,
    remove_older,
    write_commit,
)
from sluice.worker.torch.state import STATE


def _commit(directory: Path, rank: int, generation: int, counter: int, **extra: Any) -> Path:
    return write_commit(directory, rank, {"generation": generation, "commit": counter, "rank": rank, **extra})


def test_a_commit_replaces_the_file_whole_and_leaves_no_temporary(tmp_path: Path) -> None:
    _commit(tmp_path, 3, 0, 1, weights=torch.ones(4))
    _commit(tmp_path, 3, 0, 2, weights=torch.full((4,), 2.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["worker-3.pt"]
    found = read_commit(commit_path(tmp_path, 3))
    assert found is not None and found.key == (0, 2) and found.payload["weights"].tolist() == [2.0] * 4


def test_a_commit_that_cannot_be_written_says_where_and_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(OSError, match=r"could not commit the elastic state to .*worker-0\.pt.*free space"):
        _commit(tmp_path / "no" / "such" / "directory", 0, 0, 1)  # the last part is made, not its parents


@pytest.mark.parametrize(("files", "newest"), [
    ([], None),
    ([(0, 0, 3), (1, 0, 5), (2, 0, 4)], (0, 5)),  # one generation: the highest counter
    ([(0, 1, 2), (1, 0, 5), (2, 0, 7)], (1, 2)),  # a later generation wins over an older lineage's higher counter
    ([(4, 2, 9), (0, 2, 9), (1, 1, 12)], (2, 9)),  # ranks of several generations left on one host
])
def test_the_newest_commit_on_a_host_has_the_highest_generation_then_counter(
        tmp_path: Path, files: list[tuple[int, int, int]], newest: tuple[int, int] | None) -> None:
    for rank, generation, counter in files:
        _commit(tmp_path, rank, generation, counter)
    (tmp_path / "worker-9.pt").write_bytes(b"not a commit")  # skipped with a warning
    (tmp_path / ".worker-8.123.tmp").write_bytes(b"half written")  # never a candidate
    found = newest_commit(tmp_path)
    assert (found.key if found is not None else None) == newest


def test_no_directory_means_no_commit(tmp_path: Path) -> None:
    assert newest_commit(tmp_path / "missing") is None


def test_the_first_commit_removes_the_hosts_older_files_only(tmp_path: Path) -> None:
    _commit(tmp_path, 0, 0, 4)
    _commit(tmp_path, 2, 0, 4)
    _commit(tmp_path, 1, 1, 5)  # written by another worker of this generation: kept
    keep = _commit(tmp_path, 0, 1, 5)
    assert remove_older(tmp_path, (1, 5), keep) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["worker-0.pt", "worker-1.pt"]


def test_the_launchers_variables(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(ENV_DIR, raising=False)
    assert elastic_env() is None
    monkeypatch.setenv(ENV_DIR, str(tmp_path))
    monkeypatch.setenv(ENV_GENERATION, "3")
    env = elastic_env()
    assert env is not None and env.directory == tmp_path and env.generation == 3
    monkeypatch.setenv(ENV_GENERATION, "x")
    with pytest.raises(ValueError, match="SLUICE_ELASTIC_GENERATION='x' is not a generation"):
        elastic_env()


def _partitions(sampler_state: dict[str, Any] | None, size: int, length: int = 10) -> list[list[int]]:
    out = []
    for rank in range(size):
        sampler = ElasticSampler(list(range(length)), shuffle=False, num_replicas=size, rank=rank)
        if sampler_state is not None:
            sampler.load_state_dict(sampler_state)
        out.append(list(sampler))
    return out


def test_the_sampler_deals_the_remaining_indices_over_the_new_size() -> None:
    assert _partitions(None, 2) == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]
    sampler = ElasticSampler(list(range(10)), shuffle=False, num_replicas=2, rank=0)
    assert sampler.get_indices(0, 2) == [0, 2]
    sampler.record_batch(0, 2)  # the job's first batch: 0, 2 on rank 0 and 1, 3 on rank 1
    assert sampler.state_dict() == {"epoch": 0, "processed_num": 4, "processed_indices": []}
    assert _partitions(sampler.state_dict(), 3) == [[4, 7], [5, 8], [6, 9]]
    assert _partitions(None, 3) == [[0, 3, 6, 9], [1, 4, 7, 0], [2, 5, 8, 1]]  # padded from the start
    sampler.record_indices([5, 8])
    assert _partitions(sampler.state_dict(), 2) == [[4, 7], [6, 9]]
    sampler.set_epoch(1)
    assert sampler.state_dict() == {"epoch": 1, "processed_num": 0, "processed_indices": []}
    assert len(sampler) == 5


def test_the_shuffled_order_is_the_same_on_every_worker_and_new_each_epoch() -> None:
    def order(epoch: int, size: int) -> list[list[int]]:
        ranks = []
        for rank in range(size):
            sampler = ElasticSampler(list(range(12)), seed=7, num_replicas=size, rank=rank)
            sampler.set_epoch(epoch)
            ranks.append(list(sampler))
        return ranks

    first = order(0, 3)
    assert first == order(0, 3)
    assert sorted(i for part in first for i in part) == list(range(12))
    assert first != order(1, 3)
    whole = order(0, 1)[0]  # rank r of 3 takes every third of the one order
    assert first == [whole[r::3] for r in range(3)]


def test_the_sampler_refuses_a_rank_outside_the_job() -> None:
    with pytest.raises(ValueError, match="rank 2 is not below num_replicas 2"):
        ElasticSampler([1, 2, 3], num_replicas=2, rank=2)


@pytest.fixture
def sigusr1() -> Iterator[None]:
    previous = signal.getsignal(signal.SIGUSR1)
    try:
        yield
    finally:
        signal.signal(signal.SIGUSR1, previous)
        elastic_host._hosts_updated.clear()


@pytest.mark.usefixtures("sigusr1")
def test_sigusr1_raises_hosts_updated_at_the_next_check(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(ENV_DIR, str(tmp_path))
    state = ObjectState(epoch=0)  # in an elastic job it takes SIGUSR1 over
    state.check_host_updates()
    os.kill(os.getpid(), signal.SIGUSR1)
    deadline = time.monotonic() + 5.0
    # the handler runs soon after the signal, not necessarily at once
    with pytest.raises(HostsUpdatedInterrupt, match="SIGUSR1 came: the launcher found more slots"):
        while time.monotonic() < deadline:
            state.check_host_updates()
            time.sleep(0.01)
    state.check_host_updates()  # once per signal


def test_run_outside_an_elastic_job_just_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_DIR, raising=False)
    state = ObjectState(batch=0)

    @elastic.run
    def train(state: ObjectState, steps: int) -> str:
        for _ in range(steps):
            state.batch += 1  # type: ignore[attr-defined]
            state.commit()  # nothing written, no Sluice needed
        return "done"

    assert train(state, 3) == "done"
    assert state.batch == 3 and state.commits == 3


def test_state_round_trips_through_a_commit_file(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with torch.no_grad():  # no backward(): autograd's threads would break the tests that fork workers later
        model(torch.randn(5, 3))  # the batch norm's running statistics move
    for param in model.parameters():
        param.grad = torch.linspace(-1.0, 1.0, param.numel()).reshape(param.shape)
    optimizer.step()  # momentum buffers to commit
    sampler = ElasticSampler(list(range(10)), num_replicas=2, rank=1)
    sampler.record_batch(0, 2)
    state = TorchState(model, optimizer, sampler=sampler, epoch=2, history=[0.5, {"lr": 0.1}], name="run")
    write_commit(tmp_path, 0, {"generation": 0, "commit": 1, **state._payload()})

    fresh = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    fresh_optimizer = torch.optim.SGD(fresh.parameters(), lr=0.5, momentum=0.9)
    other = TorchState(fresh, fresh_optimizer, sampler=ElasticSampler(list(range(10)), num_replicas=3, rank=0),
                       epoch=0, history=[], name="")
    found = newest_commit(tmp_path)
    assert found is not None
    other._load(found)
    for mine, theirs in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(mine, theirs)
    assert fresh_optimizer.param_groups[0]["lr"] == 0.1
    buffers = [fresh_optimizer.state[p]["momentum_buffer"] for p in fresh.parameters()]
    assert all(torch.equal(a, optimizer.state[p]["momentum_buffer"])
               for a, p in zip(buffers, model.parameters(), strict=True))
    assert (other.epoch, other.history, other.name) == (2, [0.5, {"lr": 0.1}], "run")
    assert other.sampler.state_dict()["processed_num"] == 4
    assert list(other.sampler) != []


def test_only_plain_attributes_are_committed() -> None:
    with pytest.raises(TypeError, match=r"attribute 'loader' holds a object: only None, bool, int"):
        ObjectState(loader=object())
    state = ObjectState(history=[])
    state.history.append({1, 2})
    with pytest.raises(TypeError, match="attribute 'history' holds a set"):
        state._payload()


def test_the_optimizer_on_the_servers_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(STATE, "settings", WorkerConfig(optimizer_on="server"))
    with pytest.raises(Exception, match=r"optimizer_on = 'worker' \(the default\), or run allreduce only with -s 0"):
        elastic._refuse_server_optimizer()
