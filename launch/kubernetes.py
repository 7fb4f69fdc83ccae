"""A Kubernetes manifest for a job: a headless Service and an Indexed Job whose pods each run `sluice node`."""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

DEFAULT_NAME = "sluice"
DEFAULT_PORT = 29400
SECRET_DIR = "/etc/sluice"
#: the key in the Secret, so the file in SECRET_DIR
SECRET_KEY = "secret"
#: a Service name is a DNS-1035 label; a namespace a DNS-1123 label
_DNS_1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_DNS_1123 = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_CPU = re.compile(r"[0-9]+(\.[0-9]+)?m?")
# strings written without quotes: nothing YAML could read as a number, boolean, null, date or syntax
_PLAIN = re.compile(r"(?:[A-Za-z_/]|--?[A-Za-z])[A-Za-z0-9_./:=@+-]*(?<!:)")
_RESERVED = frozenset({"y", "n", "yes", "no", "true", "false", "on", "off", "null"})


def _scalar(value: Any) -> str:
    if isinstance(value, dict | list):  # only empty ones are written inline
        return "{}" if isinstance(value, dict) else "[]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    text = str(value)
    if _PLAIN.fullmatch(text) and text.lower() not in _RESERVED:
        return text
    return json.dumps(text)  # a JSON string is a YAML double-quoted scalar


def to_yaml(value: Any, indent: int = 0) -> list[str]:
    """Block-style YAML lines for nested dicts, lists and scalars (enough for a manifest: no dependency)."""
    pad = "  " * indent
    lines: list[str] = []
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(item, dict | list) and item:
                lines.append(f"{pad}{_scalar(key)}:")
                lines += to_yaml(item, indent + 1 if isinstance(item, dict) else indent)
            else:
                lines.append(f"{pad}{_scalar(key)}: {_scalar(item)}")
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, dict) and item:
                inner = to_yaml(item, indent + 1)
                lines += [f"{pad}- {inner[0].lstrip()}", *inner[1:]]
            else:
                lines.append(f"{pad}- {_scalar(item)}")
    else:
        lines.append(pad + _scalar(value))
    return lines


