"""Config loading: defaults, file < environment < --set, parsing by field type, errors, help text."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from sluice.launch.cli import main
from sluice.launch.config import SECTIONS, ConfigError, SluiceConfig, all_fields, load_config, parse_value
from sluice.ps.config import ServerConfig
from sluice.scheduler.config import SchedulerConfig
from sluice.transport.config import TransportConfig
from sluice.worker.config import WorkerConfig

pytestmark = pytest.mark.timeout(30)


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "sluice.toml"
    path.write_text(text)
    return str(path)


def test_defaults() -> None:
    config = load_config(None, {}, [])
    assert config == SluiceConfig()
    assert config.transport == TransportConfig()
    assert config.scheduler == SchedulerConfig()
    assert config.ps == ServerConfig()
    assert config.worker == WorkerConfig()
    assert config.sources == ()


def test_toml_file(tmp_path: Path) -> None:
    path = _write(tmp_path, """
[transport]
chunk_bytes = 65536
tos = [0xb8, 0x28, 0]
protocol = "ipc"
[scheduler]
op_timeout = 5
[ps]
sync = false
[worker]
optimizer_on = "server"
""")
    config = load_config(path, {}, [])
    assert config.transport.chunk_bytes == 65536
    assert config.transport.tos == (0xB8, 0x28, 0)
    assert config.transport.protocol == "ipc"
    assert config.scheduler.op_timeout == 5.0 and isinstance(config.scheduler.op_timeout, float)
    assert config.ps.sync is False
    assert config.worker.optimizer_on == "server"
    assert dict(config.sources)["transport.chunk_bytes"] == f"config file {path}"


def test_precedence_file_env_set(tmp_path: Path) -> None:
    path = _write(tmp_path, "[transport]\nchunk_bytes = 65536\nchannels = 2\n")
    env = {"SLUICE_TRANSPORT_CHUNK_BYTES": "131072", "SLUICE_TRANSPORT_CHANNELS": "4"}
    config = load_config(path, env, ["transport.channels=5"])
    assert config.transport.chunk_bytes == 131072  # env beats file
    assert config.transport.channels == 5  # --set beats env
    sources = dict(config.sources)
    assert sources["transport.chunk_bytes"] == "environment variable SLUICE_TRANSPORT_CHUNK_BYTES"
    assert sources["transport.channels"] == "--set transport.channels=5"
    assert "transport.channels = 5  # from --set transport.channels=5" in config.describe()


def test_bootstrap_and_foreign_variables_are_ignored() -> None:
    env = {
        "SLUICE_SCHEDULER": "tcp://127.0.0.1:1", "SLUICE_ROLE": "worker", "SLUICE_RANK": "0",
        "SLUICE_NUM_WORKERS": "2", "SLUICE_NUM_SERVERS": "1", "SLUICE_CONFIG_JSON": "{}", "PATH": "/bin",
    }
    assert load_config(None, env, []) == SluiceConfig()


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("true", True), ("FALSE", False), ("1", True), ("0", False), ("yes", True), (" no ", False), (True, True)],
)
def test_bool_parsing(raw: object, expected: bool) -> None:
    assert parse_value(bool, raw) is expected


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("1,2,3", (1, 2, 3)), (" 0xb8 , 40,0 ", (184, 40, 0)), ("", ()), ([4, 5], (4, 5)), ("7", (7,))],
)
def test_tuple_parsing(raw: object, expected: tuple[int, ...]) -> None:
    assert parse_value(tuple[int, ...], raw) == expected


def test_env_and_set_parse_by_type() -> None:
    config = load_config(None, {"SLUICE_PS_SYNC": "no", "SLUICE_TRANSPORT_TOS": "1,2,3"},
                         ["scheduler.heartbeat_timeout=9.5", "transport.chunk_bytes=0x10000"])
    assert config.ps.sync is False
    assert config.transport.tos == (1, 2, 3)
    assert config.scheduler.heartbeat_timeout == 9.5
    assert config.transport.chunk_bytes == 65536


@pytest.mark.parametrize(
    ("environ", "sets", "want"),
    [
        ({"HOROVOD_FUSION_THRESHOLD": "8388608", "HOROVOD_CYCLE_TIME": "2.5"}, [], (8388608, 2.5, True, None)),
        ({"HOROVOD_HIERARCHICAL_ALLREDUCE": "0", "HOROVOD_TIMELINE": "/tmp/t.json"}, [], (16 << 20, 1.0, False,
                                                                                        "/tmp/t.json")),
        ({"HOROVOD_HIERARCHICAL_ALLREDUCE": "1"}, [], (16 << 20, 1.0, True, None)),
        # ours win: SLUICE_* variables and --set are Sluice's own words
        ({"HOROVOD_FUSION_THRESHOLD": "8388608", "SLUICE_COLLECTIVE_FUSION_BYTES": "1024"},
         ["collective.hierarchical=false"], (1024, 1.0, False, None)),
        ({"HOROVOD_HIERARCHICAL_ALLREDUCE": "1"}, ["collective.hierarchical=false"], (16 << 20, 1.0, False, None)),
    ],
)
def test_horovods_variables_mean_our_settings(environ: dict[str, str], sets: list[str],
                                              want: tuple[int, float, bool, str | None]) -> None:
    config = load_config(None, environ, sets)
    got = (config.collective.fusion_bytes, config.collective.cycle_ms, config.collective.hierarchical,
           config.timeline.path or None)
    assert got == want


@pytest.mark.parametrize(("environ", "want"), [
    ({"HOROVOD_GLOO_TIMEOUT_SECONDS": "300"}, (300.0, 60.0)),
    ({"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "90"}, (120.0, 90.0)),
    # Horovod's 0: a stall never shuts the job down there; here the stall check keeps its default
    ({"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "0"}, (120.0, 60.0)),
    ({"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "-1"}, (120.0, 60.0)),
    ({"HOROVOD_GLOO_TIMEOUT_SECONDS": "300", "SLUICE_SCHEDULER_OP_TIMEOUT": "45"}, (45.0, 60.0)),
])
def test_horovods_timeout_variables_mean_our_deadlines(environ: dict[str, str], want: tuple[float, float]) -> None:
    config = load_config(None, environ, [])
    assert (config.scheduler.op_timeout, config.collective.stall_timeout) == want


def test_a_horovod_switch_that_is_no_integer_is_named() -> None:
    with pytest.raises(ConfigError, match=r"HOROVOD_HIERARCHICAL_ALLREDUCE = 'yes'.*0 or 1"):
        load_config(None, {"HOROVOD_HIERARCHICAL_ALLREDUCE": "yes"}, [])


@pytest.mark.parametrize(
    ("environ", "sets", "needles"),
    [
        ({}, ["nosuch.field=1"], ["nosuch", "--set nosuch.field=1", "transport, scheduler, ps, worker"]),
        ({}, ["transport.chunk_byte=1"], ["transport.chunk_byte", "--set", "chunk_bytes", "channels"]),
        ({"SLUICE_TRANSPORT_CHUNKS": "1"}, [], ["transport.chunks", "SLUICE_TRANSPORT_CHUNKS", "chunk_bytes"]),
        ({"SLUICE_NOSUCH_X": "1"}, [], ["SLUICE_NOSUCH_X", "SLUICE_TRANSPORT_*"]),
        ({}, ["transport.channels=three"], ["transport.channels", "--set transport.channels=three", "int"]),
        ({"SLUICE_PS_SYNC": "maybe"}, [], ["ps.sync", "SLUICE_PS_SYNC", "true/false"]),
        ({}, ["scheduler.op_timeout=nan"], ["scheduler.op_timeout", "finite"]),
        ({}, ["transport.channels=9"], ["transport.channels must be 1..8", "--set transport.channels=9"]),
        ({}, ["transport.io_threads=0"], ["transport.io_threads must be 1..16", "--set transport.io_threads=0"]),
        ({}, ["transport.channels"], ["section.field=value"]),
        ({}, ["collective.local_group=nccl"], ["collective.local_group must be one of auto, torch, sluice",
                                              "--set collective.local_group=nccl"]),
    ],
)
def test_errors_name_key_and_source(environ: dict[str, str], sets: list[str], needles: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, environ, sets)
    for needle in needles:
        assert needle in str(info.value)


def test_file_errors(tmp_path: Path) -> None:
    bad_key = _write(tmp_path, "[scheduler]\nheartbeat = 1.0\n")
    with pytest.raises(ConfigError, match=r"scheduler\.heartbeat .*config file .*sluice\.toml.*heartbeat_interval"):
        load_config(bad_key, {}, [])
    bad_type = _write(tmp_path, '[ps]\nsync = "sometimes"\n')
    with pytest.raises(ConfigError, match=r"ps\.sync.*sluice\.toml"):
        load_config(bad_type, {}, [])
    bad_toml = _write(tmp_path, "[ps\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad_toml, {}, [])
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(str(tmp_path / "missing.toml"), {}, [])
    top_level = _write(tmp_path, "chunk_bytes = 1\n")
    with pytest.raises(ConfigError, match="unknown section 'chunk_bytes'"):
        load_config(top_level, {}, [])


def test_sections_round_trip() -> None:
    config = load_config(None, {}, ["transport.tos=1,2,3", "ps.sync=false", "worker.optimizer_on=server",
                                    "scheduler.rendezvous_timeout=3"])
    sections = config.to_sections()
    assert set(sections) == set(SECTIONS)
    assert sections["transport"]["tos"] == [1, 2, 3]
    rebuilt = SluiceConfig.from_sections(json.loads(json.dumps(sections)))
    assert rebuilt == config
    assert rebuilt.transport.tos == (1, 2, 3)
    assert SluiceConfig.from_sections({}) == SluiceConfig()
    with pytest.raises(ConfigError, match=r"ps\.nope"):
        SluiceConfig.from_sections({"ps": {"nope": 1}})


def test_describe_lists_every_key_as_toml(tmp_path: Path) -> None:
    config = load_config(None, {}, ["transport.tos=1,2,3"])
    text = config.describe()
    assert len(text.splitlines()) == len(all_fields())
    assert 'transport.protocol = "tcp"' in text
    assert "ps.sync = true" in text
    # the listing is itself a config file
    path = _write(tmp_path, text)
    assert load_config(path, {}, []) == config


def test_every_field_has_a_description() -> None:
    for section, cls in SECTIONS.items():
        names = [f.name for f in dataclasses.fields(cls)]
        infos = [i for i in all_fields() if i.section == section]
        assert [i.name for i in infos] == names
        assert all(i.help for i in infos), [i.key for i in infos if not i.help]


@pytest.mark.parametrize("command", ["launch", "config", "scheduler", "server"])
def test_help_lists_every_field(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([command, "--help"]) == 0
    text = capsys.readouterr().out
    for info in all_fields():
        assert f"{info.key} = " in text
        assert info.help.split()[0] in text


def test_cli_config_command(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_TRANSPORT_CHANNELS", "2")
    assert main(["config", "--set", "transport.chunk_bytes=65536"]) == 0
    out = capsys.readouterr().out
    assert "transport.chunk_bytes = 65536  # from --set transport.chunk_bytes=65536" in out
    assert "transport.channels = 2  # from environment variable SLUICE_TRANSPORT_CHANNELS" in out
    assert main(["config", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["transport"]["channels"] == 2
    assert main(["config", "--set", "transport.nope=1"]) == 2
    assert "sluice: error: unknown key transport.nope" in capsys.readouterr().err


def test_cli_launch_argument_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "-w", "0", "-s", "1", "--", "true"]) == 2
    assert "at least one worker" in capsys.readouterr().err
    assert main(["launch", "-w", "1", "-s", "1"]) == 2
    assert "no worker command" in capsys.readouterr().err
    assert main(["launch", "-w", "1", "-s", "1", "--set", "ps.sync=maybe", "--", "true"]) == 2
    assert "sluice: error: ps.sync" in capsys.readouterr().err
