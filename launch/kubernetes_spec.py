"""What `sluice kubernetes` is asked for, checked as Kubernetes would check it, and each role's pods derived from it."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation

DEFAULT_NAME = "sluice"
DEFAULT_PORT = 29400
#: torchrun's default MASTER_PORT, for DDP scripts
DEFAULT_MASTER_PORT = 29500
ROLES = ("scheduler", "server", "aggregator", "worker")
FORMS = ("jobset", "indexed-job")
#: the most standby schedulers a JobSet gets (scheduler.standby's bound)
MAX_STANDBY_PODS = 4
#: how many times Kubernetes starts each scheduler pod (the scheduler's and the standbys') again when it fails or
#: its node is lost (the Job's backoffLimitPerIndex): a pod started again stands by for the one that took over
SCHEDULER_POD_RETRIES = 4
EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
#: what a role's /dev/shm holds per byte of the model's gradients (--model-bytes), read off the code:
#: a worker's fusion buffers are two copies of its gradients (worker/torch/fusion.py); a server holds
#: the value and the sum of each chunk of its shard, the sum in float32 for bfloat16 (ps/store.py); an
#: aggregator an accumulator, its bfloat16 result and a buffer per chunk of every key (ps/relay.py).
#: Send rings are for processes of one host, which pods are not; ps.recover's state file outlives a
#: server only on its host, and a pod is not restarted.
SHM_PER_MODEL_BYTE = {"worker": 2, "server": 3, "aggregator": 4}
#: on top: the calibration buffer, the arenas' small arrays, a DataLoader's tensors in flight
SHM_HEADROOM = 64 << 20

# a Service name is a DNS-1035 label; a namespace a DNS-1123 label
_DNS_1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_DNS_1123 = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_NAME_PART = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_QUANTITY = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][-+]?[0-9]+)?")
_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}


def parse_quantity(text: str, what: str) -> Decimal:
    """A Kubernetes quantity (2, 500m, 8Gi, 1.5G, 1e9) as a number; ValueError naming `what` if it is not one."""
    match = _QUANTITY.fullmatch(text)
    if match is None:
        raise ValueError(f"{what} {text!r} is not a Kubernetes quantity such as 2, 500m, 8Gi or 1e9")
    number, suffix = Decimal(match.group(1)), match.group(2) or ""
    if suffix in _BINARY:
        return number * (1 << (10 * _BINARY[suffix]))
    try:
        return Decimal(number.scaleb(_DECIMAL[suffix] if suffix in _DECIMAL else int(suffix[1:])))
    except InvalidOperation:
        raise ValueError(f"{what} {text!r} is out of range") from None


def check_label_key(key: str, what: str) -> None:
    """A label key (or resource name): an optional DNS-subdomain prefix and '/', then a name of 63 at most."""
    prefix, slash, name = key.rpartition("/")
    if (slash and not (_SUBDOMAIN.fullmatch(prefix) and len(prefix) <= 253)) or not (
            _NAME_PART.fullmatch(name) and len(name) <= 63):
        raise ValueError(f"{what} {key!r} is not a Kubernetes label key, e.g. nvidia.com/gpu.product or pool")


def check_label_value(value: str, what: str) -> None:
    if value and not (_NAME_PART.fullmatch(value) and len(value) <= 63):
        raise ValueError(f"{what} {value!r} is not a label value (63 letters, digits, '-', '_' or '.' at most)")


def parse_resources(text: str, option: str) -> dict[str, str]:
    """`cpu=2,memory=8Gi,nvidia.com/gpu=1` (kubectl set resources' form) as {name: quantity}."""
    found: dict[str, str] = {}
    for item in text.split(","):
        name, equals, quantity = item.strip().partition("=")
        if not equals or not name:
            raise ValueError(f"{option} {text!r}: expected NAME=QUANTITY[,NAME=QUANTITY...], "
                             "e.g. cpu=2,memory=8Gi,nvidia.com/gpu=1")
        check_label_key(name, f"{option}: resource name")
        amount = parse_quantity(quantity, f"{option} {name}")
        # extended resources (a domain and a name: nvidia.com/gpu) come in whole units only
        if "/" in name and amount != amount.to_integral_value():
            raise ValueError(f"{option} {name}={quantity}: {name} is counted in whole units, e.g. {name}=1")
        found[name] = quantity
    return found


def _role_and_rest(text: str, option: str) -> tuple[tuple[str, ...], str]:
    role, colon, rest = text.partition(":")
    if not colon or role not in (*ROLES, "all"):
        raise ValueError(f"{option} {text!r}: start with the role it is for, one of {', '.join(ROLES)} or all, "
                         f"e.g. {option} worker:{rest or text}")
    return (ROLES if role == "all" else (role,)), rest


def parse_node_selector(text: str) -> tuple[tuple[str, ...], str, str]:
    """`ROLE:KEY=VALUE` as (roles, key, value)."""
    roles, rest = _role_and_rest(text, "--node-selector")
    key, equals, value = rest.partition("=")
    if not equals:
        raise ValueError(f"--node-selector {text!r}: expected ROLE:KEY=VALUE, e.g. worker:pool=gpu")
    check_label_key(key, "--node-selector: key")
    check_label_value(value, "--node-selector: value")
    return roles, key, value


def parse_toleration(text: str) -> tuple[tuple[str, ...], dict[str, str]]:
    """`ROLE:KEY[=VALUE][:EFFECT]`, a taint's form (kubectl taint), as (roles, a toleration of it)."""
    roles, rest = _role_and_rest(text, "--toleration")
    taint, colon, effect = rest.partition(":")
    key, equals, value = taint.partition("=")
    check_label_key(key, "--toleration: key")
    if colon and effect not in EFFECTS:
        raise ValueError(f"--toleration {text!r}: the effect {effect!r} is not one of {', '.join(EFFECTS)}")
    if equals:
        check_label_value(value, "--toleration: value")
    toleration = {"key": key, "operator": "Equal", "value": value} if equals else {"key": key, "operator": "Exists"}
    return roles, {**toleration, **({"effect": effect} if colon else {})}


@dataclass(frozen=True)
class JobSpec:
    """The command's arguments, as given (so the command that wrote a manifest can be written back)."""

    name: str
    image: str
    workers: int
    servers: int
    command: tuple[str, ...]
    aggregators: int = 0
    port: int = DEFAULT_PORT
    namespace: str | None = None
    form: str = "jobset"
    queue: str | None = None
    model_bytes: str | None = None
    shm_size: str | None = None
    master_port: int = DEFAULT_MASTER_PORT
    #: "all" or a role -> NAME=QUANTITY,...; a role's own add to (and override) the ones for all
    resources: Mapping[str, str] = field(default_factory=dict)
    node_selectors: tuple[str, ...] = ()
    tolerations: tuple[str, ...] = ()
    #: every pod serves Prometheus metrics on this port (0: none), annotated for scraping
    metrics_port: int = 0
    #: standby scheduler pods (-1: one in a JobSet, none in the Indexed Job form)
    standbys: int = -1


def standby_pods(spec: JobSpec) -> int:
    """How many standby scheduler pods the job gets."""
    return spec.standbys if spec.standbys >= 0 else int(spec.form == "jobset")


@dataclass(frozen=True)
class RolePods:
    """One role's pods: how many, the job index of the first, and what each pod asks for."""

    role: str
    count: int
    first_index: int
    resources: dict[str, str]
    node_selector: dict[str, str]
    tolerations: list[dict[str, str]]
    #: /dev/shm: None for no volume (the scheduler uses none), "" for one bounded by the pod's memory only
    shm_limit: str | None


def _shm_limit(spec: JobSpec, role: str) -> str | None:
    if role == "scheduler":
        return None
    if spec.shm_size is not None:
        return spec.shm_size
    if spec.model_bytes is None:
        return ""
    model = parse_quantity(spec.model_bytes, "--model-bytes")
    per_pod = model / spec.servers if role == "server" else model
    need = SHM_PER_MODEL_BYTE[role] * per_pod + SHM_HEADROOM
    return f"{math.ceil(need / (1 << 20))}Mi"


def check_spec(spec: JobSpec) -> list[RolePods]:
    """Every role's pods, in job-index order; ValueError saying what to change for what Kubernetes would refuse."""
    if spec.workers < 1 or spec.servers < 0 or spec.aggregators < 0 or (spec.aggregators and not spec.servers):
        raise ValueError(f"-w {spec.workers} -s {spec.servers} -a {spec.aggregators}: a job needs a worker or more, "
                         "no negative counts, and parameter servers for its aggregators")
    if not _DNS_1035.fullmatch(spec.name):
        raise ValueError(f"job name {spec.name!r} is not a DNS-1035 label: use lower-case letters, digits and '-', "
                         "starting with a letter and ending with a letter or digit")
    if spec.namespace is not None and not (_DNS_1123.fullmatch(spec.namespace) and len(spec.namespace) <= 63):
        raise ValueError(f"namespace {spec.namespace!r} is not a DNS-1123 label (lower-case letters, digits and '-')")
    if not spec.image or any(c.isspace() for c in spec.image):
        raise ValueError(f"image {spec.image!r} must be a non-empty image reference without spaces")
    if not spec.command:
        raise ValueError("no worker command: put it after --, e.g. -- python train.py")
    for option, port in (("--port", spec.port), ("--master-port", spec.master_port)):
        if not 0 < port < 65536:
            raise ValueError(f"{option} {port} is not a TCP port (1..65535)")
    if spec.metrics_port and (not 0 < spec.metrics_port < 65536 or spec.metrics_port in (spec.port, spec.master_port)):
        raise ValueError(f"--metrics-port {spec.metrics_port} must be a TCP port (1..65535) other than the scheduler's "
                         "and the master port")
    if spec.form not in FORMS:
        raise ValueError(f"--form {spec.form!r} is not one of {', '.join(FORMS)}")
    if spec.queue is not None:
        check_label_value(spec.queue, "--queue")
        if not spec.queue:
            raise ValueError("--queue needs the name of a Kueue LocalQueue")
    for option, size in (("--model-bytes", spec.model_bytes), ("--shm-size", spec.shm_size)):
        if size is not None and parse_quantity(size, option) <= 0:
            raise ValueError(f"{option} {size} must be more than 0")
    if not -1 <= spec.standbys <= MAX_STANDBY_PODS:
        raise ValueError(f"--standbys {spec.standbys} must be 0..{MAX_STANDBY_PODS}")
    if spec.form == "indexed-job" and spec.standbys > 0:
        raise ValueError(f"--standbys {spec.standbys} needs --form jobset: a standby's Job starts a lost scheduler pod "
                         "again, while the Indexed Job's one template would start any lost pod again, and a worker's "
                         "cannot rejoin")
    counts = {"scheduler": 1, "server": spec.servers, "aggregator": spec.aggregators, "worker": spec.workers}
    selectors = [parse_node_selector(text) for text in spec.node_selectors]
    tolerations = [parse_toleration(text) for text in spec.tolerations]
    common = parse_resources(spec.resources["all"], "--resources") if spec.resources.get("all") else {}
    pods, index = [], 0
    for role in ROLES:
        if not counts[role]:
            continue
        own = spec.resources.get(role)
        pods.append(RolePods(
            role, counts[role], index, {**common, **(parse_resources(own, f"--{role}-resources") if own else {})},
            {key: value for roles, key, value in selectors if role in roles},
            [toleration for roles, toleration in tolerations if role in roles], _shm_limit(spec, role)))
        index += counts[role]
    if standby_pods(spec):  # after the workers (launch/node.py role_of), placed and sized as the scheduler is
        pods.append(dataclasses.replace(pods[0], role="standby", count=standby_pods(spec), first_index=index))
    if spec.form == "indexed-job":
        _check_one_template(pods)
        # one template for every role, the scheduler's too: the largest /dev/shm any of them needs
        limits = [p.shm_limit for p in pods if p.shm_limit is not None]
        shm = max(limits, key=lambda s: parse_quantity(s, "/dev/shm")) if all(limits) else ""
        pods = [dataclasses.replace(p, shm_limit=shm) for p in pods]
    for role_pods in pods:
        _check_memory(role_pods)
    _check_hostnames(spec, pods)
    return pods


def _check_memory(pods: RolePods) -> None:
    """An emptyDir in memory counts against the pod's memory limit: one at least as large would be OOM-killed."""
    memory = pods.resources.get("memory")
    if memory is None or not pods.shm_limit:
        return
    if parse_quantity(pods.shm_limit, "/dev/shm") >= parse_quantity(memory, "memory"):
        # only the Indexed Job's one template gives the scheduler a /dev/shm: then it is every pod's
        who, option = ("every pod's", "--resources") if pods.role == "scheduler" else (
            f"the {pods.role} pods'", f"--{pods.role}-resources")
        raise ValueError(f"{who} /dev/shm of {pods.shm_limit} counts against the memory limit of {memory} (an "
                         f"emptyDir in memory is the pod's memory): raise memory in {option} above it, with room "
                         "for the process itself, or lower --model-bytes or --shm-size")


def pod_word(role: str) -> str:
    return f"{role} pod" + ("" if role == "scheduler" else "s")


def _check_one_template(pods: list[RolePods]) -> None:
    """The Indexed Job starts every role from one pod template: what differs between roles cannot be said."""
    first = pods[0]
    for other in pods[1:]:
        for what, mine, theirs in (("resources", first.resources, other.resources),
                                   ("node selectors", first.node_selector, other.node_selector),
                                   ("tolerations", first.tolerations, other.tolerations)):
            if mine != theirs:
                raise ValueError(f"--form indexed-job starts every process from one pod template, but the {what} of "
                                 f"the {first.role} ({mine or 'none'}) and the {other.role}s ({theirs or 'none'}) "
                                 "differ: use --form jobset (the default), or give them to all roles (--resources, "
                                 "all:...)")


def _check_hostnames(spec: JobSpec, pods: list[RolePods]) -> None:
    """Pod hostnames (NAME-INDEX, or NAME-ROLE-0-INDEX in a JobSet) must be DNS labels of 63 characters at most."""
    if spec.form == "indexed-job":
        longest = [f"{spec.name}-{pods[-1].first_index + pods[-1].count - 1}"]
    else:
        longest = [f"{spec.name}-{p.role}-0-{p.count - 1}" for p in pods]
    for hostname in longest:
        if len(hostname) > 63:
            raise ValueError(f"job name {spec.name!r} is too long: the pod hostname {hostname} must be at most 63 "
                             "characters")
