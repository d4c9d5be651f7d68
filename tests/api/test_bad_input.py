"""Every public API function and every daemon flag, given invalid values.

Each case is one bad argument (wrong type, negative or zero size, unknown partition id,
closed object) with every other argument valid. What must hold: the call raises a typed
error (``ExchangeError``; ``UsageError`` for misuse, ``ConfigError`` naming the setting)
whose message names what was wrong, and nothing is corrupted: the writer, reader or
daemon that refused the call still works (the records written afterwards arrive, the
daemon's pool is whole at the end).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import fields
from typing import Any

import pytest

from client.consumer import PartitionLocation, PartitionReader
from client.local_connection import release_dataset
from client.producer import PartitionWriter
from client.runtime import get_runtime
from client.spark import exchange_shuffle, release_exchange
from client.streaming.environment import StreamEnvironment
from exchange.errors import (
    ConfigError,
    ExchangeError,
    IllegalStateError,
    PartitionError,
    PartitionNotFoundError,
    TransportError,
    UsageError,
    WriterClosedError,
)
from exchange.memory.network_buffer_pool import NetworkBufferPool
from exchange.partition.result_partition_id import ResultPartitionID
from server.config import DaemonConfig, flag_name, load_config

pytestmark = pytest.mark.timeout(120)

Daemon = Any
FAST: dict[str, Any] = {"backoff_initial": 0.01, "backoff_max": 0.04}


def raises(
    fn: Callable[[], Any], error: type[BaseException], words: str | tuple[str, ...]
) -> BaseException:
    with pytest.raises(error) as info:
        made = fn()
        if hasattr(made, "close"):  # accepted: do not leave it open for the next case
            made.close()
    assert isinstance(info.value, ExchangeError), f"{info.value!r} is not an ExchangeError"
    for w in (words,) if isinstance(words, str) else words:
        assert w in str(info.value), f"{w!r} not in {info.value}"
    return info.value


def cases(table: list[tuple[Any, ...]], n: int) -> list[Any]:
    """pytest params from a table of ``(id, *n values[, mark])``."""
    return [
        pytest.param(*row[1 : 1 + n], id=row[0], marks=row[1 + n :] if len(row) > 1 + n else ())
        for row in table
    ]


# -- ResultPartitionID -----------------------------------------------------------------------

PID_CASES = [
    (("", 0, 0), "dataset_id"),
    ((7, 0, 0), "dataset_id"),
    (("x" * 256, 0, 0), "255 bytes"),
    (("ds", -1, 0), "partition_index"),
    (("ds", "0", 0), "partition_index"),
    (("ds", True, 0), "partition_index"),
    (("ds", 2**32, 0), "partition_index"),
    (("ds", 0, -1), "attempt_id"),
    (("ds", 0, 1.5), "attempt_id"),
    (("ds", 0, 2**64), "attempt_id"),
]


@pytest.mark.parametrize(("args", "words"), PID_CASES, ids=[repr(a) for a, _ in PID_CASES])
def test_result_partition_id(args: tuple[Any, ...], words: str) -> None:
    raises(lambda: ResultPartitionID(*args), UsageError, words)


# -- PartitionWriter -------------------------------------------------------------------------

PID = ResultPartitionID("bad-input", 0, 0)

WRITER_CASES: list[tuple[Any, ...]] = [
    ("partition_id-str", {"partition_id": "bad-input#0"}, UsageError, "partition_id"),
    ("subpartitions-0", {"num_subpartitions": 0}, UsageError, "num_subpartitions"),
    ("subpartitions-negative", {"num_subpartitions": -2}, UsageError, "num_subpartitions"),
    ("subpartitions-str", {"num_subpartitions": "2"}, UsageError, "num_subpartitions"),
    ("subpartitions-bool", {"num_subpartitions": True}, UsageError, "num_subpartitions"),
    ("buffer_timeout-negative", {"buffer_timeout": -5}, UsageError, "buffer_timeout"),
    ("buffer_timeout-str", {"buffer_timeout": "1s"}, UsageError, "buffer_timeout"),
    ("buffer_timeout-nan", {"buffer_timeout": math.nan}, UsageError, "buffer_timeout"),
    ("window-0", {"window": 0}, UsageError, "window"),
    ("daemon_socket-int", {"daemon_socket": 5}, UsageError, "daemon_socket"),
    ("daemon_socket-missing", {"daemon_socket": "/nonexistent/x.sock"}, TransportError, "x.sock"),
    ("secret-str", {"secret": "s3cret"}, UsageError, "secret"),
]


@pytest.mark.parametrize(
    ("changes", "error", "words"),
    cases(WRITER_CASES, 3),
)
def test_partition_writer_arguments(
    daemon: Daemon,
    changes: dict[str, Any],
    error: type[BaseException],
    words: str,
    request: pytest.FixtureRequest,
) -> None:
    dataset = f"bad-w-{request.node.callspec.id}"
    kwargs: dict[str, Any] = {
        "partition_id": ResultPartitionID(dataset, 0, 0),
        "num_subpartitions": 2,
        "daemon_socket": daemon.local_socket,
        "buffer_timeout": 0.01,
        **changes,
    }
    pid, n = kwargs.pop("partition_id"), kwargs.pop("num_subpartitions")
    try:
        raises(lambda: PartitionWriter(pid, n, **kwargs), error, words)
        # a refused writer leaves no partition behind
        items = daemon.stats()["partitions"]["items"]
        assert not [p for p in items if p["dataset"] == dataset], items
    finally:
        get_runtime().run(release_dataset(daemon.local_socket, dataset))
    daemon.wait_pool_whole()


def _read(daemon: Daemon, pid: ResultPartitionID, sub: int, **kw: Any) -> list[Any]:
    loc = PartitionLocation(pid, sub, daemon.data_address, daemon.daemon_id, None)
    with PartitionReader([loc], **{**FAST, **kw}) as reader:
        return list(reader)


def test_partition_writer_bad_calls_corrupt_nothing(daemon: Daemon) -> None:
    pid = ResultPartitionID("bad-calls", 0, 0)
    w = PartitionWriter(pid, 2, blocking=True, daemon_socket=daemon.local_socket)
    w.emit_to((0, "a"), 0)
    raises(lambda: w.emit_to((1, "b"), 2), UsageError, "out of range")
    raises(lambda: w.emit_to((1, "b"), -1), UsageError, "out of range")
    raises(lambda: w.emit_to((1, "b"), "0"), UsageError, "out of range")
    raises(lambda: w.broadcast_barrier(-1, 0), UsageError, "checkpoint")
    w.emit_to((2, "c"), 1)
    w.close()
    raises(lambda: w.emit_to((3, "d"), 0), WriterClosedError, "closed")
    raises(lambda: w.flush(), WriterClosedError, "closed")
    # the refused calls left no trace in the stream
    assert _read(daemon, pid, 0) == [(0, "a")]
    assert _read(daemon, pid, 1) == [(2, "c")]


# -- PartitionReader -------------------------------------------------------------------------


@pytest.fixture
def no_leaked_pools(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """``check()``: every NetworkBufferPool the test made so far is destroyed or whole (a
    refused reader gave its memory back). Leaked pools are destroyed after the check, so a
    leak fails this test, once, and not the next one."""
    created: list[NetworkBufferPool] = []
    original = NetworkBufferPool.__init__

    def recording(self: NetworkBufferPool, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        created.append(self)

    monkeypatch.setattr(NetworkBufferPool, "__init__", recording)

    def check() -> None:
        leaked = [p for p in created if not p.is_destroyed and not p.is_whole()]
        for p in leaked:
            p.destroy()
        assert not leaked, f"a refused reader left its buffer pool behind: {leaked}"

    return check


@pytest.fixture(scope="module")
def written(daemon: Daemon) -> ResultPartitionID:
    pid = ResultPartitionID("bad-reader", 0, 0)
    with PartitionWriter(pid, 2, blocking=True, daemon_socket=daemon.local_socket) as w:
        w.emit_all([(i, i) for i in range(100)], partition_func=lambda k: k % 2)
    return pid


READER_CASES: list[tuple[Any, ...]] = [
    ("num_exclusive-0", {"num_exclusive": 0}, UsageError, "num_exclusive"),
    ("num_floating-negative", {"num_floating": -1}, UsageError, "num_floating"),
    ("num_exclusive-str", {"num_exclusive": "2"}, UsageError, "num_exclusive"),
    ("segment_size-0", {"segment_size": 0}, UsageError, "segment"),
    ("segment_size-negative", {"segment_size": -4096}, UsageError, "segment"),
    ("window-0", {"window": 0}, UsageError, "window"),
    ("backoff_initial-negative", {"backoff_initial": -1.0}, UsageError, "backoff"),
    (
        "backoff_max-below-initial",
        {"backoff_initial": 1.0, "backoff_max": 0.1},
        UsageError,
        "backoff",
    ),
    ("secret-str", {"secret": "s3cret"}, UsageError, "secret"),
]


@pytest.mark.parametrize(
    ("changes", "error", "words"),
    cases(READER_CASES, 3),
)
def test_partition_reader_arguments(
    daemon: Daemon,
    written: ResultPartitionID,
    changes: dict[str, Any],
    error: type[BaseException],
    words: str,
    no_leaked_pools: Callable[[], None],
) -> None:
    raises(lambda: _read(daemon, written, 0, **changes), error, words)
    no_leaked_pools()
    assert _read(daemon, written, 0) == [(i, i) for i in range(0, 100, 2)]  # unharmed


def _loc(daemon: Daemon, **changes: Any) -> Callable[[], Any]:
    def make() -> Any:
        kw: dict[str, Any] = {
            "partition_id": ResultPartitionID("bad-reader", 0, 0),
            "subpartition_index": 0,
            "data_address": daemon.data_address,
            **changes,
        }
        with PartitionReader([PartitionLocation(**kw)], **FAST) as reader:
            return list(reader)

    return make


LOCATION_CASES: list[tuple[Any, ...]] = [
    ("not-a-location", {}, UsageError, "PartitionLocation"),
    ("subpartition-out-of-range", {"subpartition_index": 2}, PartitionError, "out of range"),
    ("subpartition-negative", {"subpartition_index": -1}, UsageError, "subpartition"),
    ("subpartition-str", {"subpartition_index": "0"}, UsageError, "subpartition"),
    ("address-malformed", {"data_address": "no-port"}, UsageError, "host:port"),
    ("address-int", {"data_address": 9000}, UsageError, "address"),
    ("address-port-0", {"data_address": "127.0.0.1:0"}, UsageError, "port"),
    ("partition_id-str", {"partition_id": "bad-reader#0"}, UsageError, "partition_id"),
    (
        "unknown-partition",
        {"partition_id": ResultPartitionID("never-written", 0, 0)},
        PartitionNotFoundError,
        "never-written",
    ),
]


@pytest.mark.parametrize(
    ("changes", "error", "words"),
    cases(LOCATION_CASES, 3),
)
def test_partition_locations(
    daemon: Daemon,
    written: ResultPartitionID,
    changes: dict[str, Any],
    error: type[BaseException],
    words: str,
    no_leaked_pools: Callable[[], None],
) -> None:
    if not changes:

        def call() -> Any:
            with PartitionReader([("bad-reader", 0, daemon.data_address)], **FAST) as r:  # type: ignore[list-item]
                return list(r)

    else:
        call = _loc(daemon, **changes)
    raises(call, error, words)
    no_leaked_pools()
    daemon.wait_stats(lambda s: s["data_port"]["readers"] == 0)
    assert _read(daemon, written, 1) == [(i, i) for i in range(1, 100, 2)]


def test_closed_reader(daemon: Daemon, written: ResultPartitionID) -> None:
    loc = PartitionLocation(written, 0, daemon.data_address, daemon.daemon_id, None)
    reader = PartitionReader([loc], **FAST)
    reader.close()
    raises(lambda: list(reader), IllegalStateError, "closed")
    reader.close()  # closing again is allowed


# -- the PySpark integration (checked before Spark is touched) -------------------------------

SHUFFLE_CASES: list[tuple[str, dict[str, Any], str]] = [
    ("num_partitions-0", {"num_partitions": 0}, "num_partitions"),
    ("num_partitions-negative", {"num_partitions": -3}, "num_partitions"),
    ("num_partitions-str", {"num_partitions": "4"}, "num_partitions"),
    ("num_partitions-bool", {"num_partitions": True}, "num_partitions"),
    ("num_partitions-float", {"num_partitions": 2.0}, "num_partitions"),
    ("mode-unknown", {"mode": "streaming"}, "mode"),
    ("mode-list", {"mode": ["blocking"]}, "mode"),
    ("partition_func-int", {"partition_func": 3}, "partition_func"),
    ("codec-str", {"codec": "pickle"}, "codec"),
    ("secret_file-int", {"secret_file": 5}, "secret_file"),
    ("secret_file-empty", {"secret_file": ""}, "secret_file"),
    ("rdd-list", {"rdd": [(1, 2)]}, "RDD"),
    ("rdd-none", {"rdd": None}, "RDD"),
]


@pytest.mark.parametrize(
    ("changes", "words"), [c[1:] for c in SHUFFLE_CASES], ids=[c[0] for c in SHUFFLE_CASES]
)
def test_exchange_shuffle_arguments(changes: dict[str, Any], words: str) -> None:
    kwargs: dict[str, Any] = {"rdd": None, "num_partitions": 2, **changes}
    if "rdd" not in changes:
        kwargs["rdd"] = None  # arguments are checked before the RDD: it is never reached
    rdd, n = kwargs.pop("rdd"), kwargs.pop("num_partitions")
    raises(lambda: exchange_shuffle(rdd, n, **kwargs), UsageError, words)


@pytest.mark.parametrize(
    ("arg", "kwargs", "words"),
    [
        (5, {}, "exchange id"),
        (None, {}, "exchange id"),
        ("x-never-made", {}, "unknown exchange"),
        ("x-never-made", {"secret_file": 7}, "secret_file"),
    ],
    ids=["int", "none", "unknown-id", "secret_file-int"],
)
def test_release_exchange_arguments(arg: Any, kwargs: dict[str, Any], words: str) -> None:
    raises(lambda: release_exchange(arg, **kwargs), UsageError, words)


class _NotSpark:
    """Has no sparkContext and cannot parallelize."""


ENV_CASES: list[tuple[str, dict[str, Any], type[BaseException], str]] = [
    ("max_parallelism-0", {"max_parallelism": 0}, UsageError, "max_parallelism"),
    ("max_parallelism-negative", {"max_parallelism": -8}, UsageError, "max_parallelism"),
    ("max_parallelism-str", {"max_parallelism": "128"}, UsageError, "max_parallelism"),
    ("max_parallelism-huge", {"max_parallelism": 2**20}, UsageError, "max_parallelism"),
    ("job_id-empty", {"job_id": ""}, UsageError, "job_id"),
    ("job_id-int", {"job_id": 42}, UsageError, "job_id"),
    ("job_id-path", {"job_id": "../etc"}, UsageError, "job_id"),
    ("daemon-int", {"daemon": 3}, UsageError, "daemon"),
    ("checkpoint_dir-empty", {"checkpoint_dir": ""}, UsageError, "checkpoint_dir"),
    ("checkpoint_dir-int", {"checkpoint_dir": 1}, UsageError, "checkpoint_dir"),
    ("interval-negative", {"checkpoint_interval": -1}, ConfigError, "interval"),
    ("interval-str", {"checkpoint_interval": "often"}, ConfigError, "interval"),
    ("mode-unknown", {"mode": "twice"}, ConfigError, "mode"),
    ("tolerable-negative", {"tolerable_failed_checkpoints": -1}, ConfigError, "tolerable"),
    ("retained-0", {"retained_checkpoints": 0}, ConfigError, "retained"),
    ("spark-wrong", {"spark": _NotSpark()}, UsageError, "SparkSession"),
]


@pytest.mark.parametrize(
    ("changes", "error", "words"), [c[1:] for c in ENV_CASES], ids=[c[0] for c in ENV_CASES]
)
def test_stream_environment_arguments(
    changes: dict[str, Any], error: type[BaseException], words: str, tmp_path: Any
) -> None:
    kwargs: dict[str, Any] = {"spark": _NotSpark(), "checkpoint_dir": str(tmp_path), **changes}
    spark = kwargs.pop("spark")
    raises(lambda: StreamEnvironment(spark, **kwargs), error, words)


class _FakeContext:
    """Only ``parallelize`` exists: enough to construct an environment, never run one."""

    def parallelize(self, *_: Any) -> None:
        raise AssertionError("the job must not start")


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"restart_backoff": -1.0}, "restart_backoff"),
        ({"restart_backoff": "1s"}, "restart_backoff"),
        ({"restart_backoff": math.inf}, "restart_backoff"),
        ({"restart_attempts": -1}, "restart_attempts"),
        ({"restart_attempts": 1.5}, "restart_attempts"),
        ({"spark": None}, "SparkSession"),
    ],
    ids=[
        "backoff-negative",
        "backoff-str",
        "backoff-inf",
        "attempts-negative",
        "attempts-float",
        "no-spark",
    ],
)
def test_stream_execute_arguments(kwargs: dict[str, Any], words: str, tmp_path: Any) -> None:
    spark = kwargs.pop("spark", _FakeContext())  # None: builds a graph, never executes it
    env = StreamEnvironment(spark, checkpoint_dir=str(tmp_path))
    raises(lambda: env.execute(**kwargs), UsageError, words)


# -- daemon flags ------------------------------------------------------------------------------

#: At least one invalid value for every setting (as given on the command line).
BAD_FLAG_VALUES: dict[str, list[str]] = {
    "host": ["", "a b"],
    "http_host": ["", "a b"],
    "advertise_host": ["0.0.0.0", "::", "a b"],
    "data_port": ["-1", "65536", "http"],
    "http_port": ["-5", "99999"],
    "local_socket": ["/" + "s" * 200],
    "local_socket_group": ["spark users", "-1", "no-such-group-here"],
    "local_socket_mode": ["0666", "0640", "0060", "rw-rw----"],
    "network_memory": ["-1", "0", "64zb", "lots"],
    "segment_size": ["1000", "-32kb", "1k", "32mb"],
    "exclusive_buffers_per_channel": ["0", "-2", "two"],
    "floating_buffers_per_gate": ["-1", "x"],
    "producer_credit": ["0", "2000"],
    "high_watermark": ["-1", "0", "big"],
    "low_watermark": ["-1", "big"],
    "partition_request_backoff_initial": ["0", "-1s", "soon"],
    "partition_request_backoff_max": ["0", "-10s"],
    "buffer_timeout": ["-2", "-1s", "often"],
    "max_connections": ["0", "-1"],
    "max_unauthenticated_connections": ["0", "-1", "1024"],
    "max_unauthenticated_per_peer": ["0", "-1", "300"],
    "handshake_timeout": ["0", "-1"],
    "peer_timeout": ["-1", "-5s", "never"],
    "max_requests_per_connection": ["0", "-1", "many"],
    "max_partitions_per_app": ["-1", "lots"],
    "max_pinned_segments_per_app": ["-1", "1.5"],
    "max_readers_per_app": ["-1", "some"],
    "max_reader_memory_per_app": ["-1", "plenty"],
    "max_subpartitions_per_partition": ["0", "-1", "wide"],
    "spill_quota_per_app": ["-1", "half"],
    "spill_min_free": ["-1", "5%"],
    "spill_dir": ["/proc/sys"],
    "blocking_shuffle_type": ["tape", "", "mmap,file"],
    "secret_file": ["/nonexistent/secret"],
    "log_level": ["LOUD", "0"],
    "blocking_partition_ttl": ["-1", "forever"],
    "debloat_enabled": [],  # a BooleanOptionalAction: --debloat / --no-debloat take no value
    "debloat_target": ["0", "-1s"],
    "debloat_period": ["0", "x"],
    "debloat_samples": ["0", "-3"],
    "debloat_threshold_percent": ["-1", "101"],
    "debloat_min_buffer_size": ["0", "1mb"],
    "debloat_initial_buffer_size": ["0", "64mb"],
    "checkpoint_alignment_limit": ["0", "-5", "much"],
    "tls_cert_file": ["/nonexistent/cert.pem"],
    "tls_key_file": ["/nonexistent/key.pem"],
    "tls_ca_file": ["/nonexistent/ca.pem"],
    "tls_client_auth": [],  # --tls-client-auth / --no-tls-client-auth
    "require_tls_remote": [],  # --require-tls-remote / --no-require-tls-remote
    "shared_memory": [],  # --shared-memory / --no-shared-memory
    "shared_memory_per_app": ["0", "lots", "1kb"],
    "max_overdraft_buffers_per_partition": ["-1", "1025", "lots", "2.5"],
    "max_consumer_pins_per_process": ["-1", "many", "1.5"],
}

FLAG_CASES = [(name, value) for name, values in BAD_FLAG_VALUES.items() for value in values]


def test_every_setting_has_bad_values() -> None:
    names = [f.name for f in fields(DaemonConfig)]
    assert sorted(BAD_FLAG_VALUES) == sorted(names), "a setting without bad-value cases"


@pytest.mark.parametrize(("setting", "value"), FLAG_CASES, ids=[f"{s}={v}" for s, v in FLAG_CASES])
def test_bad_flag_value(setting: str, value: str, tmp_path: Any) -> None:
    argv = [f"{flag_name(setting)}={value}"]
    if setting != "spill_dir":
        argv.append(f"--spill-dir={tmp_path}")
    try:
        config = load_config(argv, env={})
    except ConfigError as e:
        assert e.setting in (setting, setting.replace("tls_key_file", "tls_cert_file")) or (
            setting.startswith("tls_")
        ), str(e)
        assert value in str(e) or setting in str(e), str(e)
        return
    # paths are checked when the daemon starts: creating its directories, reading files
    with pytest.raises(ConfigError) as info:
        config.validate_paths()
        config.load_secret()
        from server.tls import server_ssl_context

        server_ssl_context(config)
    assert info.value.setting in (setting, "tls_cert_file", "tls_key_file"), str(info.value)


@pytest.mark.parametrize(
    "argv",
    [
        ["--segment-size", "1000"],
        ["--network-memory", "-1"],
        ["--tls-cert-file", "/nonexistent/cert.pem", "--tls-key-file", "/nonexistent/k"],
        ["--secret-file", "/nonexistent/secret"],
        ["--log-level", "LOUD"],
        ["--no-such-flag", "1"],
        ["--data-port"],
    ],
    ids=["segment", "memory", "tls", "secret", "log", "unknown-flag", "missing-value"],
)
def test_daemon_cli_refuses_cleanly(
    run_daemon_cli: Callable[..., Any], argv: list[str], tmp_path: Any
) -> None:
    result = run_daemon_cli(["--spill-dir", str(tmp_path), "--http-port", "0", *argv])
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip(), "no message"
    assert result.stdout == ""  # never a ready line
