"""The Kubernetes manifests: each pod of either form finds its place in the job, and options reach the right pods."""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from sluice.launch import kubernetes, node
from sluice.launch.kubernetes import JobSpec, render_job
from sluice.launch.kubernetes_spec import parse_quantity

DEMO = ("python", "examples/train_digits.py", "--epochs", "3")
#: a `sluice` that prints its arguments, NUL-separated: what a pod's command line hands `sluice node`
STUB = "#!/bin/sh\nprintf '%s\\0' \"$@\"\n"


def parse(text: str) -> list[dict[str, Any]]:
    return list(yaml.safe_load_all(text))


def pod_templates(docs: list[dict[str, Any]]) -> dict[str, tuple[int, dict[str, Any]]]:
    """role (or "all" in the Indexed Job) -> (pods, pod template)."""
    (top,) = [d for d in docs if d["kind"] in ("Job", "JobSet")]
    if top["kind"] == "Job":
        return {"all": (top["spec"]["completions"], top["spec"]["template"])}
    return {r["name"]: (r["template"]["spec"]["completions"], r["template"]["spec"]["template"])
            for r in top["spec"]["replicatedJobs"]}


def _container(template: dict[str, Any]) -> dict[str, Any]:
    (container,) = template["spec"]["containers"]
    result: dict[str, Any] = container
    return result


def node_argv(command: list[str], index: int, stub_dir: Path) -> list[str]:
    """What `sluice node` receives in pod `index` of its Job: the command run by a real shell."""
    env = {"PATH": f"{stub_dir}:{os.environ['PATH']}", "JOB_COMPLETION_INDEX": str(index)}
    if command[:2] == ["sluice", "node"]:
        return command[2:]
    assert command[:2] == ["sh", "-c"]
    out = subprocess.run(command, env=env, capture_output=True, check=True, timeout=10).stdout
    words = out.decode().split("\0")[:-1]
    assert words[0] == "node"
    return words[1:]


def node_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sluice")
    node.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["node", *argv])


@pytest.fixture
def stub_dir(tmp_path: Path) -> Path:
    stub = tmp_path / "sluice"
    stub.write_text(STUB)
    stub.chmod(0o755)
    return tmp_path


@pytest.mark.timeout(30)
@pytest.mark.parametrize("form", ["jobset", "indexed-job"])
@pytest.mark.parametrize(("workers", "servers", "aggregators"), [(2, 2, 1), (1, 0, 0)])
def test_every_pod_finds_its_place(form: str, workers: int, servers: int, aggregators: int, stub_dir: Path,
                                   tmp_path: Path) -> None:
    """Each pod's command, run by a shell as Kubernetes would, up to what `sluice node` would exec."""
    spec = JobSpec("digits", "sluice:latest", workers, servers, DEMO, aggregators=aggregators, form=form)
    secret = tmp_path / "secret"
    secret.write_text("0123456789abcdef" * 4 + "\n")
    secret.chmod(0o400)
    places, scheduler = [], "digits-0.digits" if form == "indexed-job" else "digits-scheduler-0-0.digits"
    master = f"digits-{1 + servers + aggregators}.digits" if form == "indexed-job" else "digits-worker-0-0.digits"
    for role, (count, template) in pod_templates(parse(render_job(spec))).items():
        labels = template["metadata"]["labels"]
        assert labels.get("app.kubernetes.io/component", "all") == role
        for index in range(count):
            args = node_args(node_argv(_container(template)["command"], index, stub_dir))
            assert args.worker_command[1:] == list(DEMO) and args.scheduler == f"{scheduler}:29400"
            assert args.master == f"{master}:29500"
            args.secret_file = str(secret)
            start = node.plan(args, {"JOB_COMPLETION_INDEX": str(index), "SLUICE_TRANSPORT_HOST": "10.1.2.3"})
            places.append((start.role, start.rank))
            assert role in ("all", start.role) or (role, start.role) == ("standby", "scheduler")
            assert start.notes == ()
            assert start.secret == b"0123456789abcdef" * 4
            assert "0123456789abcdef" not in " ".join([*start.argv, *start.env.values()])
            assert '"port": 29400' in start.env["SLUICE_CONFIG_JSON"]
            if start.role == "worker":
                assert start.argv == list(DEMO) and start.env["MASTER_ADDR"] == master
                assert (start.env["RANK"], start.env["WORLD_SIZE"]) == (str(start.rank), str(workers))
    expected = [("scheduler", 0), *(("server", r) for r in range(servers)),
                *(("aggregator", r) for r in range(aggregators)), *(("worker", r) for r in range(workers)),
                *([("scheduler", 1)] if form == "jobset" else [])]  # a standby scheduler, in a JobSet by default
    assert places == expected


