"""The manifests against the published APIs: Kubernetes' own schemas (kubernetes-validate) and JobSet's (the Kubeflow
Trainer API's models of it), both from the packages that ship them; nothing of either is copied here."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import yaml

from sluice.launch.kubernetes import JobSpec, render_job

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="needs kubernetes-validate (Kubernetes' schemas): pip install kubernetes-validate")
jobset_models = pytest.importorskip(
    "kubeflow_trainer_api.models.jobset_v1alpha2_job_set",
    reason="needs kubeflow-trainer-api (which carries JobSet's API): pip install kubeflow-trainer-api")

#: the oldest Kubernetes whose Indexed Jobs label pods with their index (1.28), and the newest the package knows
VERSIONS = ("1.28.0", kubernetes_validate.latest_version())
SPECS = [
    JobSpec("sluice", "sluice:latest", 4, 2, ("python", "train.py")),
    JobSpec("bert", "registry.example.com/sluice:1", 8, 2, ("python", "train.py", "--epochs", "12"), aggregators=2,
            namespace="team-a", queue="team-a", model_bytes="440Mi",
            resources={"all": "cpu=1", "server": "cpu=8,memory=32Gi", "worker": "cpu=8,memory=64Gi,nvidia.com/gpu=1"},
            node_selectors=("worker:nvidia.com/gpu.product=A100", "all:pool=ml"),
            tolerations=("worker:nvidia.com/gpu:NoSchedule", "all:dedicated=ml:NoExecute", "server:spot"),
            metrics_port=9400),
    JobSpec("solo", "img", 1, 0, ("python", "t.py"), shm_size="1Gi", master_port=23456, port=4000, metrics_port=9090),
]


def _validate_core(doc: dict[str, Any]) -> None:
    """Strict: a field the schema does not know fails as much as a wrong type."""
    for version in VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


def _as_job(replicated: dict[str, Any]) -> dict[str, Any]:
    """A JobSet's replicated Job as the batch/v1 Job the JobSet controller makes of it."""
    template = replicated["template"]
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": f"x-{replicated['name']}-0", **template.get("metadata", {})}, "spec": template["spec"]}


def _kept(ours: Any, theirs: Any, where: str = "") -> None:
    """Everything in `ours` is in `theirs` (the model's output), which may add only defaults: nothing was dropped."""
    if isinstance(ours, dict):
        assert isinstance(theirs, dict), where
        for key, value in ours.items():
            assert key in theirs, f"{where}.{key} is not in JobSet's API"
            _kept(value, theirs[key], f"{where}.{key}")
    elif isinstance(ours, list):
        assert isinstance(theirs, list) and len(ours) == len(theirs), where
        for index, (mine, its) in enumerate(zip(ours, theirs, strict=True)):
            _kept(mine, its, f"{where}[{index}]")
    else:
        assert ours == theirs and type(ours) is type(theirs), where


def _validate_jobset(doc: dict[str, Any]) -> None:
    model = jobset_models.JobsetV1alpha2JobSet.from_dict(doc)  # pydantic: strict types, required fields
    _kept(doc, model.to_dict())
    for replicated in doc["spec"]["replicatedJobs"]:
        _validate_core(_as_job(replicated))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_the_jobset_is_valid_for_jobset_and_its_jobs_for_kubernetes(spec: JobSpec) -> None:
    (jobset,) = yaml.safe_load_all(render_job(spec))
    assert (jobset["apiVersion"], jobset["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    _validate_jobset(jobset)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("spec", [s for s in SPECS if not s.resources], ids=lambda s: s.name)
def test_the_service_and_indexed_job_are_valid_for_kubernetes(spec: JobSpec) -> None:
    service, job = yaml.safe_load_all(render_job(dataclasses.replace(spec, form="indexed-job")))
    _validate_core(service)
    _validate_core(job)


@pytest.mark.timeout(60)
def test_the_validators_catch_what_they_are_for() -> None:
    """A misspelled field and a wrong type fail each check, so a pass means something."""
    (jobset,) = yaml.safe_load_all(render_job(SPECS[1]))
    misspelled = copy.deepcopy(jobset)
    misspelled["spec"]["replicatedJobs"][0]["replica"] = 1
    with pytest.raises(AssertionError, match=r"replica is not in JobSet's API"):
        _validate_jobset(misspelled)
    wrong_type = copy.deepcopy(jobset)
    wrong_type["spec"]["replicatedJobs"][0]["replicas"] = "1"
    with pytest.raises(ValueError, match="replicas"):
        _validate_jobset(wrong_type)
    (workers,) = [r for r in jobset["spec"]["replicatedJobs"] if r["name"] == "worker"]
    pod = workers["template"]["spec"]["template"]["spec"]
    pod["tolerations"][0]["efect"] = "NoSchedule"  # caught by both: JobSet's models carry the core kinds too
    with pytest.raises(AssertionError, match=r"tolerations\[0\]\.efect is not in JobSet's API"):
        _validate_jobset(jobset)
    with pytest.raises(kubernetes_validate.ValidationError, match="'efect' was unexpected"):
        _validate_core(_as_job(workers))
    del pod["tolerations"][0]["efect"]
    pod["volumes"][1]["emptyDir"]["medium"] = 5
    with pytest.raises(kubernetes_validate.ValidationError, match="5 is not of type 'string'"):
        _validate_core(_as_job(workers))
