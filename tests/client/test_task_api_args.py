"""Bad arguments to the task-facing writer and reader raise UsageError before anything
is acquired: no connection to the daemon, no partition created, no segment taken.

The daemon here is a real listening socket that counts connection attempts (a writer or
reader that connected before checking its arguments would show up in its accept queue);
the autouse pool fixture fails a test whose reader took segments and kept them.
"""

from __future__ import annotations

import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from client.consumer import AsyncPartitionReader, PartitionLocation, PartitionReader
from client.producer import AsyncPartitionWriter, PartitionWriter
from exchange.errors import TransportError, UsageError
from exchange.partition.result_partition_id import ResultPartitionID
from exchange.serialization import MsgpackCodec
from server.config import DaemonConfig
from server.daemon import ExchangeDaemon

PID = ResultPartitionID("args", 0)


class Listener:
    """A listening socket that tells whether anyone connected."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        sock.listen(8)
        sock.setblocking(False)

    def connected(self) -> bool:
        try:
            conn, _ = self.sock.accept()
        except BlockingIOError:
            return False
        conn.close()
        return True


@pytest.fixture
def unix_listener() -> Iterator[tuple[str, Listener]]:
    d = tempfile.mkdtemp(prefix="xa-")
    path = str(Path(d) / "d.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    try:
        yield path, Listener(sock)
    finally:
        sock.close()
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def tcp_listener() -> Iterator[tuple[str, Listener]]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    try:
        yield f"127.0.0.1:{sock.getsockname()[1]}", Listener(sock)
    finally:
        sock.close()


BAD_WRITER_ARGS: list[tuple[str, dict[str, Any]]] = [
    ("partition_id", {"partition_id": "not-an-id"}),
    ("num_subpartitions", {"num_subpartitions": 0}),
    ("num_subpartitions", {"num_subpartitions": -3}),
    ("num_subpartitions", {"num_subpartitions": True}),
    ("num_subpartitions", {"num_subpartitions": 2.0}),
    ("blocking", {"blocking": "yes"}),
    ("daemon_socket", {"daemon_socket": 12}),
    ("daemon_socket", {"daemon_socket": b"/tmp/x.sock"}),
    ("secret", {"secret": "text, not bytes"}),
    ("codec", {"codec": "pickle"}),
    ("codec", {"codec": MsgpackCodec}),  # the class, not an instance
    ("selector", {"selector": lambda r: 0}),
    ("buffer_timeout", {"buffer_timeout": -5}),
]


def writer_args(path: str, override: dict[str, Any]) -> dict[str, Any]:
    args: dict[str, Any] = {"partition_id": PID, "num_subpartitions": 2, "daemon_socket": path}
    args.update(override)
    return args


@pytest.mark.parametrize(("name", "bad"), BAD_WRITER_ARGS)
def test_partition_writer_refuses_bad_arguments_before_connecting(
    unix_listener: tuple[str, Listener], name: str, bad: dict[str, Any]
) -> None:
    path, listener = unix_listener
    args = writer_args(path, bad)
    pid, n = args.pop("partition_id"), args.pop("num_subpartitions")
    with pytest.raises(UsageError, match=name):
        PartitionWriter(pid, n, **args)
    assert not listener.connected()


@pytest.mark.parametrize(
    ("name", "bad"),
    [("window", v) for v in (0, -1, 1.5, None)] + [("overdraft", v) for v in (-1, 1.5, None, True)],
)
def test_partition_writer_refuses_a_bad_window_or_overdraft_before_connecting(
    unix_listener: tuple[str, Listener], name: str, bad: Any
) -> None:
    path, listener = unix_listener
    with pytest.raises(UsageError, match=name):
        PartitionWriter(PID, 1, daemon_socket=path, **{name: bad})
    assert not listener.connected()


@pytest.mark.asyncio
@pytest.mark.parametrize(("name", "bad"), BAD_WRITER_ARGS)
async def test_async_partition_writer_refuses_bad_arguments_before_connecting(
    unix_listener: tuple[str, Listener], name: str, bad: dict[str, Any]
) -> None:
    path, listener = unix_listener
    args = writer_args(path, bad)
    pid, n = args.pop("partition_id"), args.pop("num_subpartitions")
    with pytest.raises(UsageError, match=name):
        await AsyncPartitionWriter.open(pid, n, **args)
    assert not listener.connected()


def test_good_writer_arguments_pass_the_checks_and_go_on_to_connect(tmp_path: Path) -> None:
    # the tests above can fail: good arguments get as far as connecting (no daemon here)
    with pytest.raises(TransportError, match="cannot reach"):
        PartitionWriter(PID, 2, daemon_socket=str(tmp_path / "no-daemon.sock"))


def location(address: str, **override: Any) -> PartitionLocation:
    fields: dict[str, Any] = {
        "partition_id": PID,
        "subpartition_index": 0,
        "data_address": address,
    }
    fields.update(override)
    return PartitionLocation(**fields)


BAD_READER_ARGS: list[tuple[str, Any, dict[str, Any]]] = [
    ("locations", "127.0.0.1:1", {}),
    ("PartitionLocation", [("p", 0, "127.0.0.1:1")], {}),
    ("partition_id", None, {"partition_id": "p"}),
    ("subpartition_index", None, {"subpartition_index": -1}),
    ("subpartition_index", None, {"subpartition_index": "0"}),
    ("data_address", None, {"data_address": ("127.0.0.1", 1)}),
    ("local_socket", None, {"local_socket": 3}),
    ("codec", None, {"codec": "msgpack"}),
    ("codec", None, {"codec": MsgpackCodec}),
    ("secret", None, {"secret": "s"}),
    ("segment_size", None, {"segment_size": -1}),
    ("segment_size", None, {"segment_size": 100}),
    ("segment_size", None, {"segment_size": 1 << 40}),
    ("num_exclusive", None, {"num_exclusive": 0}),
    ("num_floating", None, {"num_floating": -1}),
    ("num_floating", None, {"num_floating": 1.5}),
    ("backoff_initial", None, {"backoff_initial": 0}),
    ("backoff_max", None, {"backoff_initial": 1.0, "backoff_max": 0.5}),
    ("local_daemon_id", None, {"local_daemon_id": 7}),
]
_LOCATION_FIELDS = {"partition_id", "subpartition_index", "data_address", "local_socket"}


def reader_args(address: str, locations: Any, bad: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    loc_over = {k: v for k, v in bad.items() if k in _LOCATION_FIELDS}
    kwargs = {k: v for k, v in bad.items() if k not in _LOCATION_FIELDS}
    return (locations if locations is not None else [location(address, **loc_over)]), kwargs


@pytest.mark.parametrize(("name", "locations", "bad"), BAD_READER_ARGS)
def test_partition_reader_refuses_bad_arguments_before_taking_segments_or_connecting(
    tcp_listener: tuple[str, Listener], name: str, locations: Any, bad: dict[str, Any]
) -> None:
    address, listener = tcp_listener
    locs, kwargs = reader_args(address, locations, bad)
    with pytest.raises(UsageError, match=name):
        PartitionReader(locs, **kwargs)
    assert not listener.connected()


@pytest.mark.parametrize("window", [0, -2, "4"])
def test_partition_reader_refuses_a_bad_window(
    tcp_listener: tuple[str, Listener], window: Any
) -> None:
    address, listener = tcp_listener
    with pytest.raises(UsageError, match="window"):
        PartitionReader([location(address)], window=window)
    assert not listener.connected()


@pytest.mark.asyncio
@pytest.mark.parametrize(("name", "locations", "bad"), BAD_READER_ARGS)
async def test_async_partition_reader_refuses_bad_arguments(
    tcp_listener: tuple[str, Listener], name: str, locations: Any, bad: dict[str, Any]
) -> None:
    address, listener = tcp_listener
    locs, kwargs = reader_args(address, locations, bad)
    with pytest.raises(UsageError, match=name):
        await AsyncPartitionReader.open(locs, **kwargs)
    assert not listener.connected()


# -- with a real daemon: a refused emit leaves the writer usable -------------------------


@pytest.mark.asyncio
async def test_emit_to_a_subpartition_out_of_range_is_refused_and_the_writer_goes_on() -> None:
    spill = tempfile.mkdtemp(prefix="xa-")
    config = DaemonConfig(
        host="127.0.0.1",
        data_port=0,
        http_port=0,
        network_memory=64 * 4096,
        segment_size=4096,
        spill_dir=spill,
        log_level="WARNING",
    )
    d = ExchangeDaemon(config)
    await d.start()
    try:
        w = await AsyncPartitionWriter.open(PID, 2, daemon_socket=d.local_socket)
        for bad in (2, -1, 7, True, "0"):
            with pytest.raises(UsageError, match="out of range"):
                await w.emit_to(("r",), bad)  # type: ignore[arg-type]
        await w.emit_to(("kept",), 1)
        finished = await w.close()
        assert finished.buffers_written >= 1
        assert w.records_out == 1
    finally:
        whole = await d.shutdown(grace=5.0)
        shutil.rmtree(spill, ignore_errors=True)
    assert whole
