"""The manifests `sluice kubernetes` prints: a JobSet of a replicated Job per role, or a Service and an Indexed Job."""

from __future__ import annotations

import dataclasses
import shlex
from typing import Any

from sluice.launch.kubernetes_spec import (
    DEFAULT_MASTER_PORT,
    DEFAULT_NAME,
    DEFAULT_PORT,
    SCHEDULER_POD_RETRIES,
    JobSpec,
    RolePods,
    check_spec,
    pod_word,
    standby_pods,
)
from sluice.launch.kubernetes_yaml import documents
from sluice.scheduler.bootstrap import ENV_INDEX_FAILURES

SECRET_DIR = "/etc/sluice"
#: the key in the Secret, so the file in SECRET_DIR
SECRET_KEY = "secret"
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
#: the Job controller keeps in each pod how many of its index failed before (with backoffLimitPerIndex)
FAILURE_COUNT_ANNOTATION = "batch.kubernetes.io/job-index-failure-count"
#: Kueue admits a workload carrying this label through the named LocalQueue
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
#: what JobSet pods run to become process FIRST + JOB_COMPLETION_INDEX of the job: their Job counts its
#: pods from 0, the job from the scheduler; "$@" passes the arguments on untouched
_OFFSET_SCRIPT = 'exec sluice node --index "$(({first} + JOB_COMPLETION_INDEX))" "$@"'


def scheduler_host(spec: JobSpec) -> str:
    """The scheduler pod's DNS name, through the headless Service (the JobSet's own, in that form)."""
    pod = f"{spec.name}-0" if spec.form == "indexed-job" else f"{spec.name}-scheduler-0-0"
    return f"{pod}.{spec.name}"


def standby_host(spec: JobSpec, k: int) -> str:
    """Standby scheduler k's DNS name (k = 0, 1, ...: the JobSet's standby Job's pods)."""
    return f"{spec.name}-standby-0-{k}.{spec.name}"


def master_host(spec: JobSpec, pods: list[RolePods]) -> str:
    """Worker 0's DNS name: torch.distributed's MASTER_ADDR."""
    first = next(p for p in pods if p.role == "worker").first_index
    pod = f"{spec.name}-{first}" if spec.form == "indexed-job" else f"{spec.name}-worker-0-0"
    return f"{pod}.{spec.name}"


def _labels(spec: JobSpec, role: str | None = None) -> dict[str, str]:
    labels = {"app.kubernetes.io/name": "sluice", "app.kubernetes.io/instance": spec.name}
    return {**labels, "app.kubernetes.io/component": role} if role else labels


def _metadata(spec: JobSpec, queued: bool) -> dict[str, Any]:
    labels = {**_labels(spec), **({QUEUE_LABEL: spec.queue} if queued and spec.queue else {})}
    return {"name": spec.name, **({"namespace": spec.namespace} if spec.namespace else {}), "labels": labels}


def _node_command(spec: JobSpec, pods: list[RolePods], index: int | None) -> list[str]:
    """`sluice node`'s arguments, the same for every pod but the index (None: JOB_COMPLETION_INDEX's)."""
    sizes = ["-w", str(spec.workers), "-s", str(spec.servers), *(["-a", str(spec.aggregators)] if spec.aggregators
                                                                  else [])]
    standbys = [word for k in range(standby_pods(spec))
                for word in ("--standby", f"{standby_host(spec, k)}:{spec.port}")]
    return [*sizes, *(["--index", str(index)] if index is not None else []),
            "--scheduler", f"{scheduler_host(spec)}:{spec.port}", *standbys,
            "--secret-file", f"{SECRET_DIR}/{SECRET_KEY}",
            "--master", f"{master_host(spec, pods)}:{spec.master_port}", "--", *spec.command]


