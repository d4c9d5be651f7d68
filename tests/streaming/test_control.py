"""The driver's control port before registration: what reaches it without the token
gets a few KiB and a bounded number of connections, never the driver's memory or the
registration of the real tasks (a real ControlServer on loopback, raw sockets as the
attacker, a real ControlClient as the task)."""

from __future__ import annotations

import secrets
import socket
import struct
import time

import pytest

from client.streaming.control import MAX_REGISTER_FRAME, ControlClient, ControlServer
from tests.kit.sockets import closed_by_peer

pytestmark = pytest.mark.timeout(60)


def connect(server: ControlServer) -> socket.socket:
    host, port = server.address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def test_a_large_frame_before_registration_is_refused_before_it_is_read() -> None:
    # two connections announcing 256 MiB took a driver from 33 to 234 MiB
    server = ControlServer(secrets.token_hex(8), 1, {"t0"})
    try:
        with connect(server) as s:
            s.sendall(struct.pack(">I", 200 * 1024 * 1024) + b"x" * 65536)
            assert closed_by_peer(s, 10)  # at the header: the body is never waited for
        with connect(server) as s:
            s.sendall(struct.pack(">I", MAX_REGISTER_FRAME + 1))
            assert closed_by_peer(s, 10)
        assert server.refused == 2 and server.inbox.empty()
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
        client = ControlClient.connect(
            server.address, {"token": token, "attempt": 1, "task": "t0", "daemon": "d"}
        )
        try:
            sender, msg = server.inbox.get(timeout=10)
            assert (sender, msg["type"]) == ("t0", "register")
        finally:
            client.close()
    finally:
        for s in silent:
            s.close()
        server.close()


def test_a_wrong_token_is_refused() -> None:
    server = ControlServer(secrets.token_hex(8), 1, {"t0"})
    try:
        client = ControlClient.connect(
            server.address, {"token": "guess", "attempt": 1, "task": "t0", "daemon": "d"}
        )
        try:
            assert client.inbox.get(timeout=10)["type"] == "refused"
        finally:
            client.close()
        assert server.refused == 1 and server.inbox.empty()
    finally:
        server.close()
