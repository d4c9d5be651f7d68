"""Shared memory between applications on one daemon (real daemon with a secret).

Each application's local producers write into an arena of their own: the descriptor a
task gets is its application's arena (another file than the other application's, mode
0600), bytes one application wrote never appear in the memory the other maps, and a
descriptor is handed out only for a one-time token the daemon sent on that very
connection (a guessed, reused or another connection's spent token gets nothing). A
consumer reading in place is offered only its own application's arena, and none where
its application has none; a blocking partition is read into its own application's arena.
"""

from __future__ import annotations

import os
import stat
from typing import Any

import pytest

from client.arena_handout import fetch_arena_fd
from client.consumer import PartitionLocation, PartitionReader
from client.local_connection import LocalConnection
from client.network import ConnectionManager
from client.producer import PartitionWriter
from client.runtime import get_runtime
from exchange.buffers.buffer import DataType
from exchange.errors import SharedMemoryUnavailableError
from exchange.partition.result_partition_id import ResultPartitionID
from exchange.protocol.handshake import format_app_credential
from exchange.protocol.local_messages import ARENA_SOCKET_SUFFIX, CreatePartition
from exchange.writer.record_writer import OutputBuffer

pytestmark = pytest.mark.timeout(120)

SECRET = b"the-daemons-secret"


def test_each_application_maps_only_its_own_arena(start_daemon: Any, secret_file: str) -> None:
    d = start_daemon("--secret-file", secret_file)
    cred_a = format_app_credential(SECRET, "app-a")
    cred_b = format_app_credential(SECRET, "app-b")
    pid = ResultPartitionID("iso", 0, 0)  # the same id: each application's own partition
    marker_a = b"APP-A-SECRET-BYTES" * 64
    hand_out = d.local_socket + ARENA_SOCKET_SUFFIX

    async def scenario() -> dict[str, Any]:
        conn_a = await LocalConnection.connect(d.local_socket, secret=cred_a)
        conn_b = await LocalConnection.connect(d.local_socket, secret=cred_b)
        try:
            await conn_a.create_partition(CreatePartition(pid, False, 1))
            await conn_b.create_partition(CreatePartition(pid, False, 1))
            assert conn_a.shared_memory and conn_b.shared_memory
            assert conn_a.arena_inode != conn_b.arena_inode
            await conn_a.push_buffers(
                [OutputBuffer(0, DataType.DATA_BUFFER, len(marker_a), [marker_a])]
            )
            assert conn_a.bytes_shared == len(marker_a)
            seen = {
                "a": marker_a in bytes(conn_a._arena_view or b""),
                "b": marker_a in bytes(conn_b._arena_view or b""),
            }
            # a second partition of app A: its token, spent once, is good for nothing after
            conn_a2 = await LocalConnection.connect(d.local_socket, secret=cred_a)
            try:
                await conn_a2.request(
                    CreatePartition(ResultPartitionID("iso", 1, 0), False, 1, True)
                )
                offer = conn_a2._offer
                assert offer is not None
                fd = await fetch_arena_fd(hand_out, offer.token, 10.0)
                try:
                    st = os.fstat(fd)
                    seen["a2_same_arena"] = st.st_ino == conn_a.arena_inode
                    seen["a2_mode"] = stat.S_IMODE(st.st_mode)
                finally:
                    os.close(fd)
                for token in (offer.token, os.urandom(len(offer.token))):
                    with pytest.raises(SharedMemoryUnavailableError, match="refused"):
                        await fetch_arena_fd(hand_out, token, 10.0)
            finally:
                await conn_a2.aclose()
            return seen
        finally:
            await conn_a.aclose()
            await conn_b.aclose()

    seen = get_runtime().run(scenario())
    assert seen == {"a": True, "b": False, "a2_same_arena": True, "a2_mode": 0o600}
    # the producers are gone: their partitions failed, every segment back, arenas dropped
    d.wait_stats(lambda s: s["local"]["shared_arenas"] == 0, timeout=30)
    d.wait_pool_whole()
    d.stop_clean()