def _pod_template(spec: JobSpec, one: RolePods, command: list[str]) -> dict[str, Any]:
    """The pods of `one` role, or of all roles (role "all": the Indexed Job's one template)."""
    container: dict[str, Any] = {
        "name": "sluice",
        "image": spec.image,
        "command": command,
        # the address this pod listens on
        "env": [{"name": "SLUICE_TRANSPORT_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
    }
    if one.role in ("scheduler", "standby") and standby_pods(spec):
        # started again after a failure (the Job's backoffLimitPerIndex), a scheduler pod stands by (launch/node.py)
        container["env"].append({"name": ENV_INDEX_FAILURES, "valueFrom": {"fieldRef": {
            "fieldPath": f"metadata.annotations['{FAILURE_COUNT_ANNOTATION}']"}}})
    ports = ([{"name": "scheduler", "containerPort": spec.port}] if one.role in ("scheduler", "standby", "all")
             else [])
    annotations: dict[str, str] = {}
    if spec.metrics_port:  # one process a pod: every pod on the same port, so one scrape rule finds them all
        container["env"] += [{"name": "SLUICE_METRICS_PORT", "value": str(spec.metrics_port)},
                             {"name": "SLUICE_METRICS_PORT_PER_PROCESS", "value": "false"}]
        ports.append({"name": "metrics", "containerPort": spec.metrics_port})
        annotations = {"prometheus.io/scrape": "true", "prometheus.io/port": str(spec.metrics_port),
                       "prometheus.io/path": "/metrics"}
    if ports:
        container["ports"] = ports
    mounts: list[dict[str, Any]] = [{"name": "secret", "mountPath": SECRET_DIR, "readOnly": True}]
    # 0400: read by its owner only (`sluice node` refuses a secret others can read)
    volumes: list[dict[str, Any]] = [
        {"name": "secret", "secret": {"secretName": f"{spec.name}-secret", "defaultMode": 0o400}}]
    if one.shm_limit is not None:  # fusion buffers and a server's sums live in /dev/shm: a container gets 64 MiB
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory",
                                                      **({"sizeLimit": one.shm_limit} if one.shm_limit else {})}})
    container["volumeMounts"] = mounts
    if one.resources:  # requests = limits: extended resources (GPUs) allow nothing else
        container["resources"] = {"requests": dict(one.resources), "limits": dict(one.resources)}
    spec_: dict[str, Any] = {"subdomain": spec.name} if spec.form == "indexed-job" else {}
    spec_.update({
        "restartPolicy": "Never",
        # the pause container is PID 1: as PID 1 a worker script would ignore SIGTERM, and leave its
        # orphaned subprocesses unreaped
        "shareProcessNamespace": True,
        "containers": [container],
        "volumes": volumes,
    })
    if one.node_selector:
        spec_["nodeSelector"] = dict(one.node_selector)
    if one.tolerations:
        spec_["tolerations"] = [dict(t) for t in one.tolerations]
    metadata: dict[str, Any] = {"labels": _labels(spec, None if one.role == "all" else one.role)}
    if annotations:
        metadata["annotations"] = annotations
    return {"metadata": metadata, "spec": spec_}


def _indexed_job(spec: JobSpec, pods: list[RolePods]) -> list[dict[str, Any]]:
    total = sum(p.count for p in pods)
    one = dataclasses.replace(pods[0], role="all", count=total)  # check_spec made the roles' pods alike
    template = _pod_template(spec, one, ["sluice", "node", *_node_command(spec, pods, None)])
    service = {
        "apiVersion": "v1", "kind": "Service", "metadata": _metadata(spec, False),
        # headless: no virtual IP, a DNS name per pod (NAME-I.NAME), known before the pods are ready
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": _labels(spec),
                 "ports": [{"name": "scheduler", "port": spec.port}]},
    }
    job = {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": _metadata(spec, True),
        "spec": {
            "completionMode": "Indexed", "completions": total, "parallelism": total,
            "backoffLimit": 0,  # a failed pod fails the job: Kubernetes stops the others
            "template": template,
        },
    }
    return [service, job]


def _jobset(spec: JobSpec, pods: list[RolePods]) -> dict[str, Any]:
    replicated = []
    standby = bool(standby_pods(spec))
    for one in pods:
        if one.role == "scheduler":
            command = ["sluice", "node", *_node_command(spec, pods, 0)]
        else:
            command = ["sh", "-c", _OFFSET_SCRIPT.format(first=one.first_index), "sluice-node",
                       *_node_command(spec, pods, None)]
        # a scheduler pod lost is started again, up to SCHEDULER_POD_RETRIES times, and stands by; any other pod
        # lost fails its Job, and so the JobSet
        retries = ({"backoffLimitPerIndex": SCHEDULER_POD_RETRIES} if standby and one.role in ("scheduler", "standby")
                   else {"backoffLimit": 0})
        replicated.append({"name": one.role, "replicas": 1, "template": {
            "metadata": {"labels": _labels(spec, one.role)},
            "spec": {"completionMode": "Indexed", "completions": one.count, "parallelism": one.count,
                     **retries, "template": _pod_template(spec, one, command)}}})
    return {
        "apiVersion": JOBSET_API, "kind": "JobSet", "metadata": _metadata(spec, True),
        "spec": {
            # the JobSet's headless Service: pod NAME-ROLE-0-I is NAME-ROLE-0-I.NAME, before it is ready
            "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
            "failurePolicy": {"maxRestarts": 0},  # a failed Job fails the JobSet: a restart cannot rejoin
            # done when the workers are: a standby that never took over waits for as long as it runs, and the
            # JobSet's end deletes it
            **({"successPolicy": {"operator": "All", "targetReplicatedJobs": ["worker"]}} if standby else {}),
            "replicatedJobs": replicated,
        },
    }


