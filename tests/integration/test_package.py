"""The wheel built from the repository holds only `sluice`, installs into an environment that has only torch,
keeps that torch, and runs a two-worker job; the optional pieces it lacks say which extra to install."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

JOB = textwrap.dedent("""
    import torch
    import sluice.torch as hvd

    hvd.init()
    total = hvd.allreduce(torch.full((4,), float(hvd.rank() + 1)), op=hvd.Sum)
    assert total.tolist() == [3.0] * 4, total
    model = torch.nn.Linear(3, 1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    weights = hvd.allgather(model.weight.detach())
    assert torch.equal(weights[0], weights[1]), weights
    print(f"rank {hvd.rank()} ok from {hvd.__file__}")
""")


def _distributions_of(name: str) -> set[str]:
    """`name` and every distribution it requires (without extras), as installed in this interpreter."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        dist = importlib.metadata.distribution(todo.pop())
        key = dist.metadata["Name"].lower()
        if key in seen:
            continue
        seen.add(key)
        for req in dist.requires or []:
            if "extra ==" in req:
                continue
            wanted = req.split(";")[0].split("[")[0]
            for sep in "<>=!~ (":
                wanted = wanted.split(sep)[0]
            try:
                importlib.metadata.distribution(wanted)
            except importlib.metadata.PackageNotFoundError:
                continue  # a requirement for another platform
            todo.append(wanted)
    return seen


def _link_torch(site: Path) -> None:
    """Puts this interpreter's torch, and what it requires, into `site` as links: to pip, an environment that
    has torch installed (its dist-info included), without 20 s of unpacking a second copy."""
    for name in _distributions_of("torch"):
        dist = importlib.metadata.distribution(name)
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            source = Path(str(dist.locate_file(top)))
            target = site / top
            if source.exists() and not target.exists() and top != "bin":
                target.symlink_to(source)


FOLDERS = ("ps", "worker", "transport", "scheduler", "launch")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    wheels = tmp_path_factory.mktemp("wheels")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(wheels), str(REPO)], check=True, cwd=wheels, timeout=120)
    (built,) = wheels.glob("sluice_ps-*.whl")
    return built


@pytest.mark.timeout(120)
def test_the_wheel_holds_only_the_sluice_package(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        info = next(n for n in names if n.endswith(".dist-info/top_level.txt")).rsplit("/", 1)[0]
        top_level = archive.read(f"{info}/top_level.txt").decode().split()
        metadata = archive.read(f"{info}/METADATA").decode()
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"sluice"}
    assert top_level == ["sluice"]
    for folder in FOLDERS:  # the links became real files
        assert f"sluice/{folder}/__init__.py" in names
    assert {"sluice/torch/__init__.py", "sluice/torch/mpi_ops.py", "sluice/worker/collective/engine.py"} <= set(names)
    assert "sluice/py.typed" in names and f"{info}/licenses/LICENSE" in names
    assert "License-Expression: Apache-2.0" in metadata and "Classifier: Operating System :: POSIX :: Linux" in metadata
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    pinned = [r for r in requires if "==" in r.split(";")[0] and not r.endswith('extra == "dev"')]
    assert not pinned, pinned  # ranges, not pins: the dev tools alone are pinned


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_wheel_installs_beside_torch_and_runs_a_job(wheel: Path, tmp_path: Path) -> None:

    env_dir = tmp_path / "env"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    _link_torch(site)
    torch_before = importlib.metadata.version("torch")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{env_dir / 'bin'}{os.pathsep}{env.get('PATH', '')}"

    # the venv's own interpreter with this interpreter's pip module: the fresh env gets no pip of its own
    pip = [sys.executable, "-m", "pip", "--python", str(python)]
    subprocess.run([*pip, "install", "-q", f"sluice-ps[torch] @ {wheel.as_uri()}"], check=True, env=env,
                   cwd=tmp_path, timeout=180)
    listed = subprocess.run([*pip, "list", "--format=freeze"], check=True, env=env, capture_output=True,
                            text=True, cwd=tmp_path).stdout
    assert f"torch=={torch_before}" in listed.splitlines(), listed
    assert (site / "torch").is_symlink(), "pip replaced the environment's torch"
    assert "tensorflow" not in listed and "scipy" not in listed, listed

    version = subprocess.run([str(env_dir / "bin" / "sluice"), "--version"], check=True, env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=60)
    assert version.stdout.split() == ["sluice", importlib.metadata.version("sluice-ps")], version.stdout
    # horovodrun --check-build's habit: what this environment has, and the extra for what it lacks
    built = subprocess.run([str(env_dir / "bin" / "sluice"), "launch", "--check-build"], env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
    assert built.returncode == 0, built.stderr
    assert f"[X] PyTorch (torch {torch_before})" in built.stdout, built.stdout
    assert "[ ] TensorFlow (pip install 'sluice-ps[tensorflow]')" in built.stdout, built.stdout
    assert "[ ] Prometheus metrics (metrics.port) (pip install 'sluice-ps[prometheus]')" in built.stdout

    missing = subprocess.run([str(python), "-c", textwrap.dedent("""
        from sluice.errors import MissingExtraError
        for name, extra in (("sluice.tensorflow", "tensorflow"), ("sluice.keras", "tensorflow"), ("sluice.ray", "ray"),
                            ("sluice.lightning", "lightning")):
            try:
                __import__(name)
            except MissingExtraError as exc:
                assert f"pip install 'sluice-ps[{extra}]'" in str(exc), exc
            else:
                raise AssertionError(name + " imported without TensorFlow")
        from sluice.scheduler.hierarchy.config import AggregationConfig
        from sluice.scheduler.hierarchy.manager import tree_source
        try:
            tree_source(AggregationConfig(mode="plan", racks=("r0: 10.0.0.1",)), 0.0)
        except MissingExtraError as exc:
            assert "sluice-ps[planner]" in str(exc), exc
        else:
            raise AssertionError("the planner started without scipy")
        print("extras named")
    """)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 0 and "extras named" in missing.stdout, missing.stderr

    (tmp_path / "job.py").write_text(JOB)
    job = subprocess.run([str(env_dir / "bin" / "sluice"), "launch", "-np", "2", str(python),
                          "job.py"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert job.returncode == 0, job.stdout + job.stderr
    for rank in (0, 1):
        assert f"rank {rank} ok from {site}" in job.stdout, job.stdout
