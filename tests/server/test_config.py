"""Tests of server.config (the daemon's settings) and exchange.config_values (its parsers)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import fields
from pathlib import Path

import pytest

from exchange.config_values import (
    MAX_SIZE,
    format_size,
    is_power_of_two,
    parse_bool,
    parse_duration,
    parse_int,
    parse_size,
)
from exchange.errors import ConfigError
from server.config import (
    DaemonConfig,
    build_arg_parser,
    config_from_namespace,
    env_var_name,
    flag_name,
    load_config,
)

KIB = 1024
MIB = 1024 * KIB


def write_toml(tmp_path: Path, text: str, name: str = "daemon.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# --- exchange.config_values ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, 0),
        (4096, 4096),
        ("4096", 4096),
        (" 8 B ", 8),
        ("100 bytes", 100),
        ("32k", 32 * KIB),
        ("32kb", 32 * KIB),
        ("32KiB", 32 * KIB),
        ("32 KB", 32 * KIB),
        ("64mb", 64 * MIB),
        ("64 MiB", 64 * MIB),
        ("64M", 64 * MIB),
        ("1g", 1024 * MIB),
        ("2GiB", 2048 * MIB),
        ("1t", 1024**4),
        ("1.5mb", 3 * MIB // 2),
        ("0.5k", 512),
        (".25k", 256),
        ("256tib", MAX_SIZE),
        (MAX_SIZE, MAX_SIZE),
    ],
)
def test_parse_size_accepts(value: int | str, expected: int) -> None:
    assert parse_size(value, "network_memory") == expected


@pytest.mark.parametrize(
    "value",
    [
        -1,
        "-1",
        "-1mb",
        "",
        "abc",
        "k",
        "12xb",
        "1 2k",
        "1e3",
        "1,5mb",
        "+5",
        "1.5",  # half a byte
        "0.3k",  # 307.2 bytes
        MAX_SIZE + 1,
        "257t",
        "9" * 5000,
        True,
        1.5,
        None,
        [1],
    ],
)
def test_parse_size_refuses(value: object) -> None:
    with pytest.raises(ConfigError) as info:
        parse_size(value, "network_memory")  # type: ignore[arg-type]
    assert info.value.setting == "network_memory"
    assert "network_memory" in str(info.value)
    if not isinstance(value, str) or len(value) < 100:
        assert repr(value) in str(info.value)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("100ms", 0.1),
        ("250 ms", 0.25),
        ("1s", 1.0),
        ("10s", 10.0),
        ("1.5s", 1.5),
        ("2m", 120.0),
        ("2min", 120.0),
        ("1h", 3600.0),
        ("1d", 86400.0),
        ("500us", 0.0005),
        ("10 seconds", 10.0),
        ("0", 0.0),
        ("-0", 0.0),
        ("0.25", 0.25),
        (" 7 ", 7.0),
        (5, 5.0),
        (0.25, 0.25),
    ],
)
def test_parse_duration_accepts(value: float | str, expected: float) -> None:
    result = parse_duration(value, "buffer_timeout")
    assert isinstance(result, float)
    assert result == pytest.approx(expected)


@pytest.mark.parametrize(
    "value",
    ["-1", -1, -1.0, "-5", "-0.5s", "abc", "", "10x", "1e3", "s", float("nan"), float("inf"),
     float("-inf"), 10**400, "9" * 400 + "d", True, None, [1]],
)  # fmt: skip
def test_parse_duration_refuses(value: object) -> None:
    with pytest.raises(ConfigError) as info:
        parse_duration(value, "handshake_timeout")  # type: ignore[arg-type]
    assert info.value.setting == "handshake_timeout"


@pytest.mark.parametrize("value", [-1, -1.0, "-1", " -1 ", "-1.0"])
def test_parse_duration_negative_one_where_allowed(value: float | str) -> None:
    assert parse_duration(value, "buffer_timeout", allow_negative_one=True) == -1.0


@pytest.mark.parametrize("value", [-2, "-2", "-1s", "-1ms", "-0.5"])
def test_parse_duration_other_negatives_refused_even_where_minus_one_is_allowed(
    value: float | str,
) -> None:
    with pytest.raises(ConfigError, match="only negative value") as info:
        parse_duration(value, "buffer_timeout", allow_negative_one=True)
    assert info.value.setting == "buffer_timeout"


@pytest.mark.parametrize(
    ("value", "expected"),
    [(True, True), (False, False), ("true", True), ("YES", True), ("on", True), ("1", True),
     ("False", False), ("no", False), ("off", False), (" 0 ", False)],
)  # fmt: skip
def test_parse_bool(value: bool | str, expected: bool) -> None:
    assert parse_bool(value, "debloat_enabled") is expected


@pytest.mark.parametrize("value", ["maybe", "", "2", 1, 0, None])
def test_parse_bool_refuses(value: object) -> None:
    with pytest.raises(ConfigError) as info:
        parse_bool(value, "debloat_enabled")  # type: ignore[arg-type]
    assert info.value.setting == "debloat_enabled"


def test_parse_int() -> None:
    assert parse_int(" 42 ", "n") == 42
    assert parse_int("-3", "n") == -3
    assert parse_int(7, "n", minimum=7, maximum=7) == 7
    for bad in ["4.0", "x", "", True, 4.0, "9" * 5000]:
        with pytest.raises(ConfigError, match="'n'"):
            parse_int(bad, "n")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="between 0 and 10"):
        parse_int(11, "n", minimum=0, maximum=10)
    with pytest.raises(ConfigError, match="at least 1"):
        parse_int("0", "n", minimum=1)
    with pytest.raises(ConfigError, match="at most 5"):
        parse_int("6", "n", maximum=5)


def test_is_power_of_two_and_format_size() -> None:
    assert [n for n in range(-4, 70) if is_power_of_two(n)] == [1, 2, 4, 8, 16, 32, 64]
    assert format_size(32 * KIB) == "32 KiB"
    assert format_size(64 * MIB) == "64 MiB"
    assert format_size(3 * MIB // 2) == "1536 KiB"
    assert format_size(100) == "100 bytes"
    assert format_size(0) == "0 bytes"


# --- DaemonConfig: defaults and construction ------------------------------------------------


def test_defaults_are_flinks() -> None:
    config = DaemonConfig()
    assert config.host == "127.0.0.1"
    assert (config.data_port, config.http_port) == (0, 0)
    assert config.local_socket is None
    assert config.network_memory == 64 * MIB
    assert config.segment_size == 32 * KIB
    assert config.num_segments == 2048
    assert config.exclusive_buffers_per_channel == 2
    assert config.floating_buffers_per_gate is None  # the reader decides: 32 batch, 8 streaming
    assert (config.high_watermark, config.low_watermark) == (None, None)
    # Flink's Netty watermarks are 2 segments / 1; ours gather 8 segments per write
    assert config.effective_high_watermark == 8 * 32 * KIB
    assert config.effective_low_watermark == 4 * 32 * KIB
    assert config.partition_request_backoff_initial == 0.1
    assert config.partition_request_backoff_max == 10.0
    assert config.buffer_timeout == 0.1
    assert config.max_connections == 1024
    assert config.handshake_timeout == 10.0
    # the daemon's user's own directory (docs/security.md), not one shared by every user
    assert config.spill_dir == os.path.join(tempfile.gettempdir(), f"exchange-{os.geteuid()}")
    assert config.max_requests_per_connection == 512
    # per-application budgets are on by default, derived from the network memory
    assert config.effective_max_pinned_segments_per_app == 3072
    assert config.effective_max_partitions_per_app == 4 * 2048
    assert config.effective_max_readers_per_app == 2048
    assert config.effective_max_reader_memory_per_app == 64 * MIB
    assert config.max_subpartitions_per_partition == 1024
    assert (config.spill_quota_per_app, config.spill_min_free) == (None, None)
    assert config.secret_file is None
    assert config.log_level == "INFO"
    assert config.blocking_partition_ttl == 3600.0
    assert config.debloat_enabled is False
    assert config.debloat_target == 1.0
    assert config.debloat_period == 0.2
    assert config.debloat_samples == 20
    assert config.debloat_threshold_percent == 25
    assert config.debloat_min_buffer_size == 256
    assert config.checkpoint_alignment_limit is None
    # Flink's default: "mmap" saves the daemon a third of its CPU on the data port, but a
    # truncated or unreadable spill file is then a SIGBUS of the daemon (docs/deploy.md)
    assert config.blocking_shuffle_type == "file"


def test_blocking_shuffle_type_from_every_source(tmp_path: Path) -> None:
    assert load_config(
        [], env={"EXCHANGE_BLOCKING_SHUFFLE_TYPE": "mmap"}
    ).blocking_shuffle_type == ("mmap")
    toml = tmp_path / "d.toml"
    toml.write_text('blocking-shuffle-type = " MMap "\n')
    assert load_config(["--config", str(toml)], env={}).blocking_shuffle_type == "mmap"
    flags = ["--config", str(toml), "--blocking-shuffle-type", "file"]
    assert load_config(flags, env={}).blocking_shuffle_type == "file"
    with pytest.raises(ConfigError, match="expected one of file, mmap"):
        DaemonConfig(blocking_shuffle_type=1)  # type: ignore[arg-type]


def test_load_without_any_source_gives_defaults() -> None:
    assert load_config([], env={}) == DaemonConfig()


def test_config_is_frozen() -> None:
    config = DaemonConfig()
    with pytest.raises(AttributeError):
        config.data_port = 7000  # type: ignore[misc]


def test_constructor_normalizes_values() -> None:
    config = DaemonConfig(log_level="warn", buffer_timeout=1, handshake_timeout=3)
    assert config.log_level == "WARNING"
    assert isinstance(config.buffer_timeout, float)
    assert DaemonConfig(log_level="debug").log_level == "DEBUG"


def test_explicit_watermarks_and_num_segments() -> None:
    config = DaemonConfig(
        network_memory=1 * MIB + 5, segment_size=64 * KIB, high_watermark=200, low_watermark=0
    )
    assert config.num_segments == 16  # floor division; the 5 spare bytes are unused
    assert (config.effective_high_watermark, config.effective_low_watermark) == (200, 0)


@pytest.mark.parametrize(
    ("kwargs", "setting"),
    [
        ({"low_watermark": 256 * KIB}, "low_watermark"),  # equal to the default high
        ({"low_watermark": 100, "high_watermark": 100}, "low_watermark"),
        ({"low_watermark": 101, "high_watermark": 100}, "low_watermark"),
        ({"high_watermark": 128 * KIB}, "high_watermark"),  # not above the default low
        ({"network_memory": 15 * 32 * KIB}, "network_memory"),
        ({"network_memory": 16 * 32 * KIB - 1}, "network_memory"),
        ({"segment_size": 1 * MIB, "network_memory": 8 * MIB}, "network_memory"),
        ({"exclusive_buffers_per_channel": 0}, "exclusive_buffers_per_channel"),
        ({"exclusive_buffers_per_channel": 2049}, "exclusive_buffers_per_channel"),
        ({"partition_request_backoff_initial": 11.0}, "partition_request_backoff_initial"),
        ({"partition_request_backoff_initial": 2.0, "partition_request_backoff_max": 1.0},
         "partition_request_backoff_initial"),
        ({"debloat_min_buffer_size": 64 * KIB}, "debloat_min_buffer_size"),
        ({"data_port": 7000, "http_port": 7000}, "http_port"),
        ({"shared_memory_per_app": 32 * KIB - 1}, "shared_memory_per_app"),
        ({"shared_memory": "sometimes"}, "shared_memory"),
        ({"max_consumer_pins_per_process": -1}, "max_consumer_pins_per_process"),
        ({"max_consumer_pins_per_process": "many"}, "max_consumer_pins_per_process"),
    ],
)  # fmt: skip
def test_relations_between_settings_are_checked(kwargs: dict[str, object], setting: str) -> None:
    with pytest.raises(ConfigError) as info:
        DaemonConfig(**kwargs)  # type: ignore[arg-type]
    assert info.value.setting == setting
    assert setting in str(info.value)


def test_relations_that_hold() -> None:
    DaemonConfig(network_memory=16 * 32 * KIB)  # exactly the minimum number of segments
    DaemonConfig(low_watermark=100, high_watermark=101)
    DaemonConfig(exclusive_buffers_per_channel=1, floating_buffers_per_gate=0)
    DaemonConfig(partition_request_backoff_initial=1.0, partition_request_backoff_max=1.0)
    DaemonConfig(debloat_min_buffer_size=32 * KIB)
    DaemonConfig(data_port=0, http_port=0)


def test_to_dict_round_trips_and_holds_no_secret(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("hunter2-very-secret\n")
    secret.chmod(0o600)
    config = DaemonConfig(secret_file=str(secret), data_port=7000, checkpoint_alignment_limit=1)
    assert config.load_secret() == b"hunter2-very-secret"
    data = config.to_dict()
    assert list(data) == [f.name for f in fields(DaemonConfig)]
    assert data["secret_file"] == str(secret)
    assert "secret" not in data
    assert "hunter2" not in repr(data) + repr(config)
    assert DaemonConfig(**data) == config  # type: ignore[arg-type]


# --- bad values, from every source ----------------------------------------------------------

BAD_VALUES: list[tuple[str, str]] = [
    ("host", "two words"),
    ("data_port", "-1"),
    ("data_port", "65536"),
    ("data_port", "http"),
    ("data_port", "80.5"),
    ("http_port", "70000"),
    ("network_memory", "lots"),
    ("network_memory", "-64mb"),
    ("network_memory", "0"),
    ("network_memory", "64k"),  # only 2 segments
    ("network_memory", "1.5"),
    ("network_memory", "1024t"),
    ("segment_size", "48k"),  # not a power of two
    ("segment_size", "2k"),  # below 4 KiB
    ("segment_size", "32m"),  # above 16 MiB
    ("segment_size", "32 parsecs"),
    ("exclusive_buffers_per_channel", "-1"),
    ("exclusive_buffers_per_channel", "two"),
    ("floating_buffers_per_gate", "-1"),
    ("high_watermark", "0"),
    ("high_watermark", "high"),
    ("low_watermark", "-1"),
    ("low_watermark", "256k"),  # not below the default high watermark
    ("partition_request_backoff_initial", "0"),
    ("partition_request_backoff_initial", "-100ms"),
    ("partition_request_backoff_initial", "soon"),
    ("partition_request_backoff_max", "0s"),
    ("partition_request_backoff_max", "-1"),
    ("buffer_timeout", "-2"),
    ("buffer_timeout", "-1s"),
    ("buffer_timeout", "100 lightyears"),
    ("max_connections", "0"),
    ("max_connections", "many"),
    ("handshake_timeout", "0"),
    ("handshake_timeout", "-1"),
    ("peer_timeout", "-1"),
    ("peer_timeout", "never"),
    ("log_level", "TRACE"),
    ("blocking_partition_ttl", "-1"),
    ("blocking_partition_ttl", "forever"),
    ("debloat_enabled", "maybe"),
    ("debloat_target", "0ms"),
    ("debloat_period", "-1"),
    ("debloat_samples", "0"),
    ("debloat_threshold_percent", "101"),
    ("debloat_threshold_percent", "-1"),
    ("debloat_threshold_percent", "25%"),
    ("debloat_min_buffer_size", "0"),
    ("debloat_min_buffer_size", "255"),  # below the writers' floor: never honoured
    ("debloat_min_buffer_size", "64k"),  # above the segment size
    ("debloat_initial_buffer_size", "0"),
    ("debloat_initial_buffer_size", "64k"),  # above the segment size
    ("debloat_initial_buffer_size", "100"),  # below debloat_min_buffer_size
    ("checkpoint_alignment_limit", "0"),
    ("checkpoint_alignment_limit", "-2"),
    ("checkpoint_alignment_limit", "big"),
    ("blocking_shuffle_type", "tape"),
    ("blocking_shuffle_type", "mmap file"),
]


@pytest.mark.parametrize(("setting", "value"), BAD_VALUES)
def test_bad_value_in_environment_names_setting_and_value(setting: str, value: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config([], env={env_var_name(setting): value})
    assert info.value.setting == setting
    message = str(info.value)
    assert setting in message
    assert value in message or str(parse_size(value, setting)) in message


@pytest.mark.parametrize(("setting", "value"), BAD_VALUES)
def test_bad_value_as_flag_names_setting_and_value(setting: str, value: str) -> None:
    if setting == "debloat_enabled":
        pytest.skip("--debloat/--no-debloat take no value")
    with pytest.raises(ConfigError) as info:
        load_config([f"{flag_name(setting)}={value}"], env={})
    assert info.value.setting == setting
    assert setting in str(info.value)


@pytest.mark.parametrize(
    ("setting", "value"),
    [("host", ""), ("spill_dir", ""), ("spill_dir", "a\0b"), ("log_level", "")],
)
def test_empty_or_unusable_strings_refused(setting: str, value: str) -> None:
    with pytest.raises(ConfigError) as info:
        DaemonConfig(**{setting: value})  # type: ignore[arg-type]
    assert info.value.setting == setting


def test_errors_say_where_the_value_came_from(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"'lots'.*--network-memory"):
        load_config(["--network-memory", "lots"], env={})
    with pytest.raises(ConfigError, match=r"'lots'.*EXCHANGE_NETWORK_MEMORY"):
        load_config([], env={"EXCHANGE_NETWORK_MEMORY": "lots"})
    path = write_toml(tmp_path, 'network-memory = "lots"\n')
    with pytest.raises(ConfigError, match=r"'lots'.*'network-memory'.*daemon\.toml"):
        load_config(["--config", path], env={})


# --- sources and precedence -----------------------------------------------------------------


@pytest.mark.parametrize("use_file", [False, True])
@pytest.mark.parametrize("use_env", [False, True])
@pytest.mark.parametrize("use_flag", [False, True])
def test_precedence_flag_over_env_over_file_over_default(
    tmp_path: Path, use_file: bool, use_env: bool, use_flag: bool
) -> None:
    argv: list[str] = []
    env: dict[str, str] = {}
    if use_file:
        argv += ["--config", write_toml(tmp_path, 'network_memory = "1mb"\n')]
    if use_env:
        env["EXCHANGE_NETWORK_MEMORY"] = "2mb"
    if use_flag:
        argv += ["--network-memory", "4mb"]
    expected = 64 * MIB
    for present, value in [(use_file, 1 * MIB), (use_env, 2 * MIB), (use_flag, 4 * MIB)]:
        if present:
            expected = value
    assert load_config(argv, env=env).network_memory == expected


def test_layers_merge_per_setting(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "data_port = 7001\nhttp_port = 8001\nmax_connections = 5\n")
    config = load_config(
        ["--config", path, "--http-port", "8003"],
        env={"EXCHANGE_DATA_PORT": "7002", "EXCHANGE_HTTP_PORT": "8002"},
    )
    assert (config.data_port, config.http_port, config.max_connections) == (7002, 8003, 5)
    assert config.segment_size == 32 * KIB  # untouched: the default


def test_environment_examples() -> None:
    config = load_config([], env={"EXCHANGE_NETWORK_MEMORY": "128mb", "EXCHANGE_DATA_PORT": "7000"})
    assert (config.network_memory, config.data_port) == (128 * MIB, 7000)


def test_empty_and_foreign_environment_variables_are_ignored() -> None:
    env = {"EXCHANGE_DATA_PORT": "", "EXCHANGE_DAEMON": "host:1234", "EXCHANGE_CONFIG": ""}
    assert load_config([], env=env) == DaemonConfig()


def test_every_setting_has_a_flag_and_an_environment_variable() -> None:
    parser = build_arg_parser()
    options = {opt for action in parser._actions for opt in action.option_strings}
    for f in fields(DaemonConfig):
        assert flag_name(f.name) in options
        assert env_var_name(f.name) == "EXCHANGE_" + f.name.upper()
    assert {"--config", "--no-debloat", "--debloat", "--network-memory"} <= options


def test_all_flags() -> None:
    argv = [
        "--host=0.0.0.0",
        "--advertise-host=node-7.example",
        "--data-port=7000",
        "--http-port=8080",
        "--local-socket=/tmp/x.sock",
        "--local-socket-group=185",
        "--local-socket-mode=0660",
        "--network-memory=128mb",
        "--segment-size=64k",
        "--exclusive-buffers-per-channel=4",
        "--floating-buffers-per-gate=16",
        "--high-watermark=256kb",
        "--low-watermark=128kb",
        "--partition-request-backoff-initial=50ms",
        "--partition-request-backoff-max=5s",
        "--buffer-timeout=0",
        "--max-connections=10",
        "--max-requests-per-connection=100",
        "--max-partitions-per-app=50",
        "--max-pinned-segments-per-app=800",
        "--max-readers-per-app=300",
        "--max-reader-memory-per-app=20mb",
        "--max-subpartitions-per-partition=200",
        "--spill-quota-per-app=10g",
        "--spill-min-free=1g",
        "--handshake-timeout=2s",
        "--peer-timeout=30s",
        "--spill-dir=/tmp/spill-here",
        "--blocking-shuffle-type=MMAP",
        "--secret-file=/etc/exchange/secret",
        "--log-level=debug",
        "--blocking-partition-ttl=2m",
        "--producer-credit=12",
        "--max-overdraft-buffers-per-partition=3",
        "--debloat",
        "--debloat-target=500ms",
        "--debloat-period=100ms",
        "--debloat-samples=10",
        "--debloat-threshold-percent=50",
        "--debloat-min-buffer-size=1k",
        "--debloat-initial-buffer-size=2k",
        "--checkpoint-alignment-limit=16mb",
        "--tls-cert-file=/etc/exchange/daemon.pem",
        "--tls-key-file=/etc/exchange/daemon.key",
        "--tls-ca-file=/etc/exchange/ca.pem",
        "--tls-client-auth",
        "--http-host=127.0.0.2",
        "--max-unauthenticated-connections=4",
        "--max-unauthenticated-per-peer=2",
        "--require-tls-remote",
        "--no-shared-memory",
        "--shared-memory-per-app=8mb",
        "--max-consumer-pins-per-process=64",
    ]
    assert load_config(argv, env={}).to_dict() == {
        "host": "0.0.0.0",
        "http_host": "127.0.0.2",
        "advertise_host": "node-7.example",
        "data_port": 7000,
        "http_port": 8080,
        "local_socket": "/tmp/x.sock",
        "local_socket_group": "185",
        "local_socket_mode": 0o660,
        "network_memory": 128 * MIB,
        "segment_size": 64 * KIB,
        "exclusive_buffers_per_channel": 4,
        "floating_buffers_per_gate": 16,
        "producer_credit": 12,
        "max_overdraft_buffers_per_partition": 3,
        "high_watermark": 256 * KIB,
        "low_watermark": 128 * KIB,
        "partition_request_backoff_initial": 0.05,
        "partition_request_backoff_max": 5.0,
        "buffer_timeout": 0.0,
        "max_connections": 10,
        "max_unauthenticated_connections": 4,
        "max_unauthenticated_per_peer": 2,
        "max_requests_per_connection": 100,
        "max_partitions_per_app": 50,
        "max_pinned_segments_per_app": 800,
        "max_readers_per_app": 300,
        "max_reader_memory_per_app": 20 * MIB,
        "max_subpartitions_per_partition": 200,
        "spill_quota_per_app": 10 * 1024 * MIB,
        "spill_min_free": 1024 * MIB,
        "handshake_timeout": 2.0,
        "peer_timeout": 30.0,
        "spill_dir": "/tmp/spill-here",
        "blocking_shuffle_type": "mmap",
        "secret_file": "/etc/exchange/secret",
        "log_level": "DEBUG",
        "blocking_partition_ttl": 120.0,
        "debloat_enabled": True,
        "debloat_target": 0.5,
        "debloat_period": 0.1,
        "debloat_samples": 10,
        "debloat_threshold_percent": 50,
        "debloat_min_buffer_size": 1024,
        "debloat_initial_buffer_size": 2048,
        "checkpoint_alignment_limit": 16 * MIB,
        "tls_cert_file": "/etc/exchange/daemon.pem",
        "tls_key_file": "/etc/exchange/daemon.key",
        "tls_ca_file": "/etc/exchange/ca.pem",
        "tls_client_auth": True,
        "require_tls_remote": True,
        "shared_memory": False,
        "shared_memory_per_app": 8 * MIB,
        "max_consumer_pins_per_process": 64,
    }


def test_debloat_flags_override_environment() -> None:
    assert load_config([], env={"EXCHANGE_DEBLOAT_ENABLED": "true"}).debloat_enabled is True
    env = {"EXCHANGE_DEBLOAT_ENABLED": "on"}
    assert load_config(["--no-debloat"], env=env).debloat_enabled is False
    assert load_config(["--debloat"], env={"EXCHANGE_DEBLOAT_ENABLED": "0"}).debloat_enabled


@pytest.mark.parametrize("argv", [["--buffer-timeout", "-1"], ["--buffer-timeout=-1"]])
def test_buffer_timeout_minus_one_from_flag(argv: list[str]) -> None:
    assert load_config(argv, env={}).buffer_timeout == -1.0


def test_buffer_timeout_minus_one_from_env_and_file(tmp_path: Path) -> None:
    assert load_config([], env={"EXCHANGE_BUFFER_TIMEOUT": "-1"}).buffer_timeout == -1.0
    path = write_toml(tmp_path, "buffer-timeout = -1\n")
    assert load_config(["--config", path], env={}).buffer_timeout == -1.0
    assert load_config(["--buffer-timeout", "0"], env={}).buffer_timeout == 0.0


@pytest.mark.parametrize("word", ["unlimited", "none", "NONE", "-1"])
def test_checkpoint_alignment_limit_unlimited(tmp_path: Path, word: str) -> None:
    path = write_toml(tmp_path, 'checkpoint_alignment_limit = "16mb"\n')
    env = {"EXCHANGE_CHECKPOINT_ALIGNMENT_LIMIT": word}
    assert load_config(["--config", path], env={}).checkpoint_alignment_limit == 16 * MIB
    assert load_config(["--config", path], env=env).checkpoint_alignment_limit is None


def test_watermark_none_restores_the_default(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "high_watermark = 1000000\n")
    config = load_config(["--config", path, "--high-watermark", "none"], env={})
    assert config.high_watermark is None
    assert config.effective_high_watermark == 256 * KIB


def test_config_file_from_environment_and_flag_wins(tmp_path: Path) -> None:
    by_env = write_toml(tmp_path, "data_port = 7001\n", "env.toml")
    by_flag = write_toml(tmp_path, "data_port = 7002\n", "flag.toml")
    assert load_config([], env={"EXCHANGE_CONFIG": by_env}).data_port == 7001
    assert load_config(["--config", by_flag], env={"EXCHANGE_CONFIG": by_env}).data_port == 7002


def test_default_environment_is_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXCHANGE_MAX_CONNECTIONS", "3")
    assert load_config([]).max_connections == 3


def test_extended_parser(tmp_path: Path) -> None:
    parser = build_arg_parser()
    parser.add_argument("--print-config", action="store_true")
    args = parser.parse_args(["--print-config", "--data-port", "7000"])
    assert isinstance(args, argparse.Namespace)
    config = config_from_namespace(args, {})
    assert config.data_port == 7000


def test_malformed_command_line_exits_like_argparse(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        load_config(["--no-such-flag"], env={})
    assert info.value.code == 2
    assert "--no-such-flag" in capsys.readouterr().err


def test_help_mentions_defaults_and_environment(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        load_config(["--help"], env={})
    out = capsys.readouterr().out
    assert "EXCHANGE_NETWORK_MEMORY" in out
    assert "64 MiB" in out
    assert "--no-debloat" in out


# --- the TOML file --------------------------------------------------------------------------


def test_toml_keys_with_dashes_and_underscores(tmp_path: Path) -> None:
    path = write_toml(
        tmp_path,
        """
        host = "0.0.0.0"
        data-port = 7000
        network-memory = "128mb"
        segment_size = 65536
        buffer-timeout = "5ms"
        partition_request_backoff_max = 20
        debloat-enabled = true
        debloat_threshold-percent = 10
        log-level = "error"
        checkpoint-alignment-limit = "1g"
        """,
    )
    config = load_config(["--config", path], env={})
    assert config.host == "0.0.0.0"
    assert config.data_port == 7000
    assert config.network_memory == 128 * MIB
    assert config.segment_size == 64 * KIB
    assert config.buffer_timeout == pytest.approx(0.005)
    assert config.partition_request_backoff_max == 20.0
    assert config.debloat_enabled is True
    assert config.debloat_threshold_percent == 10
    assert config.log_level == "ERROR"
    assert config.checkpoint_alignment_limit == 1024 * MIB


def test_toml_unknown_key(tmp_path: Path) -> None:
    path = write_toml(tmp_path, 'network-memroy = "128mb"\n')
    with pytest.raises(ConfigError, match="network_memory") as info:  # the suggestion
        load_config(["--config", path], env={})
    assert info.value.setting == "network-memroy"
    assert "unknown" in str(info.value)


@pytest.mark.parametrize("text", ["config = 'x.toml'\n", "[exchange]\ndata_port = 1\n"])
def test_toml_other_unknown_keys(tmp_path: Path, text: str) -> None:
    with pytest.raises(ConfigError, match="unknown"):
        load_config(["--config", write_toml(tmp_path, text)], env={})


def test_toml_same_setting_twice(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "data-port = 1\ndata_port = 2\n")
    with pytest.raises(ConfigError, match="twice") as info:
        load_config(["--config", path], env={})
    assert info.value.setting == "data_port"


@pytest.mark.parametrize(
    ("text", "setting"),
    [
        ('data_port = "7000"', "data_port"),
        ("data-port = true", "data_port"),
        ("data_port = 7000.0", "data_port"),
        ("network_memory = true", "network_memory"),
        ("network_memory = 1.5", "network_memory"),
        ("network-memory = [1, 2]", "network_memory"),
        ("host = 5", "host"),
        ('debloat_enabled = "yes"', "debloat_enabled"),
        ("debloat_enabled = 1", "debloat_enabled"),
        ("buffer_timeout = [1]", "buffer_timeout"),
        ("buffer_timeout = false", "buffer_timeout"),
        ("log_level = 1", "log_level"),
        ("spill_dir = 1979-05-27", "spill_dir"),
        ("secret-file = {path = 'x'}", "secret_file"),
    ],
)
def test_toml_wrong_type(tmp_path: Path, text: str, setting: str) -> None:
    path = write_toml(tmp_path, text + "\n")
    with pytest.raises(ConfigError, match="type") as info:
        load_config(["--config", path], env={})
    assert info.value.setting == setting
    assert text.split("=")[0].strip() in str(info.value)  # the key as written


def test_toml_bad_value(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "data_port = 70000\n")
    with pytest.raises(ConfigError, match="70000") as info:
        load_config(["--config", path], env={})
    assert info.value.setting == "data_port"


def test_config_file_missing_or_malformed(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist") as info:
        load_config(["--config", str(tmp_path / "nope.toml")], env={})
    assert info.value.setting == "config"
    with pytest.raises(ConfigError, match="not valid TOML") as info:
        load_config(["--config", write_toml(tmp_path, "data_port = = 1\n")], env={})
    assert info.value.setting == "config"
    with pytest.raises(ConfigError, match="cannot be read") as info:
        load_config(["--config", str(tmp_path)], env={})
    assert info.value.setting == "config"


# --- secret file ----------------------------------------------------------------------------


def secret_config(path: Path, content: bytes | None, mode: int = 0o600) -> DaemonConfig:
    if content is not None:
        path.write_bytes(content)
        path.chmod(mode)
    return DaemonConfig(secret_file=str(path))


def test_no_secret_file_means_no_secret() -> None:
    assert DaemonConfig().load_secret() is None


GOOD = b"0123456789abcdef-s3cret"


@pytest.mark.parametrize(
    ("content", "expected"),
    [(GOOD + b"\n", GOOD), (GOOD, GOOD), (b"s3 cret" + GOOD + b"\r\n\n", b"s3 cret" + GOOD)],
)
def test_good_secret_file_loads(tmp_path: Path, content: bytes, expected: bytes) -> None:
    assert secret_config(tmp_path / "secret", content).load_secret() == expected
    assert secret_config(tmp_path / "r", content, mode=0o400).load_secret() == expected


@pytest.mark.parametrize("mode", [0o640, 0o620, 0o660, 0o610])
def test_secret_file_open_to_its_group_refused(tmp_path: Path, mode: int) -> None:
    with pytest.raises(ConfigError, match="its group") as info:
        secret_config(tmp_path / "secret", GOOD, mode=mode).load_secret()
    assert info.value.setting == "secret_file"


@pytest.mark.parametrize(
    "content", [b"s3cret\n", b"x" * 15, b"REPLACE-ME-with-openssl-rand-hex-32\n"]
)
def test_short_or_placeholder_secret_refused(tmp_path: Path, content: bytes) -> None:
    with pytest.raises(ConfigError, match=r"at least 16|placeholder") as info:
        secret_config(tmp_path / "secret", content).load_secret()
    assert info.value.setting == "secret_file"


def test_the_k8s_placeholder_is_refused(tmp_path: Path) -> None:
    # the placeholder as deploy/k8s/secret.yaml ships it, read from that file
    yaml = (Path(__file__).parents[2] / "deploy" / "k8s" / "secret.yaml").read_text()
    placeholder = yaml.split("secret:", 2)[-1].strip().encode()
    with pytest.raises(ConfigError, match="placeholder"):
        secret_config(tmp_path / "secret", placeholder + b"\n").load_secret()


def test_unauthenticated_limits_are_checked() -> None:
    config = DaemonConfig(max_connections=64)
    assert config.effective_max_unauthenticated == 16
    assert config.effective_max_unauthenticated_per_peer == 8
    assert DaemonConfig(max_connections=5).effective_max_unauthenticated_per_peer == 1
    with pytest.raises(ConfigError) as info:
        DaemonConfig(max_connections=64, max_unauthenticated_connections=64)
    assert info.value.setting == "max_unauthenticated_connections"
    with pytest.raises(ConfigError) as info:
        DaemonConfig(max_unauthenticated_connections=4, max_unauthenticated_per_peer=5)
    assert info.value.setting == "max_unauthenticated_per_peer"


def test_missing_secret_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist") as info:
        secret_config(tmp_path / "absent", None).load_secret()
    assert info.value.setting == "secret_file"


@pytest.mark.parametrize("content", [b"", b"\n", b"\r\n\n"])
def test_empty_secret_file_refused(tmp_path: Path, content: bytes) -> None:
    with pytest.raises(ConfigError, match="empty") as info:
        secret_config(tmp_path / "secret", content).load_secret()
    assert info.value.setting == "secret_file"


@pytest.mark.parametrize("mode", [0o644, 0o604, 0o602, 0o666])
def test_secret_file_open_to_others_refused(tmp_path: Path, mode: int) -> None:
    with pytest.raises(ConfigError, match="other users") as info:
        secret_config(tmp_path / "secret", GOOD, mode=mode).load_secret()
    assert info.value.setting == "secret_file"


def test_secret_file_not_regular_or_too_large(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a regular file"):
        DaemonConfig(secret_file=str(tmp_path)).load_secret()
    with pytest.raises(ConfigError, match="larger than"):
        secret_config(tmp_path / "big", b"x" * (64 * KIB + 1)).load_secret()


# --- paths ----------------------------------------------------------------------------------


def test_resolved_local_socket(tmp_path: Path) -> None:
    config = DaemonConfig(spill_dir=str(tmp_path))
    assert config.resolved_local_socket() == str(tmp_path / "exchange-daemon.sock")
    explicit = DaemonConfig(local_socket=str(tmp_path / "x.sock"))
    assert explicit.resolved_local_socket() == str(tmp_path / "x.sock")


def test_validate_paths_creates_spill_dir(tmp_path: Path) -> None:
    spill = tmp_path / "a" / "b"
    config = DaemonConfig(spill_dir=str(spill))
    assert not spill.exists()  # construction leaves the file system alone
    config.validate_paths()
    assert spill.is_dir()
    assert list(spill.iterdir()) == []  # the write probe is cleaned up


def test_spill_dir_that_is_a_file_refused(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    for spill in (blocker, blocker / "below"):
        with pytest.raises(ConfigError) as info:
            DaemonConfig(spill_dir=str(spill)).validate_paths()
        assert info.value.setting == "spill_dir"
        assert str(spill) in str(info.value)


def test_spill_dir_not_writable_refused(tmp_path: Path) -> None:
    spill = tmp_path / "readonly"
    spill.mkdir()
    spill.chmod(0o555)
    try:
        if os.access(spill, os.W_OK):
            pytest.skip("running as a user who may write anywhere (root)")
        with pytest.raises(ConfigError, match="not writable") as info:
            DaemonConfig(spill_dir=str(spill)).validate_paths()
        assert info.value.setting == "spill_dir"
    finally:
        spill.chmod(0o755)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux /proc")
def test_spill_dir_not_writable_even_for_root() -> None:
    # /proc/sys exists and takes no new files, whoever asks.
    with pytest.raises(ConfigError, match="not writable") as info:
        DaemonConfig(spill_dir="/proc/sys").validate_paths()
    assert info.value.setting == "spill_dir"


def test_local_socket_checks(tmp_path: Path) -> None:
    long_dir = tmp_path / ("d" * 120)
    with pytest.raises(ConfigError, match="derived from spill_dir") as info:
        DaemonConfig(spill_dir=str(long_dir)).validate_paths()
    assert info.value.setting == "local_socket"

    missing = tmp_path / "no-dir" / "x.sock"
    with pytest.raises(ConfigError, match="does not exist") as info:
        DaemonConfig(spill_dir=str(tmp_path), local_socket=str(missing)).validate_paths()
    assert info.value.setting == "local_socket"

    squatter = tmp_path / "squat.sock"
    squatter.write_text("")
    with pytest.raises(ConfigError, match="not a socket"):
        DaemonConfig(spill_dir=str(tmp_path), local_socket=str(squatter)).validate_paths()

    DaemonConfig(spill_dir=str(tmp_path), local_socket=str(tmp_path / "ok.sock")).validate_paths()


@pytest.mark.parametrize(
    ("value", "mode"),
    [("0600", 0o600), ("0660", 0o660), ("0o620", 0o620), ("660", 0o660), (0o660, 0o660)],
)
def test_local_socket_mode_takes_octal_modes(value: object, mode: int) -> None:
    assert DaemonConfig(local_socket_mode=value).local_socket_mode == mode  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("0666", "every local user"),
        ("0604", "every local user"),
        ("0640", "needs write permission"),
        ("0460", "read and write"),
        ("1660", "octal file mode"),
        ("rw-rw----", "octal file mode"),
        (660, "octal file mode"),  # a TOML decimal 660 is 0o1224
        (True, "octal file mode"),
    ],
)
def test_local_socket_mode_refuses_what_would_open_or_close_it_wrongly(
    value: object, why: str
) -> None:
    with pytest.raises(ConfigError, match=why) as info:
        DaemonConfig(local_socket_mode=value)  # type: ignore[arg-type]
    assert info.value.setting == "local_socket_mode"


def test_local_socket_group_needs_a_mode_that_lets_it_in(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="grants its group nothing") as info:
        load_config(["--local-socket-group", "185"], env={})
    assert info.value.setting == "local_socket_group"
    cfg = load_config(
        [], env={"EXCHANGE_LOCAL_SOCKET_GROUP": "185", "EXCHANGE_LOCAL_SOCKET_MODE": "0660"}
    )
    assert (cfg.local_socket_group, cfg.local_socket_mode, cfg.local_socket_gid()) == (
        "185",
        0o660,
        185,
    )
    toml = write_toml(tmp_path, "local_socket_group = 185\nlocal_socket_mode = 0o660\n")
    assert load_config(["--config", toml], env={}).local_socket_gid() == 185
    for bad in ("spark users", "-1", "", "g" * 40):
        if bad == "":
            assert DaemonConfig(local_socket_group=bad).local_socket_group is None
            continue
        with pytest.raises(ConfigError, match="not a group name or numeric gid"):
            DaemonConfig(local_socket_group=bad, local_socket_mode=0o660)


def test_a_group_name_is_looked_up_where_paths_are_checked(tmp_path: Path) -> None:
    cfg = DaemonConfig(spill_dir=str(tmp_path), local_socket_group="root", local_socket_mode=0o660)
    assert cfg.local_socket_gid() == 0
    cfg.validate_paths()
    unknown = DaemonConfig(
        spill_dir=str(tmp_path), local_socket_group="no-such-group-here", local_socket_mode=0o660
    )  # construction touches no file
    with pytest.raises(ConfigError, match="no group 'no-such-group-here'") as info:
        unknown.validate_paths()
    assert info.value.setting == "local_socket_group"


@pytest.mark.parametrize("value", ["0.0.0.0", "::", "[::]", "*"])
def test_advertise_host_refuses_wildcards(value: str) -> None:
    with pytest.raises(ConfigError, match="every interface") as info:
        load_config([], env={"EXCHANGE_ADVERTISE_HOST": value})
    assert info.value.setting == "advertise_host"
    assert "EXCHANGE_ADVERTISE_HOST" in str(info.value)


def test_unknown_variables_are_logged_with_the_closest_setting(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("WARNING", logger="exchange.server.config"):
        cfg = load_config([], env={"EXCHANGE_SEGMENT_SIZ": "64kb", "EXCHANGE_DAEMON": "/x"})
    assert cfg.segment_size == 32 * KIB  # ignored, as warned
    [record] = caplog.records
    assert "EXCHANGE_SEGMENT_SIZ" in record.getMessage()
    assert "did you mean EXCHANGE_SEGMENT_SIZE?" in record.getMessage()


def test_overdraft_buffers_from_flag_env_and_file_validated(tmp_path: Path) -> None:
    """``max_overdraft_buffers_per_partition``: Flink's default 5; 0 turns it off; a
    negative or huge count or a word is refused naming the setting."""
    assert load_config([], env={}).max_overdraft_buffers_per_partition == 5
    env = {"EXCHANGE_MAX_OVERDRAFT_BUFFERS_PER_PARTITION": "0"}
    assert load_config([], env=env).max_overdraft_buffers_per_partition == 0
    path = tmp_path / "c.toml"
    path.write_text("max_overdraft_buffers_per_partition = 2\n")
    assert load_config(["--config", str(path)], env={}).max_overdraft_buffers_per_partition == 2
    for bad in ("-1", "1025", "many"):
        with pytest.raises(ConfigError, match="max_overdraft_buffers_per_partition"):
            load_config([f"--max-overdraft-buffers-per-partition={bad}"], env={})
