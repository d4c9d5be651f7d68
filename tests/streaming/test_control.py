"""The driver's control port: before registration what reaches it without the token gets
a few KiB and a bounded number of connections, never the driver's memory or the
registration of the real tasks; bad frames end a connection with a typed error (a real
ControlServer on loopback, raw sockets as the attacker, a real ControlClient as the
task), also over IPv6."""

from __future__ import annotations

import secrets
import socket
import struct
import time

import pytest

from client.streaming.control import (
    MAX_REGISTER_FRAME,
    ControlClient,
    ControlLost,
    ControlServer,
)
from exchange.addresses import parse_address
from exchange.protocol.codec import FRAME_HEADER_SIZE, MAGIC, encode
from exchange.protocol.driver_messages import (
    CheckpointTrigger,
    RegisterTask,
    RegistrationRefused,
    SourceExhausted,
    TaskDaemon,
)
from tests.kit.sockets import closed_by_peer, has_ipv6_loopback

pytestmark = pytest.mark.timeout(60)

DAEMON = TaskDaemon("d", "127.0.0.1:1", "/tmp/d.sock")


def connect(server: ControlServer) -> socket.socket:
    return socket.create_connection(parse_address(server.address), timeout=10)


def registration(token: str, task: str = "t0", attempt: int = 1) -> RegisterTask:
    return RegisterTask(token, attempt, task, DAEMON)


def frame(msg_id: int, body: bytes, length: int | None = None) -> bytes:
    size = FRAME_HEADER_SIZE + len(body) if length is None else length
    return struct.pack(">IIB", size, MAGIC, msg_id) + body


def test_a_large_frame_before_registration_is_refused_before_it_is_read() -> None:
    # two connections announcing 256 MiB took a driver from 33 to 234 MiB
    server = ControlServer(secrets.token_hex(8), 1, {"t0"})
    try:
        with connect(server) as s:
            s.sendall(frame(136, b"x" * 65536, 200 * 1024 * 1024))
            assert closed_by_peer(s, 10)  # at the header: the body is never waited for
        with connect(server) as s:
            s.sendall(frame(136, b"", MAX_REGISTER_FRAME + 1))
            assert closed_by_peer(s, 10)
        assert server.refused == 2 and server.inbox.empty()
    finally:
        server.close()


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(struct.pack(">I", 100) + b"junk\x88", id="bad-magic"),
        pytest.param(frame(11, b"\x00" * 22), id="data-port-id"),  # a BufferResponse
        pytest.param(frame(146, b"\xc1"), id="malformed-body"),  # msgpack's never-used byte
        pytest.param(frame(146, b"\x81\xa1x\x01"), id="unknown-key"),
        pytest.param(frame(130, b"\x81\xa9locations\x90"), id="rendezvous-id"),  # Met
    ],
)
def test_a_bad_first_frame_is_refused_typed_and_counted(data: bytes) -> None:
    server = ControlServer(secrets.token_hex(8), 1, {"t0"})
    try:
        with connect(server) as s:
            s.sendall(data)
            assert closed_by_peer(s, 10)
        assert server.refused == 1 and server.inbox.empty()
    finally:
        server.close()


def test_a_registered_task_sending_a_bad_frame_is_lost_with_the_typed_error() -> None:
    token = secrets.token_hex(8)
    server = ControlServer(token, 1, {"t0"})
    try:
        with connect(server) as s:
            s.sendall(b"".join(encode(registration(token))))
            assert server.inbox.get(timeout=10) == ("t0", registration(token))
            s.sendall(b"".join(encode(SourceExhausted())))
            assert server.inbox.get(timeout=10) == ("t0", SourceExhausted())
            s.sendall(frame(146, b"\x81\xa4oops\xc3"))  # SourceExhausted has no field
            task, lost = server.inbox.get(timeout=10)
            assert task == "t0" and isinstance(lost, ControlLost)
            assert lost.error.startswith("ProtocolError: control body must be a map with keys")
            assert closed_by_peer(s, 10)
        assert server.wait_disconnected(10)
    finally:
        server.close()


def test_silent_connections_cannot_keep_a_task_from_registering() -> None:
    token = secrets.token_hex(8)
    server = ControlServer(token, 1, {"t0"}, max_unregistered=4)
    silent = [connect(server) for _ in range(10)]
    try:
        deadline = time.monotonic() + 10
        while sum(closed_by_peer(s, 0.01) for s in silent[:6]) < 6:  # the oldest made room
            assert time.monotonic() < deadline
        client = ControlClient.connect(server.address, registration(token))
        try:
            sender, msg = server.inbox.get(timeout=10)
            assert (sender, msg) == ("t0", registration(token))
        finally:
            client.close()
    finally:
        for s in silent:
            s.close()
        server.close()


def test_a_wrong_token_is_refused() -> None:
    server = ControlServer(secrets.token_hex(8), 1, {"t0"})
    try:
        client = ControlClient.connect(server.address, registration("guess"))
        try:
            assert client.inbox.get(timeout=10) == RegistrationRefused("unknown or stale task")
            assert isinstance(client.inbox.get(timeout=10), ControlLost)  # then it closes
        finally:
            client.close()
        assert server.refused == 1 and server.inbox.empty()
    finally:
        server.close()


@pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 loopback (::1) on this machine")
def test_a_task_registers_and_is_driven_over_ipv6() -> None:
    token = secrets.token_hex(8)
    server = ControlServer(token, 1, {"t0"}, host="::1")
    try:
        assert server.address == f"[::1]:{server.port}"
        client = ControlClient.connect(server.address, registration(token))
        try:
            assert server.inbox.get(timeout=10) == ("t0", registration(token))
            server.send("t0", CheckpointTrigger(3, 4, exactly_once=False))
            assert client.inbox.get(timeout=10) == CheckpointTrigger(3, 4, exactly_once=False)
            client.send(SourceExhausted())
            assert server.inbox.get(timeout=10) == ("t0", SourceExhausted())
        finally:
            client.close()
        assert server.wait_disconnected(10)
    finally:
        server.close()
