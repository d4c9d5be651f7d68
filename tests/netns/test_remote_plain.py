"""``require_tls_remote``: a daemon without TLS refuses plain connections from peers off
loopback. Without TLS nothing protects a stream after the handshake (an on-path peer
could inject frames a consumer unpickles), so a daemon that must not be reached in the
clear from the network says so at the door. The peer off loopback is another network
namespace (``two_hosts``); loopback peers are still served."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from client.consumer import PartitionLocation, PartitionReader
from client.producer import PartitionWriter
from exchange.partition.result_partition_id import ResultPartitionID
from exchange.protocol.codec import InPlaceFrameDecoder, encode
from exchange.protocol.messages import (
    PROTOCOL_VERSION,
    ClientHello,
    ErrorCode,
    ErrorResponse,
    Message,
    ServerHello,
)

pytestmark = pytest.mark.timeout(180)

Host = Any
Daemon = Any
SECRET = b"the-daemons-secret-of-this-test"


def hello(address: str) -> list[Message]:
    """What the daemon at ``address`` answers a ClientHello with (until it closes, or
    its ServerHello)."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=20) as s:
        s.sendall(b"".join(encode(ClientHello(PROTOCOL_VERSION, os.urandom(16)))))
        decoder = InPlaceFrameDecoder()
        out: list[Message] = []
        while not any(isinstance(m, ServerHello) for m in out):
            data = s.recv(65536)
            if not data:
                break
            out.extend(decoder.feed(data))
        return out


def test_plain_peers_off_loopback_are_refused(
    two_hosts: tuple[Host, Host], start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    a, b = two_hosts
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    strict = a.run(start_daemon, "--host", a.address, "--secret-file", str(secret),
                   "--require-tls-remote")  # fmt: skip
    lenient = a.run(start_daemon, "--host", a.address, "--secret-file", str(secret))
    [err] = b.run(hello, strict.data_address)
    assert isinstance(err, ErrorResponse) and err.code is ErrorCode.ACCESS_DENIED
    assert "require_tls_remote" in err.message
    assert isinstance(b.run(hello, lenient.data_address)[0], ServerHello)  # the control
    st = a.run(strict.wait_stats, lambda s: s["data_port"]["connections"] == 0)
    assert st["data_port"]["rejected_connections"] == 1


def test_loopback_peers_are_served(start_daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    d = start_daemon("--secret-file", str(secret), "--require-tls-remote")
    pid = ResultPartitionID("loop", 0, 0)
    records = [(i, b"x" * 32) for i in range(300)]
    with PartitionWriter(
        pid, 1, blocking=True, daemon_socket=d.local_socket, secret=SECRET, buffer_timeout=-1
    ) as w:
        w.emit_all(records, partition_func=lambda k: 0)
    loc = PartitionLocation(pid, 0, d.data_address, d.daemon_id, None)
    with PartitionReader([loc], secret=SECRET) as reader:
        assert list(reader) == records
