"""One job configuration: defaults, then a TOML file, then SLUICE_* variables, then --set overrides."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import json
import math
import os
import re
import textwrap
import tomllib
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from sluice.launch.run_options import ENV_LOG_LEVEL, ENV_LOG_TIME
from sluice.ps.config import ServerConfig
from sluice.scheduler.bootstrap import (
    ENV_AGGREGATORS,
    ENV_CONFIG,
    ENV_ELASTIC_DIR,
    ENV_ELASTIC_GENERATION,
    ENV_INDEX_FAILURES,
    ENV_RANK,
    ENV_ROLE,
    ENV_SCHEDULER,
    ENV_SECRET_FD,
    ENV_SERVERS,
    ENV_STANDBY_RING,
    ENV_WORKERS,
)
from sluice.scheduler.config import SchedulerConfig
from sluice.scheduler.hierarchy.config import AggregationConfig
from sluice.transport.config import TransportConfig
from sluice.transport.prometheus import MetricsConfig
from sluice.transport.timeline import TimelineConfig
from sluice.worker.collective.config import CollectiveConfig
from sluice.worker.config import WorkerConfig
from sluice.worker.job_priority import JobsConfig

#: section name -> the layer's settings class; the order is the order of listings and help
SECTIONS: dict[str, type[Any]] = {
    "transport": TransportConfig,
    "scheduler": SchedulerConfig,
    "ps": ServerConfig,
    "worker": WorkerConfig,
    "collective": CollectiveConfig,
    "aggregation": AggregationConfig,
    "jobs": JobsConfig,
    "timeline": TimelineConfig,
    "metrics": MetricsConfig,
}
ENV_PREFIX = "SLUICE_"
# these tell a child its place in a job; they are not settings
#: the launcher's variables for a process (not settings): its place, and an elastic job's state
BOOTSTRAP_VARS = frozenset({ENV_SCHEDULER, ENV_ROLE, ENV_RANK, ENV_WORKERS, ENV_SERVERS, ENV_AGGREGATORS, ENV_CONFIG,
                            ENV_SECRET_FD, ENV_ELASTIC_DIR, ENV_ELASTIC_GENERATION, ENV_LOG_LEVEL, ENV_LOG_TIME,
                            ENV_STANDBY_RING, ENV_INDEX_FAILURES})
_TRUE = frozenset({"true", "1", "yes"})
_FALSE = frozenset({"false", "0", "no"})


class ConfigError(ValueError):
    """A setting that is unknown, does not parse, or fails its section's validation."""


@dataclass(frozen=True)
class FieldInfo:
    section: str
    name: str
    type: Any
    default: Any
    help: str

    @property
    def key(self) -> str:
        return f"{self.section}.{self.name}"

    @property
    def env(self) -> str:
        return f"{ENV_PREFIX}{self.section.upper()}_{self.name.upper()}"

    @property
    def type_name(self) -> str:
        if typing.get_origin(self.type) is tuple:
            return f"list of {typing.get_args(self.type)[0].__name__}"
        return str(self.type.__name__)


def _comment_descriptions(cls: type[Any]) -> dict[str, str]:
    """The `#:` comment lines written above each field in the class's source."""
    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):
        return {}
    found: dict[str, str] = {}
    pending: list[str] = []
    for line in lines:
        text = line.strip()
        if text.startswith("#:"):
            pending.append(text[2:].strip())
            continue
        match = re.match(r"(\w+)\s*:", text)
        if match and pending:
            found[match.group(1)] = " ".join(pending)
        pending = []
    return found


@functools.cache
def section_fields(section: str) -> tuple[FieldInfo, ...]:
    cls = SECTIONS[section]
    hints = typing.get_type_hints(cls)
    defaults = cls()
    helps = _comment_descriptions(cls)
    return tuple(
        FieldInfo(section, f.name, hints[f.name], getattr(defaults, f.name), helps.get(f.name, ""))
        for f in fields(cls)
    )


def all_fields() -> list[FieldInfo]:
    return [info for section in SECTIONS for info in section_fields(section)]