@pytest.mark.timeout(30)
def test_each_role_gets_its_own_resources_placement_and_shared_memory() -> None:
    spec = JobSpec("bert", "img", 8, 2, ("python", "train.py"), namespace="team-a", queue="team-a-queue",
                   resources={"all": "cpu=1", "server": "memory=32Gi", "worker": "cpu=8,memory=64Gi,nvidia.com/gpu=1"},
                   node_selectors=("worker:nvidia.com/gpu.product=A100", "all:pool=training"),
                   tolerations=("worker:nvidia.com/gpu:NoSchedule", "all:dedicated=ml:NoExecute"),
                   model_bytes="1Gi")
    (jobset,) = parse(render_job(spec))
    assert jobset["metadata"]["namespace"] == "team-a"
    assert jobset["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a-queue"
    assert jobset["spec"]["failurePolicy"] == {"maxRestarts": 0}
    pods = {role: template["spec"] for role, (_, template) in pod_templates([jobset]).items()}
    resources = {role: pod["containers"][0].get("resources") for role, pod in pods.items()}
    assert resources["scheduler"] == {"requests": {"cpu": "1"}, "limits": {"cpu": "1"}}
    assert resources["server"]["limits"] == {"cpu": "1", "memory": "32Gi"}
    assert resources["worker"]["requests"] == resources["worker"]["limits"] == {
        "cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "1"}
    assert pods["worker"]["nodeSelector"] == {"nvidia.com/gpu.product": "A100", "pool": "training"}
    assert pods["server"]["nodeSelector"] == {"pool": "training"}
    every = {"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoExecute"}
    assert pods["worker"]["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                                             every]
    assert pods["scheduler"]["tolerations"] == [every]
    shm = {role: [v["emptyDir"] for v in pod["volumes"] if v["name"] == "dshm"] for role, pod in pods.items()}
    # workers: 2 x 1Gi + 64Mi; servers: 3 x their half + 64Mi; the scheduler keeps the default
    assert shm == {"scheduler": [], "server": [{"medium": "Memory", "sizeLimit": "1600Mi"}],
                   "worker": [{"medium": "Memory", "sizeLimit": "2112Mi"}], "standby": []}
    # the standby scheduler's pod is placed and sized as the scheduler's
    assert (resources["standby"], pods["standby"]["tolerations"]) == (resources["scheduler"], [every])
    assert {"name": "dshm", "mountPath": "/dev/shm"} in pods["worker"]["containers"][0]["volumeMounts"]
    assert "# Gang admission: Kueue admits the whole JobSet through LocalQueue team-a-queue" in render_job(spec)
    # --metrics-port: every pod serves on the same port (one process a pod), annotated for Prometheus
    (scraped,) = parse(render_job(dataclasses.replace(spec, metrics_port=9400)))
    for role, (_, template) in pod_templates([scraped]).items():
        container = template["spec"]["containers"][0]
        assert template["metadata"]["annotations"] == {"prometheus.io/scrape": "true", "prometheus.io/port": "9400",
                                                       "prometheus.io/path": "/metrics"}, role
        assert {"name": "metrics", "containerPort": 9400} in container["ports"], role
        assert {"name": "SLUICE_METRICS_PORT_PER_PROCESS", "value": "false"} in container["env"], role
        assert {"name": "SLUICE_METRICS_PORT", "value": "9400"} in container["env"], role
    assert "annotations" not in pod_templates([jobset])["worker"][1]["metadata"]
    # --shm-size: every pod but the scheduler alike; neither: bounded by the pod's memory only
    for size, expected in (("3Gi", {"medium": "Memory", "sizeLimit": "3Gi"}), (None, {"medium": "Memory"})):
        plain = dataclasses.replace(spec, model_bytes=None, shm_size=size, resources={})
        pods = {role: template["spec"] for role, (_, template) in pod_templates(parse(render_job(plain))).items()}
        assert [v["emptyDir"] for v in pods["server"]["volumes"] if v["name"] == "dshm"] == [expected]


@pytest.mark.timeout(30)
def test_the_indexed_job_keeps_its_shape() -> None:
    spec = JobSpec("train-a", "reg.example/sluice:1", 3, 2, DEMO, aggregators=2, port=31000, form="indexed-job",
                   resources={"all": "cpu=2,memory=4Gi"}, model_bytes="100Mi", queue="q")
    service, job = parse(render_job(spec))
    assert (service["kind"], service["spec"]["clusterIP"], job["kind"]) == ("Service", "None", "Job")
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
    assert service["spec"]["ports"] == [{"name": "scheduler", "port": 31000}]
    assert "kueue.x-k8s.io/queue-name" not in service["metadata"]["labels"]
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "q"
    assert (job["spec"]["completionMode"], job["spec"]["completions"], job["spec"]["backoffLimit"]) == ("Indexed", 8, 0)
    pod = job["spec"]["template"]["spec"]
    assert pod["subdomain"] == "train-a" and pod["restartPolicy"] == "Never" and pod["shareProcessNamespace"]
    (secret, dshm) = pod["volumes"]
    assert secret["secret"] == {"secretName": "train-a-secret", "defaultMode": 0o400}
    # one template: the most any role needs (an aggregator: 4 x 100Mi + 64Mi)
    assert dshm == {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "464Mi"}}
    container = _container(job["spec"]["template"])
    assert container["ports"] == [{"name": "scheduler", "containerPort": 31000}]
    assert container["env"] == [
        {"name": "SLUICE_TRANSPORT_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    assert "secretKeyRef" not in str(container) and "envFrom" not in container


#: words YAML or a shell could misread: numbers, booleans, nulls, dates, syntax, expansions
HOSTILE = ("3", "yes", "No", "on", "null", "~", "1e3", "0x1f", "1:30", "2024-01-01", "", " lead", "a: b", "#x", "x #y",
           "-", "--", "- x", "*ref", "&a", "!tag", "{}", "[1]", "'q'", '"dq"', "a\\b", "tab\there", "ünï", ".inf",
           "-.5", "@x", "%x", "`x`", "a:", "?", "|", ">", "new\nline", "$HOME", "$(id)", '"$@"', "`id`", "*")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("form", ["jobset", "indexed-job"])
def test_any_command_word_survives_yaml_and_the_shell(form: str, stub_dir: Path) -> None:
    command = ("python", "train.py", *HOSTILE)
    templates = pod_templates(parse(render_job(JobSpec("j", "img", 1, 0, command, form=form))))
    _, template = templates["worker" if form == "jobset" else "all"]
    argv = node_argv(_container(template)["command"], 1, stub_dir)
    assert argv[argv.index("--") + 1:] == list(command)


@pytest.mark.timeout(10)
def test_quantities_are_read_as_kubernetes_reads_them() -> None:
    cases = {"2": 2, "500m": 0.5, "1.5": 1.5, "8Gi": 8 << 30, "150Ki": 153600, "1G": 10**9, "1e3": 1000, "2E": 2e18,
             "100M": 10**8, ".5Ki": 512, "5E-1": 0.5}
    assert {text: float(parse_quantity(text, "x")) for text in cases} == {k: float(v) for k, v in cases.items()}
    for bad in ("", "two", "-1", "1GiB", "1 Gi", "1.2.3", "Gi"):
        with pytest.raises(ValueError, match="is not a Kubernetes quantity"):
            parse_quantity(bad, "--shm-size")


@pytest.mark.parametrize(("changes", "why"), [
    ({"name": "Train"}, "not a DNS-1035 label"),
    ({"name": "1train"}, "not a DNS-1035 label"),
    ({"name": "train_a"}, "not a DNS-1035 label"),
    ({"name": "a.b"}, "not a DNS-1035 label"),
    ({"name": "x" * 49}, "too long: the pod hostname x+-aggregator-0-0 must be at most 63"),
    ({"name": "x" * 62, "form": "indexed-job"}, "too long: the pod hostname x+-6 must be at most 63"),
    ({"namespace": "Team"}, "not a DNS-1123 label"),
    ({"workers": 0}, "needs a worker"),
    ({"aggregators": 1, "servers": 0}, "parameter servers"),
    ({"image": "my image"}, "without spaces"),
    ({"command": ()}, "no worker command"),
    ({"port": 0}, "--port 0 is not a TCP port"),
    ({"master_port": 70000}, "--master-port 70000 is not a TCP port"),
    ({"metrics_port": 4321, "port": 4321}, "--metrics-port 4321 must be a TCP port .* other than the scheduler's"),
    ({"form": "pytorchjob"}, "--form 'pytorchjob' is not one of jobset, indexed-job"),
    ({"resources": {"all": "cpu=two"}}, "--resources cpu 'two' is not a Kubernetes quantity"),
    ({"resources": {"worker": "gpu"}}, "--worker-resources 'gpu': expected NAME=QUANTITY"),
    ({"resources": {"worker": "nvidia.com/gpu=0.5"}}, "nvidia.com/gpu is counted in whole units"),
    ({"resources": {"worker": "Bad Name=1"}}, "resource name 'Bad Name' is not a Kubernetes label key"),
    ({"resources": {"worker": "cpu=1"}, "form": "indexed-job"},
     "--form indexed-job starts every process from one pod template, but the resources of the scheduler"),
    ({"node_selectors": ("worker:pool=a",), "form": "indexed-job"}, "the node selectors of the scheduler"),
    ({"node_selectors": ("gpu=a100",)}, "start with the role it is for"),
    ({"node_selectors": ("worker:pool",)}, "expected ROLE:KEY=VALUE"),
    ({"node_selectors": ("worker:pool=a b",)}, "is not a label value"),
    ({"tolerations": ("worker:gpu:NoRun",)}, "the effect 'NoRun' is not one of NoSchedule, PreferNoSchedule"),
    ({"queue": "a queue"}, "--queue 'a queue' is not a label value"),
    ({"model_bytes": "lots"}, "--model-bytes 'lots' is not a Kubernetes quantity"),
    ({"shm_size": "0"}, "--shm-size 0 must be more than 0"),
    ({"standbys": 5}, "--standbys 5 must be 0..4"),
    ({"standbys": 1, "form": "indexed-job"}, "--standbys 1 needs --form jobset"),
    ({"resources": {"worker": "memory=1Gi"}, "shm_size": "2Gi"},
     r"the worker pods' /dev/shm of 2Gi counts against the memory limit of 1Gi .* raise memory in --worker-res"),
    ({"resources": {"all": "memory=1Gi"}, "model_bytes": "1Gi", "form": "indexed-job"},
     r"every pod's /dev/shm of 4160Mi counts against the memory limit of 1Gi .* raise memory in --resources "),
])
@pytest.mark.timeout(10)
def test_what_kubernetes_would_refuse_is_refused_saying_why(changes: dict[str, Any], why: str) -> None:
    spec = dataclasses.replace(JobSpec("train", "img", 4, 1, DEMO, aggregators=1), **changes)
    with pytest.raises(ValueError, match=why):
        render_job(spec)


@pytest.mark.timeout(10)
def test_the_cli_refuses_with_exit_2_and_every_option_is_explained(capsys: pytest.CaptureFixture[str]) -> None:
    assert kubernetes.main(["-w", "1", "-s", "0", "--image", "img", "--name", "Bad", "--", "true"]) == 2
    assert "sluice kubernetes: error: job name 'Bad' is not a DNS-1035 label" in capsys.readouterr().err
    assert kubernetes.main(["-w", "1", "-s", "0", "--image", "i", "--cpu", "1", "--resources", "cpu=2", "--", "x"]) == 2
    assert "--cpu 1 and --resources cpu=2 both give cpu: give it once" in capsys.readouterr().err
    parser = argparse.ArgumentParser()
    kubernetes.add_manifest_parser(parser.add_subparsers())
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for action in sub.choices["kubernetes"]._actions:
        assert action.help, f"{action.option_strings or action.dest} has no --help text"


@pytest.mark.timeout(10)
def test_the_command_in_the_header_writes_the_same_manifest_again() -> None:
    specs = [JobSpec("sluice", "img", 4, 2, DEMO),
             JobSpec("bert", "r/s:1", 8, 2, ("python", "t.py", "--x", "a b"), aggregators=1, port=4000, namespace="ns",
                     form="indexed-job", queue="q", model_bytes="1Gi", master_port=4001, resources={"all": "cpu=1"},
                     metrics_port=9400,
                     node_selectors=("all:pool=a",), tolerations=("all:spot",)),
             JobSpec("gpu", "img", 2, 1, DEMO, shm_size="2Gi", standbys=2,
                     resources={"worker": "nvidia.com/gpu=1", "server": "cpu=2"},
                     node_selectors=("worker:a=b", "server:c=d"), tolerations=("worker:g=h:NoSchedule",))]
    parser = argparse.ArgumentParser()
    kubernetes.add_manifest_parser(parser.add_subparsers(dest="command"))
    for spec in specs:
        words = shlex.split(kubernetes.command_line(spec))
        assert words[:2] == ["sluice", "kubernetes"]
        assert kubernetes.spec_from_args(parser.parse_args(words[1:])) == spec


@pytest.mark.timeout(30)
@pytest.mark.parametrize("standbys", [2, 0])
def test_a_jobset_with_standbys_starts_a_lost_scheduler_pod_again_and_is_done_when_its_workers_are(
        standbys: int, stub_dir: Path) -> None:
    spec = JobSpec("job", "img", 2, 1, DEMO, standbys=standbys)
    text = render_job(spec)
    (jobset,) = parse(text)
    jobs = {r["name"]: r["template"]["spec"] for r in jobset["spec"]["replicatedJobs"]}
    failures = {"name": "SLUICE_INDEX_FAILURES", "valueFrom": {"fieldRef": {
        "fieldPath": "metadata.annotations['batch.kubernetes.io/job-index-failure-count']"}}}
    if not standbys:  # as before: any pod lost fails its Job, and so the JobSet, which is done when all are
        assert "successPolicy" not in jobset["spec"] and "standby" not in jobs
        assert all(job["backoffLimit"] == 0 and "backoffLimitPerIndex" not in job for job in jobs.values())
        assert failures not in _container(jobs["scheduler"]["template"])["env"]
        assert "# No standby scheduler (--standbys N gives one): losing the scheduler's pod ends the job" in text
        return
    assert jobset["spec"]["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["worker"]}
    assert jobset["spec"]["failurePolicy"] == {"maxRestarts": 0}
    for role in ("scheduler", "standby"):  # started again when lost, and told how often that happened
        assert "backoffLimit" not in jobs[role] and jobs[role]["backoffLimitPerIndex"] == 4, role
        assert failures in _container(jobs[role]["template"])["env"], role
        assert {"name": "scheduler", "containerPort": 29400} in _container(jobs[role]["template"])["ports"]
    assert jobs["standby"]["completions"] == 2
    assert jobs["server"]["backoffLimit"] == jobs["worker"]["backoffLimit"] == 0
    assert "# Standby schedulers: 2 (pods job-standby-0-K): the job outlives its scheduler's pod." in text
    argv = node_argv(_container(jobs["standby"]["template"])["command"], 1, stub_dir)
    assert argv[:argv.index("--")].count("--standby") == 2
    args = node_args(argv)
    assert args.standbys == ["job-standby-0-0.job:29400", "job-standby-0-1.job:29400"]
    args.secret_file = None
    args.sets = ["transport.curve=false"]
    # pod 1 of the standby Job, the job's last index: standby scheduler 2, at its own DNS name's port
    start = node.plan(args, {"JOB_COMPLETION_INDEX": "1", "SLUICE_TRANSPORT_HOST": "10.1.2.3"})
    assert (start.role, start.env["SLUICE_RANK"], start.env["SLUICE_STANDBY_RING"]) == ("scheduler", "2", "1")