def test_a_reader_maps_only_its_own_applications_arena(start_daemon: Any, secret_file: str) -> None:
    """Readers of two applications on one daemon: each connection to the local socket is
    offered (and maps) its own application's arena, never the other's; an application
    with no arena here gets none (it reads over the socket)."""
    d = start_daemon("--secret-file", secret_file, "--log-level", "INFO")
    cred = {app: format_app_credential(SECRET, app) for app in ("app-a", "app-b", "app-c")}
    pid = ResultPartitionID("iso-read", 0, 0)
    marker_a = b"APP-A-SECRET-BYTES" * 64
    address = "unix:" + d.local_socket

    async def scenario() -> dict[str, Any]:
        conn_a = await LocalConnection.connect(d.local_socket, secret=cred["app-a"])
        conn_b = await LocalConnection.connect(d.local_socket, secret=cred["app-b"])
        managers = {app: ConnectionManager(secret=cred[app]) for app in cred}
        try:
            await conn_a.create_partition(CreatePartition(pid, False, 1))
            await conn_b.create_partition(CreatePartition(pid, False, 1))
            await conn_a.push_buffers(
                [OutputBuffer(0, DataType.DATA_BUFFER, len(marker_a), [marker_a])]
            )
            readers = {
                app: await m.create_partition_request_client(address) for app, m in managers.items()
            }
            return {
                "a": readers["app-a"].arena_inode == conn_a.arena_inode,
                "b": readers["app-b"].arena_inode == conn_b.arena_inode,
                "a_is_not_b": conn_a.arena_inode != conn_b.arena_inode,
                "c": readers["app-c"].arena_inode,
                "marker_in_a": marker_a in bytes(readers["app-a"]._arena_view or b""),
                "marker_in_b": marker_a in bytes(readers["app-b"]._arena_view or b""),
            }
        finally:
            for m in managers.values():
                await m.close()
            await conn_a.aclose()
            await conn_b.aclose()

    seen = get_runtime().run(scenario())
    assert seen == {
        "a": True,
        "b": True,
        "a_is_not_b": True,
        "c": None,
        "marker_in_a": True,
        "marker_in_b": False,
    }
    d.wait_stats(lambda s: s["local"]["shared_arenas"] == 0, timeout=30)
    d.wait_pool_whole()
    d.stop_clean()
    assert "application 'app-c' has no shared arena here yet" in d.stderr


def test_a_blocking_partition_is_read_into_its_own_applications_arena(
    start_daemon: Any, secret_file: str
) -> None:
    """Two applications' blocking partitions of one id on one daemon, each read in place:
    the daemon reads each file into the arena of the application that wrote it (made for
    its readers), so the other application's mapping never holds its bytes."""
    d = start_daemon("--secret-file", secret_file)
    cred = {app: format_app_credential(SECRET, app) for app in ("app-a", "app-b")}
    pid = ResultPartitionID("iso-blocking", 0, 0)  # the same id: each application's own
    marker = {app: f"{app.upper()}-SECRET-BYTES".encode() * 64 for app in cred}
    records = {app: [(i, marker[app]) for i in range(300)] for app in cred}
    for app in cred:
        with PartitionWriter(
            pid, 1, blocking=True, daemon_socket=d.local_socket, secret=cred[app]
        ) as w:
            w.emit_all(records[app])
    d.wait_stats(lambda s: s["local"]["shared_arenas"] == 0)  # the writers' arenas went
    address = "unix:" + d.local_socket
    managers = {app: ConnectionManager(secret=cred[app]) for app in cred}
    runtime = get_runtime()

    async def map_arenas() -> dict[str, Any]:  # each application's readers' arena, mapped
        return {
            app: await m.create_partition_request_client(address) for app, m in managers.items()
        }

    try:
        mapped = runtime.run(map_arenas())
        inodes = {app: h.arena_inode for app, h in mapped.items()}
        assert None not in inodes.values() and inodes["app-a"] != inodes["app-b"]
        loc = PartitionLocation(pid, 0, d.data_address, d.daemon_id, d.local_socket)
        for app in cred:
            with PartitionReader([loc], secret=cred[app], local_daemon_id=d.daemon_id) as r:
                assert r.read_all() == records[app]
        local = d.wait_stats(lambda s: s["local"]["connections"] == 2)["local"]
        assert local["consumer_bytes_shared_memory"] == local["bytes_received"]
        seen = {
            (app, other): marker[other] in bytes(h._arena_view or b"")
            for app, h in mapped.items()
            for other in cred
        }
        assert seen == {
            ("app-a", "app-a"): True,
            ("app-a", "app-b"): False,
            ("app-b", "app-a"): False,
            ("app-b", "app-b"): True,
        }
    finally:
        for m in managers.values():
            runtime.run(m.close())
    d.wait_stats(lambda s: s["local"]["shared_arenas"] == 0, timeout=30)
    d.wait_pool_whole()
    d.stop_clean()
