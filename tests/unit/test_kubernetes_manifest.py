"""The Kubernetes manifest: what Kubernetes requires of it, and that its pods find their places in the job."""

from __future__ import annotations

import argparse
import io
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest
import yaml

from sluice.launch import kubernetes, node
from sluice.launch.kubernetes import render_job

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "kubernetes" / "sluice-job.yaml"
DEMO = ["python", "examples/train_digits.py", "--epochs", "3"]


def _parse(text: str) -> tuple[dict[str, Any], dict[str, Any]]:
    service, job = yaml.safe_load_all(text)
    return service, job


def _pod(job: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = job["spec"]["template"]["spec"]
    return spec


def _node_args(command: list[str]) -> argparse.Namespace:
    """The container's command as `sluice node` parses it."""
    assert command[:2] == ["sluice", "node"]
    parser = argparse.ArgumentParser(prog="sluice")
    node.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(command[1:])


@pytest.mark.parametrize(("workers", "servers", "aggregators"), [(4, 2, 0), (1, 0, 0), (3, 2, 2)])
def test_the_manifest_is_what_kubernetes_and_our_wiring_need(workers: int, servers: int, aggregators: int) -> None:
    name, port = "train-a", 31000
    service, job = _parse(render_job(name, "reg.example/sluice:1", workers, servers, DEMO, port=port,
                                     aggregators=aggregators))
    total = 1 + servers + aggregators + workers
    assert (service["apiVersion"], service["kind"]) == ("v1", "Service")
    assert (job["apiVersion"], job["kind"]) == ("batch/v1", "Job")
    assert service["metadata"]["name"] == job["metadata"]["name"] == name
    assert service["spec"]["clusterIP"] == "None"  # headless: a DNS name per pod
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"] and service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"] == [{"name": "scheduler", "port": port}]
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == total
    assert spec["backoffLimit"] == 0
    pod = _pod(job)
    assert pod["subdomain"] == service["metadata"]["name"]  # pod NAME-I is NAME-I.NAME
    assert pod["restartPolicy"] == "Never"
    (container,) = pod["containers"]
    assert container["image"] == "reg.example/sluice:1"
    command = container["command"]
    assert command[command.index("--") + 1:] == DEMO
    args = _node_args(command)
    assert (args.workers, args.servers, args.aggregators) == (workers, servers, aggregators)
    assert args.scheduler == f"{name}-0.{name}:{port}" and args.index is None  # from JOB_COMPLETION_INDEX
    assert container["ports"] == [{"name": "scheduler", "containerPort": port}]
    # the secret: a Secret volume only its owner can read, at the path --secret-file names
    (volume,) = pod["volumes"]
    assert volume["secret"] == {"secretName": f"{name}-secret", "defaultMode": 0o400}
    (mount,) = container["volumeMounts"]
    assert mount == {"name": volume["name"], "mountPath": "/etc/sluice", "readOnly": True}
    assert args.secret_file == "/etc/sluice/" + kubernetes.SECRET_KEY
    # no secret in the command or the environment: only the pod's address, from the downward API
    assert container["env"] == [
        {"name": "SLUICE_TRANSPORT_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    assert "secretKeyRef" not in str(container) and "envFrom" not in container


def test_every_pod_finds_its_place(tmp_path: Path) -> None:
    """What `sluice node` makes of the manifest's command in each pod, up to the exec."""
    _, job = _parse(render_job("digits", "sluice:latest", 2, 2, DEMO, aggregators=1))
    args = _node_args(_pod(job)["containers"][0]["command"])
    secret = tmp_path / "secret"
    secret.write_text("0123456789abcdef" * 4 + "\n")
    secret.chmod(0o400)
    args.secret_file = str(secret)
    places = []
    for index in range(job["spec"]["completions"]):
        start = node.plan(args, {"JOB_COMPLETION_INDEX": str(index), "SLUICE_TRANSPORT_HOST": "10.1.2.3"})
        places.append((start.role, start.rank))
        assert start.notes == ()  # the pod listens on its own address: no warning
        assert start.secret == b"0123456789abcdef" * 4
        assert "0123456789abcdef" not in " ".join([*start.argv, *start.env.values()])
        assert '"port": 29400' in start.env["SLUICE_CONFIG_JSON"]  # the scheduler's, the same in every pod
        assert '"host": "10.1.2.3"' in start.env["SLUICE_CONFIG_JSON"]
        if start.role != "scheduler":
            assert start.env["SLUICE_SCHEDULER"] == "tcp://digits-0.digits:29400"
    assert places == [("scheduler", 0), ("server", 0), ("server", 1), ("aggregator", 0), ("worker", 0),
                      ("worker", 1)]
    assert start.argv == DEMO and (start.env["RANK"], start.env["WORLD_SIZE"], start.env["LOCAL_RANK"]) == \
        ("1", "2", "0")
    # without the pod's address, it would listen where no other pod reaches it: warned
    (warning,) = node.plan(args, {"JOB_COMPLETION_INDEX": "1"}).notes
    assert "transport.host is 127.0.0.1, so processes on other hosts (pods) cannot reach this one" in warning
    args.sets = ["scheduler.port=1234"]
    with pytest.raises(node.NodeError, match=r"scheduler\.port = 1234, but --scheduler digits-0\.digits:29400 names"):
        node.plan(args, {"JOB_COMPLETION_INDEX": "1"})


def test_the_example_is_what_render_job_writes_for_its_documented_command() -> None:
    expected = render_job("sluice", "sluice:latest", 4, 2, DEMO)
    assert EXAMPLE.read_text() == expected, f"regenerate it: {kubernetes.command_line}"
    command = "sluice kubernetes -w 4 -s 2 --image sluice:latest -- python examples/train_digits.py --epochs 3"
    assert f"# Written by: {command}\n" in expected
    assert command in (EXAMPLE.parent / "README.md").read_text()
    out = io.StringIO()
    with redirect_stdout(out):
        assert kubernetes.main(command.split()[2:]) == 0
    assert out.getvalue() == expected


def test_options_reach_the_manifest() -> None:
    service, job = _parse(render_job("j", "img", 2, 1, ["python", "t.py"], namespace="team-a", cpu="500m"))
    assert service["metadata"]["namespace"] == job["metadata"]["namespace"] == "team-a"
    container = _pod(job)["containers"][0]
    assert container["resources"] == {"requests": {"cpu": "500m"}, "limits": {"cpu": "500m"}}
    assert "-n team-a" in render_job("j", "img", 2, 1, ["x"], namespace="team-a").splitlines()[2]


@pytest.mark.parametrize("word", ["3", "yes", "No", "on", "null", "~", "1e3", "0x1f", "1:30", "2024-01-01", "",
                                  " lead", "a: b", "#x", "x #y", "-", "--", "- x", "*ref", "&a", "!tag", "{}",
                                  "[1]", "'q'", '"dq"', "a\\b", "tab\there", "ünï", ".inf", "-.5", "@x", "%x",
                                  "`x`", "a:", "?", "|", ">", "new\nline"])
def test_any_command_word_survives_yaml(word: str) -> None:
    command = ["python", "train.py", word]
    _, job = _parse(render_job("j", "img", 1, 0, command))
    container = _pod(job)["containers"][0]
    assert container["command"][-3:] == command


@pytest.mark.parametrize(("kwargs", "why"), [
    ({"name": "Train"}, "not a DNS-1035 label"),
    ({"name": "1train"}, "not a DNS-1035 label"),
    ({"name": "train_a"}, "not a DNS-1035 label"),
    ({"name": "train-"}, "not a DNS-1035 label"),
    ({"name": "a.b"}, "not a DNS-1035 label"),
    ({"name": "x" * 62}, "too long: the pod hostname x+-5 must be at most 63"),
    ({"namespace": "Team"}, "not a DNS-1123 label"),
    ({"workers": 0}, "needs a worker"),
    ({"aggregators": 1, "servers": 0}, "parameter servers"),
    ({"image": "my image"}, "without spaces"),
    ({"command": []}, "no worker command"),
    ({"port": 0}, "not a TCP port"),
    ({"cpu": "two"}, "not a CPU quantity"),
])
def test_bad_arguments_are_refused_saying_why(kwargs: dict[str, Any], why: str) -> None:
    arguments: dict[str, Any] = {"name": "train", "image": "img", "workers": 4, "servers": 1, "command": DEMO,
                                 **kwargs}
    with pytest.raises(ValueError, match=why):
        render_job(**arguments)


def test_the_cli_refuses_with_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert kubernetes.main(["-w", "1", "-s", "0", "--image", "img", "--name", "Bad", "--", "true"]) == 2
    assert "sluice kubernetes: error: job name 'Bad' is not a DNS-1035 label" in capsys.readouterr().err