def render(value: Any) -> str:
    """A value as TOML writes it, so a describe() listing can be pasted into a config file."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, tuple | list):
        return "[" + ", ".join(render(v) for v in value) + "]"
    return repr(value)


@dataclass(frozen=True)
class SluiceConfig:
    transport: TransportConfig = field(default_factory=TransportConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    ps: ServerConfig = field(default_factory=ServerConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    collective: CollectiveConfig = field(default_factory=CollectiveConfig)
    aggregation: AggregationConfig = field(default_factory=AggregationConfig)
    jobs: JobsConfig = field(default_factory=JobsConfig)
    timeline: TimelineConfig = field(default_factory=TimelineConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    #: (key, where its value came from) for every key not left at its default
    sources: tuple[tuple[str, str], ...] = field(default=(), compare=False)

    def value(self, info: FieldInfo) -> Any:
        return getattr(getattr(self, info.section), info.name)

    def to_sections(self) -> dict[str, dict[str, Any]]:
        """JSON-serialisable sections for NodeEnv.config (tuples become lists)."""
        out: dict[str, dict[str, Any]] = {}
        for section in SECTIONS:
            out[section] = {}
            for info in section_fields(section):
                value = self.value(info)
                out[section][info.name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_sections(cls, sections: Mapping[str, Any], source: str = "config sections") -> SluiceConfig:
        """Rebuilds a config from to_sections() output; missing keys keep their defaults."""
        return dataclasses.replace(_build(_items_from_tables(sections, source)), sources=())

    def describe(self, changed_only: bool = False) -> str:
        """One `section.field = value` line per key (`changed_only`: per key set by a file, the environment or
        --set), noting where non-default values came from."""
        origin = dict(self.sources)
        lines = []
        for info in all_fields():
            line = f"{info.key} = {render(self.value(info))}"
            if info.key in origin:
                line += f"  # from {origin[info.key]}"
            elif changed_only:
                continue
            lines.append(line)
        return "\n".join(lines)


# (section, field, raw value, where it came from)
_Item = tuple[str, str, object, str]


def load_config(path: str | None, environ: Mapping[str, str], overrides: Sequence[str]) -> SluiceConfig:
    """Defaults, then the TOML file at `path`, then Horovod's variables of the same meaning (HOROVOD_*, as a
    Horovod job script exports them), then SLUICE_<SECTION>_<FIELD> variables, then --set items."""
    items: list[_Item] = []
    if path is not None:
        items += _items_from_file(path)
    items += _items_from_horovod(environ)
    items += _items_from_environ(environ)
    items += _items_from_overrides(overrides)
    return _build(items)


def _items_from_file(path: str) -> list[_Item]:
    try:
        with open(path, "rb") as f:
            tables = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    return _items_from_tables(tables, f"config file {path}")


def _items_from_tables(tables: Mapping[str, Any], source: str) -> list[_Item]:
    items: list[_Item] = []
    for section, table in tables.items():
        _check_section(section, source)
        if not isinstance(table, Mapping):
            raise ConfigError(f"{section} in {source} must be a table of settings, got {render(table)}")
        items += [(section, name, raw, source) for name, raw in table.items()]
    return items


def _items_from_environ(environ: Mapping[str, str]) -> list[_Item]:
    items: list[_Item] = []
    for var in sorted(environ):
        if not var.startswith(ENV_PREFIX) or var in BOOTSTRAP_VARS:
            continue
        rest = var[len(ENV_PREFIX) :]
        section = next((s for s in SECTIONS if rest.startswith(s.upper() + "_")), None)
        source = f"environment variable {var}"
        if section is None:
            allowed = ", ".join(f"{ENV_PREFIX}{s.upper()}_*" for s in SECTIONS)
            raise ConfigError(f"unknown setting {var} ({source}); settings variables are {allowed}")
        items.append((section, rest[len(section) + 1 :].lower(), environ[var], source))
    return items


#: Horovod's variables that mean one of our settings (their units are ours): variable -> (section, field); the
#: two timeouts are the variables horovodrun's --gloo-timeout-seconds and --stall-check-shutdown-time-seconds set
HOROVOD_VARS = {"HOROVOD_FUSION_THRESHOLD": ("collective", "fusion_bytes"),
                "HOROVOD_CYCLE_TIME": ("collective", "cycle_ms"),
                "HOROVOD_HIERARCHICAL_ALLREDUCE": ("collective", "hierarchical"),
                "HOROVOD_TIMELINE": ("timeline", "path"),
                "HOROVOD_GLOO_TIMEOUT_SECONDS": ("scheduler", "op_timeout"),
                "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": ("collective", "stall_timeout")}


def _items_from_horovod(environ: Mapping[str, str]) -> list[_Item]:
    items: list[_Item] = []
    for var, (section, name) in HOROVOD_VARS.items():
        raw = environ.get(var)
        if raw is None:
            continue
        if name == "hierarchical":  # Horovod's switches: an integer, on when positive
            try:
                raw = "true" if int(raw.strip()) > 0 else "false"
            except ValueError:
                raise ConfigError(f"{var} = {raw!r} does not parse: Horovod's switches are 0 or 1") from None
        if name == "path":  # the launcher merges the timeline: a relative path is the launcher's, as --timeline's
            raw = os.path.abspath(raw)
        if name == "stall_timeout" and _not_positive(raw):  # Horovod: 0 (its default) or less never shuts a
            continue  # stall down (stall_inspector.cc); Sluice's stall check is always on, at its own default
        items.append((section, name, raw, f"environment variable {var} (Horovod's)"))
    return items


def _not_positive(raw: str) -> bool:
    try:
        return float(raw) <= 0
    except ValueError:
        return False  # not a number: the setting's own check names it


def _items_from_overrides(overrides: Sequence[str]) -> list[_Item]:
    items: list[_Item] = []
    for item in overrides:
        key, eq, raw = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not eq or not dot:
            raise ConfigError(f"--set expects section.field=value, got {item!r}")
        source = f"--set {item}"
        _check_section(section, source)
        items.append((section, name, raw, source))
    return items


def _check_section(section: str, source: str) -> None:
    if section not in SECTIONS:
        raise ConfigError(f"unknown section {section!r} ({source}); sections are {', '.join(SECTIONS)}")


def _field(section: str, name: str, source: str) -> FieldInfo:
    infos = {info.name: info for info in section_fields(section)}
    if name in infos:
        return infos[name]
    close = difflib.get_close_matches(name, infos, n=1)
    hint = f"; did you mean {section}.{close[0]}?" if close else ""
    raise ConfigError(
        f"unknown key {section}.{name} ({source}); [{section}] has {', '.join(infos)}{hint}"
    )


def _build(items: Iterable[_Item]) -> SluiceConfig:
    values: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
    origin: dict[str, str] = {}
    for section, name, raw, source in items:
        info = _field(section, name, source)
        try:
            values[section][name] = parse_value(info.type, raw)
        except ValueError as exc:
            raise ConfigError(
                f"{info.key} = {raw!r} ({source}) does not parse: {exc}; expected {info.type_name}"
            ) from None
        origin[info.key] = source
    built: dict[str, Any] = {}
    for section, cls in SECTIONS.items():
        try:
            built[section] = cls(**values[section])
        except ValueError as exc:
            given = "; ".join(f"{k} from {s}" for k, s in origin.items() if k.startswith(section + "."))
            raise ConfigError(f"invalid [{section}] settings: {exc} (given: {given or 'defaults'})") from None
    jobs, channels = built["jobs"], built["transport"].channels
    if jobs.priorities and jobs.levels > channels:  # one channel per level (worker/job_priority.py)
        raise ConfigError(f"invalid [jobs] settings: thresholds_mib gives {jobs.levels} levels, but the transport has "
                          f"{channels} channels: set transport.channels = {jobs.levels} or drop thresholds")
    if jobs.registry and not jobs.registry_secret_file and built["transport"].curve:  # scheduler/registry_service.py
        raise ConfigError("invalid [jobs] settings: jobs.registry needs jobs.registry_secret_file, a file (chmod 600) "
                          "holding the registry secret the cluster's jobs share (`openssl rand -hex 32`), unless "
                          "transport.curve = false on a network you trust")
    return SluiceConfig(**built, sources=tuple(origin.items()))


def parse_value(tp: Any, raw: object) -> Any:
    """`raw` (a string from the environment or --set, or a TOML/JSON value) as a value of type `tp`."""
    if tp is bool:
        if isinstance(raw, bool):
            return raw
        word = raw.strip().lower() if isinstance(raw, str) else None
        if word in _TRUE or word in _FALSE:
            return word in _TRUE
        raise ValueError("not one of true/false/1/0/yes/no")
    if tp is int:
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        if isinstance(raw, str):
            text = raw.strip()
            try:
                return int(text)
            except ValueError:
                return int(text, 0)  # 0x.., 0o.., 0b..: handy for ToS bytes
        raise ValueError("not an integer")
    if tp is float:
        if isinstance(raw, int | float) and not isinstance(raw, bool):
            number = float(raw)
        elif isinstance(raw, str):
            number = float(raw.strip())
        else:
            raise ValueError("not a number")
        if not math.isfinite(number):
            raise ValueError("not a finite number")
        return number
    if tp is str:
        if isinstance(raw, str):
            return raw
        raise ValueError("not a string")
    if typing.get_origin(tp) is tuple:
        element = typing.get_args(tp)[0]
        if isinstance(raw, str):
            parts: list[object] = [p for p in (s.strip() for s in raw.split(",")) if p]
        elif isinstance(raw, list | tuple):
            parts = list(raw)
        else:
            raise ValueError("not a list")
        return tuple(parse_value(element, part) for part in parts)
    raise TypeError(f"unsupported settings type {tp!r}")


def help_epilog(width: int = 100) -> str:
    """Every key with its default and description, for the epilog of `--help`."""
    lines = [
        "configuration keys, with defaults (later sources win):",
        "  a TOML file (--config): [section] tables, e.g. [transport] chunk_bytes = 65536",
        "  environment: SLUICE_<SECTION>_<FIELD>=value, e.g. SLUICE_TRANSPORT_CHUNK_BYTES=65536",
        "  command line: --set section.field=value; booleans take true/false/1/0/yes/no, lists 1,2,3",
        "",
    ]
    for info in all_fields():
        lines.append(f"  {info.key} = {render(info.default)}  ({info.type_name})")
        lines += textwrap.wrap(info.help or "(no description)", width, initial_indent=" " * 6,
                               subsequent_indent=" " * 6)
    return "\n".join(lines)