def _header(spec: JobSpec, pods: list[RolePods], written: str) -> list[str]:
    roles = ", ".join(f"{p.count} {p.role}{'s' if p.count > 1 else ''}" for p in pods)
    if spec.form == "indexed-job":
        shape = [f"Sluice job {spec.name}: {roles}, an Indexed Job of one pod each (pod {spec.name}-I runs index I)."]
    else:
        shape = [f"Sluice job {spec.name}: {roles}, a JobSet of one replicated Job per role (pods "
                 f"{spec.name}-ROLE-0-I); it needs the JobSet controller (https://jobset.sigs.k8s.io)."]
    standbys = standby_pods(spec)
    if standbys:
        shape.append(f"Standby schedulers: {standbys} (pods {spec.name}-standby-0-K): the job outlives its scheduler's "
                     f"pod. A scheduler pod that fails or is lost with its node is started again (up to "
                     f"{SCHEDULER_POD_RETRIES} times: the Job's backoffLimitPerIndex, Kubernetes 1.29 or later) and "
                     "stands by; the JobSet is done when its workers are")
    else:
        shape.append(f"No standby scheduler ({'--standbys N' if spec.form == 'jobset' else '--form jobset'} gives "
                     "one): losing the scheduler's pod ends the job")
    lines = [*shape, f"Written by: {written}",
             f"First make its secret: kubectl create secret generic {spec.name}-secret"
             f"{f' -n {spec.namespace}' if spec.namespace else ''} --from-literal={SECRET_KEY}=$(openssl rand -hex 32)"]
    if spec.form == "indexed-job":  # one template: the most any role needs
        sizes = [f"every pod {pods[0].shm_limit or 'up to its memory limit'}"]
    else:
        sizes = [f"{pod_word(p.role)} {p.shm_limit or 'up to their memory limit'}" for p in pods
                 if p.shm_limit is not None]
    lines.append(f"/dev/shm (in memory, counted in the pod's memory): {', '.join(sizes)}"
                 + ("" if spec.model_bytes or spec.shm_size else "; size it with --model-bytes or --shm-size"))
    if spec.queue:
        lines.append(f"Gang admission: Kueue admits the whole {'JobSet' if spec.form == 'jobset' else 'Job'} "
                     f"through LocalQueue {spec.queue} once all its pods fit, so none waits for the others")
    else:
        lines.append("No gang admission: every pod must run within scheduler.rendezvous_timeout (120 s) of the "
                     "scheduler; with Kueue, --queue LOCALQUEUE admits all pods at once")
    return lines


def render_job(spec: JobSpec, written: str | None = None) -> str:
    """The manifest (YAML) of the job; `written`: the command to name in its header (default: the spec's)."""
    pods = check_spec(spec)
    objects = _indexed_job(spec, pods) if spec.form == "indexed-job" else [_jobset(spec, pods)]
    return documents(_header(spec, pods, written or command_line(spec)), objects)


def command_line(spec: JobSpec) -> str:
    """The `sluice kubernetes` command that renders this manifest (defaults left out)."""
    words = ["sluice", "kubernetes", "-w", str(spec.workers), "-s", str(spec.servers)]
    words += ["-a", str(spec.aggregators)] if spec.aggregators else []
    words += ["--image", spec.image]
    words += ["--name", spec.name] if spec.name != DEFAULT_NAME else []
    words += ["--form", spec.form] if spec.form != "jobset" else []
    words += ["--port", str(spec.port)] if spec.port != DEFAULT_PORT else []
    words += ["--master-port", str(spec.master_port)] if spec.master_port != DEFAULT_MASTER_PORT else []
    words += ["--namespace", spec.namespace] if spec.namespace else []
    words += ["--queue", spec.queue] if spec.queue else []
    words += ["--metrics-port", str(spec.metrics_port)] if spec.metrics_port else []
    words += ["--standbys", str(spec.standbys)] if spec.standbys != -1 else []
    for role in ("all", "scheduler", "server", "aggregator", "worker"):
        if spec.resources.get(role):
            words += ["--resources" if role == "all" else f"--{role}-resources", spec.resources[role]]
    for text in spec.node_selectors:
        words += ["--node-selector", text]
    for text in spec.tolerations:
        words += ["--toleration", text]
    words += ["--model-bytes", spec.model_bytes] if spec.model_bytes else []
    words += ["--shm-size", spec.shm_size] if spec.shm_size else []
    return shlex.join([*words, "--", *spec.command])