def _printable(text: str) -> str:
    """`text` on one comment line: control characters escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def check_name(name: str, total: int) -> None:
    """Refuse names Kubernetes would: the Service needs a DNS-1035 label, and pod hostnames NAME-INDEX
    (set by the Indexed Job) must stay within 63 characters."""
    if not _DNS_1035.fullmatch(name):
        raise ValueError(f"job name {name!r} is not a DNS-1035 label: use lower-case letters, digits and '-', "
                         "starting with a letter and ending with a letter or digit")
    hostname = f"{name}-{total - 1}"
    if len(hostname) > 63:
        raise ValueError(f"job name {name!r} is too long: the pod hostname {hostname} must be at most 63 characters")


def command_line(name: str, image: str, workers: int, servers: int, command: Sequence[str], port: int,
                 aggregators: int, namespace: str | None, cpu: str | None) -> str:
    """The `sluice kubernetes` command that renders this manifest."""
    words = ["sluice", "kubernetes", "-w", str(workers), "-s", str(servers)]
    words += ["-a", str(aggregators)] if aggregators else []
    words += ["--image", image]
    words += ["--name", name] if name != DEFAULT_NAME else []
    words += ["--port", str(port)] if port != DEFAULT_PORT else []
    words += ["--namespace", namespace] if namespace else []
    words += ["--cpu", cpu] if cpu else []
    return shlex.join([*words, "--", *command])


def render_job(name: str, image: str, workers: int, servers: int, command: Sequence[str], port: int = DEFAULT_PORT,
               aggregators: int = 0, namespace: str | None = None, cpu: str | None = None) -> str:
    """The manifest (YAML) of a job of 1 + servers + aggregators + workers pods, one process each."""
    if workers < 1 or servers < 0 or aggregators < 0 or (aggregators and not servers):
        raise ValueError(f"-w {workers} -s {servers} -a {aggregators}: a job needs a worker or more, no negative "
                         "counts, and parameter servers for its aggregators")
    total = 1 + servers + aggregators + workers
    check_name(name, total)
    if namespace is not None and not (_DNS_1123.fullmatch(namespace) and len(namespace) <= 63):
        raise ValueError(f"namespace {namespace!r} is not a DNS-1123 label (lower-case letters, digits and '-')")
    if not image or any(c.isspace() for c in image):
        raise ValueError(f"image {image!r} must be a non-empty image reference without spaces")
    if not command:
        raise ValueError("no worker command: put it after --, e.g. -- python train.py")
    if not 0 < port < 65536:
        raise ValueError(f"port {port} is not a TCP port (1..65535)")
    if cpu is not None and not _CPU.fullmatch(cpu):
        raise ValueError(f"cpu {cpu!r} is not a CPU quantity such as 2 or 500m")
    labels = {"app.kubernetes.io/name": "sluice", "app.kubernetes.io/instance": name}
    metadata: dict[str, Any] = {"name": name, **({"namespace": namespace} if namespace else {}), "labels": labels}
    sizes = ["-w", str(workers), "-s", str(servers), *(["-a", str(aggregators)] if aggregators else [])]
    container: dict[str, Any] = {
        "name": "sluice",
        "image": image,
        "command": ["sluice", "node", *sizes, "--scheduler", f"{name}-0.{name}:{port}",
                    "--secret-file", f"{SECRET_DIR}/{SECRET_KEY}", "--", *command],
        # the address this pod listens on; the index comes from JOB_COMPLETION_INDEX
        "env": [{"name": "SLUICE_TRANSPORT_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "ports": [{"name": "scheduler", "containerPort": port}],
        "volumeMounts": [{"name": "secret", "mountPath": SECRET_DIR, "readOnly": True}],
    }
    if cpu is not None:
        container["resources"] = {"requests": {"cpu": cpu}, "limits": {"cpu": cpu}}
    service = {
        "apiVersion": "v1", "kind": "Service", "metadata": metadata,
        # headless: no virtual IP, a DNS name per pod (NAME-I.NAME), known before the pods are ready
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": labels,
                 "ports": [{"name": "scheduler", "port": port}]},
    }
    job = {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": metadata,
        "spec": {
            "completionMode": "Indexed", "completions": total, "parallelism": total,
            "backoffLimit": 0,  # a failed pod fails the job: Kubernetes stops the others
            "template": {"metadata": {"labels": labels}, "spec": {
                "subdomain": name, "restartPolicy": "Never",
                # the pause container is PID 1: as PID 1 a worker script would ignore SIGTERM, and leave
                # its orphaned subprocesses unreaped
                "shareProcessNamespace": True, "containers": [container],
                # 0400: read by its owner only (`sluice node` refuses a secret others can read)
                "volumes": [{"name": "secret", "secret": {"secretName": f"{name}-secret", "defaultMode": 0o400}}],
            }},
        },
    }
    roles = f"1 scheduler, {servers} servers{f', {aggregators} aggregators' if aggregators else ''}, {workers} workers"
    written = command_line(name, image, workers, servers, command, port, aggregators, namespace, cpu)
    header = [
        f"# Sluice job {name}: {roles}, one pod each (pod {name}-I runs index I).",
        f"# Written by: {_printable(written)}",
        f"# First make its secret: kubectl create secret generic {name}-secret"
        f"{f' -n {namespace}' if namespace else ''} --from-literal={SECRET_KEY}=$(openssl rand -hex 32)",
    ]
    return "\n".join([*header, *to_yaml(service), "---", *to_yaml(job)]) + "\n"


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-w", "--workers", type=int, required=True, metavar="N", help="worker pods")
    parser.add_argument("-s", "--servers", type=int, required=True, metavar="M", help="parameter-server pods")
    parser.add_argument("-a", "--aggregators", type=int, default=0, metavar="K",
                        help="aggregator pods (default: %(default)s)")
    parser.add_argument("--image", required=True, help="container image with Sluice and the training script")
    parser.add_argument("--name", default=DEFAULT_NAME,
                        help="name of the Service, the Job and the prefix of its pods (default: %(default)s)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="the scheduler's port (default: %(default)s)")
    parser.add_argument("--namespace", help="the namespace (default: kubectl's current one)")
    parser.add_argument("--cpu", help="CPU request and limit of each pod, e.g. 2 or 500m (default: none)")
    parser.add_argument("worker_command", nargs=argparse.REMAINDER, metavar="-- COMMAND [ARGS ...]",
                        help="the worker program, e.g. -- python train.py --epochs 3")


_DESCRIPTION = textwrap.fill(
    "Prints a Kubernetes manifest for a job: a headless Service and an Indexed Job of 1 + M + K + N pods, each "
    "running `sluice node`, which turns the pod's index into its role. Apply it with `kubectl apply -f -` after "
    "creating the job secret (the manifest's first lines say how); see examples/kubernetes/README.md.", 100)


def add_manifest_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """`sluice kubernetes`, among the subcommands of `sluice`."""
    parser = commands.add_parser(
        "kubernetes", formatter_class=argparse.RawDescriptionHelpFormatter, description=_DESCRIPTION,
        usage="sluice kubernetes -w N -s M [-a K] --image IMAGE [--name NAME] [--port PORT] -- COMMAND [ARGS ...]",
        help="print a Kubernetes manifest (headless Service + Indexed Job) that runs a job, one pod a process")
    _add_arguments(parser)
    return parser


def run_manifest(args: argparse.Namespace) -> int:
    command = list(args.worker_command)
    if command[:1] == ["--"]:
        command = command[1:]
    try:
        text = render_job(args.name, args.image, args.workers, args.servers, command, port=args.port,
                          aggregators=args.aggregators, namespace=args.namespace, cpu=args.cpu)
    except ValueError as exc:
        print(f"sluice kubernetes: error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sluice kubernetes", description=_DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    return run_manifest(args)


if __name__ == "__main__":
    sys.exit(main())
