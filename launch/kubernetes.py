"""`sluice kubernetes`: print the manifest of a job whose pods each run `sluice node` (a JobSet, or an Indexed Job)."""

from __future__ import annotations

import argparse
import sys
import textwrap

from sluice.launch.kubernetes_render import SECRET_KEY, command_line, render_job
from sluice.launch.kubernetes_spec import (
    DEFAULT_MASTER_PORT,
    DEFAULT_NAME,
    DEFAULT_PORT,
    FORMS,
    ROLES,
    SHM_HEADROOM,
    SHM_PER_MODEL_BYTE,
    JobSpec,
    parse_resources,
)

__all__ = ["SECRET_KEY", "JobSpec", "add_manifest_parser", "command_line", "main", "render_job", "run_manifest",
           "spec_from_args"]

_RESOURCES_HELP = "NAME=QUANTITY,... as kubectl set resources writes them, e.g. cpu=2,memory=8Gi,nvidia.com/gpu=1"


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    job = parser.add_argument_group("the job")
    job.add_argument("-w", "--workers", type=int, required=True, metavar="N", help="worker pods")
    job.add_argument("-s", "--servers", type=int, required=True, metavar="M",
                     help="parameter-server pods (0: pure allreduce)")
    job.add_argument("-a", "--aggregators", type=int, default=0, metavar="K",
                     help="aggregator pods (default: %(default)s)")
    job.add_argument("--image", required=True, help="container image with Sluice and the training script")
    job.add_argument("--name", default=DEFAULT_NAME,
                     help="name of the JobSet (or Service and Job) and the prefix of its pods (default: %(default)s)")
    job.add_argument("--form", choices=FORMS, default="jobset",
                     help="jobset: one replicated Job per role, each with its own resources and placement (needs "
                          "the JobSet controller; Kubeflow Trainer v2 installs it); indexed-job: a headless Service "
                          "and one Indexed Job whose pods all share one template, for clusters without JobSet "
                          "(default: %(default)s)")
    job.add_argument("--port", type=int, default=DEFAULT_PORT, help="the scheduler's port (default: %(default)s)")
    job.add_argument("--master-port", type=int, default=DEFAULT_MASTER_PORT, metavar="PORT",
                     help="MASTER_PORT on worker 0's pod, with MASTER_ADDR its DNS name, for a DDP script's "
                          "torch.distributed rendezvous (default: %(default)s)")
    job.add_argument("--namespace", help="the namespace (default: kubectl's current one)")
    job.add_argument("--queue", metavar="LOCALQUEUE",
                     help="the Kueue LocalQueue to submit through (label kueue.x-k8s.io/queue-name): Kueue admits "
                          "all pods of the job at once or none (gang admission); default: no queue")
    job.add_argument("--metrics-port", type=int, default=0, metavar="PORT",
                     help="every pod serves Prometheus metrics on PORT (metrics.port, one process a pod: the same "
                          "port everywhere; the image needs the prometheus extra) and carries the prometheus.io/"
                          "scrape, port and path annotations (default: no metrics)")
    job.add_argument("--standbys", type=int, default=-1, metavar="N",
                     help="standby scheduler pods, which the others rejoin should the scheduler's pod fail or be "
                          "lost with its node; a scheduler pod started again stands by in turn (default: 1 with "
                          "--form jobset; the Indexed Job form has none)")
    pods = parser.add_argument_group("pods: resources and placement (ROLE: scheduler, server, aggregator, worker; the "
                                     "standby schedulers' pods get the scheduler's)")
    pods.add_argument("--resources", metavar="LIST", help=f"requests and limits of every pod: {_RESOURCES_HELP}")
    for role in ROLES:
        pods.add_argument(f"--{role}-resources", metavar="LIST", dest=f"{role}_resources",
                          help=f"requests and limits of the {role} pod{'' if role == 'scheduler' else 's'}, added to "
                               "--resources (and overriding the names both give)")
    pods.add_argument("--cpu", help="the same as --resources cpu=CPU (kept for older command lines)")
    pods.add_argument("--node-selector", action="append", default=[], metavar="ROLE:KEY=VALUE",
                      help="run ROLE's pods only on nodes with this label, e.g. worker:nvidia.com/gpu.product=A100 "
                           "(ROLE all: every pod; repeatable)")
    pods.add_argument("--toleration", action="append", default=[], metavar="ROLE:KEY[=VALUE][:EFFECT]",
                      help="let ROLE's pods run on nodes with this taint (kubectl taint's form), e.g. "
                           "worker:nvidia.com/gpu:NoSchedule; without =VALUE any value, without :EFFECT any "
                           "effect (ROLE all: every pod; repeatable)")
    shm = parser.add_argument_group("shared memory: /dev/shm is an emptyDir in memory, part of each pod's memory")
    factors = ", ".join(f"{role}s {k}x {'their share of it' if role == 'server' else 'it'}"
                        for role, k in SHM_PER_MODEL_BYTE.items())
    shm.add_argument("--model-bytes", metavar="QUANTITY",
                     help=f"the bytes of the model's gradients (e.g. 440M for 110M float32 parameters): sizes each "
                          f"role's /dev/shm ({factors}, each + {SHM_HEADROOM >> 20}Mi)")
    shm.add_argument("--shm-size", metavar="QUANTITY",
                     help="the size of /dev/shm of every pod but the scheduler's, e.g. 2Gi (default: from "
                          "--model-bytes; without either, bounded by the pod's memory limit only)")
    parser.add_argument("worker_command", nargs=argparse.REMAINDER, metavar="-- COMMAND [ARGS ...]",
                        help="the worker program, e.g. -- python train.py --epochs 3")


_DESCRIPTION = textwrap.fill(
    "Prints a Kubernetes manifest for a job of 1 scheduler, M servers, K aggregators and N workers, one pod each, "
    "every pod running `sluice node`, which turns the pod's index into its role: by default a JobSet with one "
    "replicated Job per role, so that GPUs, memory, node selectors and tolerations go to the pods that need them; "
    "with --form indexed-job a headless Service and one Indexed Job. /dev/shm is mounted from memory in every "
    "pod that uses it. Apply it with `kubectl apply -f -` after creating the job secret (the manifest's first "
    "lines say how); see examples/kubernetes/README.md.", 100)
_USAGE = ("sluice kubernetes -w N -s M [-a K] --image IMAGE [--name NAME] [--form jobset|indexed-job] "
          "[--ROLE-resources LIST] [--node-selector ROLE:KEY=VALUE] [--toleration ROLE:KEY[=VALUE][:EFFECT]] "
          "[--queue LOCALQUEUE] [--model-bytes QUANTITY | --shm-size QUANTITY] -- COMMAND [ARGS ...]")


def add_manifest_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """`sluice kubernetes`, among the subcommands of `sluice`."""
    parser = commands.add_parser(
        "kubernetes", formatter_class=argparse.RawDescriptionHelpFormatter, description=_DESCRIPTION, usage=_USAGE,
        help="print a Kubernetes manifest (a JobSet, or an Indexed Job) that runs a job, one pod a process")
    _add_arguments(parser)
    return parser


def spec_from_args(args: argparse.Namespace) -> JobSpec:
    """The job the parsed command line asks for; ValueError for what no manifest could say."""
    command = list(args.worker_command)
    if command[:1] == ["--"]:
        command = command[1:]
    resources = {role: text for role in ROLES if (text := getattr(args, f"{role}_resources"))}
    common = args.resources
    if args.cpu is not None:
        if common and "cpu" in parse_resources(common, "--resources"):
            raise ValueError(f"--cpu {args.cpu} and --resources {common} both give cpu: give it once")
        common = f"cpu={args.cpu}" + (f",{common}" if common else "")
    return JobSpec(
        args.name, args.image, args.workers, args.servers, tuple(command), aggregators=args.aggregators,
        port=args.port, namespace=args.namespace, form=args.form, queue=args.queue, model_bytes=args.model_bytes,
        shm_size=args.shm_size, master_port=args.master_port, resources={"all": common, **resources} if common
        else resources, node_selectors=tuple(args.node_selector), tolerations=tuple(args.toleration),
        metrics_port=args.metrics_port, standbys=args.standbys)


def run_manifest(args: argparse.Namespace) -> int:
    try:
        text = render_job(spec_from_args(args))
    except ValueError as exc:
        print(f"sluice kubernetes: error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sluice kubernetes", description=_DESCRIPTION, usage=_USAGE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    return run_manifest(args)


if __name__ == "__main__":
    sys.exit(main())
