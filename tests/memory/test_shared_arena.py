"""Shared arenas (``exchange.memory.shared_arena``) and the daemon's choice of path
(``server.shared_arenas``): memfd, else a file under /dev/shm unlinked at once, mode
0600 either way; a /dev/shm too small (a real 2 MiB tmpfs) refuses with the reason, and
the daemon then says why in the log and leaves producers on the socket."""

from __future__ import annotations

import logging
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from exchange.errors import SharedMemoryUnavailableError, UsageError
from exchange.memory.network_buffer_pool import NetworkBufferPool
from exchange.memory.shared_arena import create_arena, map_arena
from server.config import DaemonConfig
from server.shared_arenas import SharedArenas

KIB = 1024


def test_a_memfd_arena_is_private_and_shared_between_mappings() -> None:
    fd, mm = create_arena(64 * KIB, "test")
    try:
        st = os.fstat(fd)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == 64 * KIB
        assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:test")
        other = map_arena(fd, 64 * KIB)  # what a task does with the descriptor it got
        mm[100:105] = b"hello"
        assert other[100:105] == b"hello"
        other.close()
    finally:
        mm.close()
        os.close(fd)


def test_without_memfd_the_arena_is_an_unlinked_file_under_shm(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delattr(os, "memfd_create")
    fd, mm = create_arena(64 * KIB, "test", shm_dir=str(tmp_path))
    try:
        assert list(tmp_path.iterdir()) == []  # unlinked at once: only descriptors hold it
        assert stat.S_IMODE(os.fstat(fd).st_mode) == 0o600
        mm[:4] = b"data"
        assert map_arena(fd, 64 * KIB)[:4] == b"data"
    finally:
        mm.close()
        os.close(fd)


@pytest.fixture
def small_shm(tmp_path: Path) -> Iterator[Path]:
    """A real 2 MiB tmpfs (root only)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "shm"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_a_shm_too_small_refuses_with_the_reason(
    monkeypatch: pytest.MonkeyPatch, small_shm: Path
) -> None:
    monkeypatch.delattr(os, "memfd_create")
    with pytest.raises(SharedMemoryUnavailableError, match="bytes free, fewer than"):
        create_arena(8 * 1024 * KIB, "test", shm_dir=str(small_shm))
    assert list(small_shm.iterdir()) == []


def test_an_arena_smaller_than_announced_is_not_mapped(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "short", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, 4096)
        with pytest.raises(SharedMemoryUnavailableError, match="smaller than 8192"):
            map_arena(fd, 8192)
    finally:
        os.close(fd)


def test_the_daemon_says_why_producers_stay_on_the_socket(
    monkeypatch: pytest.MonkeyPatch, small_shm: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="exchange.server.shared_memory")
    off = SharedArenas(DaemonConfig(shared_memory=False))
    assert off.unavailable == "shared_memory = off" and off.pool_for("app") is None
    assert "shared_memory = off" in caplog.text
    # a platform without memfd whose /dev/shm is smaller than an arena: the arena fails
    monkeypatch.delattr(os, "memfd_create")
    arenas = SharedArenas(
        DaemonConfig(network_memory="16mb", shared_memory_per_app="4mb"), shm_dir=str(small_shm)
    )
    assert arenas.unavailable is None  # one segment fits: the probe passes
    caplog.clear()
    assert arenas.pool_for("app-a") is None
    assert "fewer than the arena's 4194304" in caplog.text and "over the socket" in caplog.text
    assert len(arenas) == 0 and arenas.close()


def test_arenas_are_per_application_bounded_and_dropped_when_idle() -> None:
    arenas = SharedArenas(DaemonConfig(network_memory="2mb", shared_memory_per_app="1mb"))
    a = arenas.pool_for("a")
    assert a is not None
    pool_a = a.create_buffer_pool(1, 2)  # what create_partition does right away
    b = arenas.pool_for("b")
    assert b is not None and b is not a and b.arena_fd != a.arena_fd
    pool_b = b.create_buffer_pool(1, 2)
    assert arenas.pool_for("a") is a
    assert arenas.pool_for("c") is None  # the budget (network_memory) is used up
    pool_b.destroy()
    arenas.release_idle()
    assert arenas.pools() == [a]  # b was idle; a has a partition's pool
    pool_a.destroy()
    arenas.release_idle()
    assert len(arenas) == 0 and a.is_destroyed and a.arena_fd is None
    assert arenas.pool_for("c") is not None
    assert arenas.close()


def test_a_shared_pool_hands_out_segments_of_its_arena() -> None:
    pool = NetworkBufferPool(4, 4 * KIB, shared=True)
    try:
        assert pool.arena_fd is not None
        mapped = map_arena(pool.arena_fd, pool.arena_size)
        seg = pool.request_memory_segment()
        assert seg is not None
        mapped[seg.index * 4 * KIB : seg.index * 4 * KIB + 3] = b"abc"  # the task's write
        assert bytes(seg.view()[:3]) == b"abc"  # seen in place by the daemon
        pool.recycle(seg)
        mapped.close()
    finally:
        pool.destroy()
    with pytest.raises(UsageError):
        create_arena(0, "x")


@pytest.mark.parametrize("end", ["redeemed", "revoked"])
def test_an_arena_whose_token_is_out_stays_until_the_token_is_used_or_revoked(end: str) -> None:
    """A partition released (by its consumer, by a failover) before its producer task
    fetched the arena leaves the arena whole: it must stay while the token is out, so the
    task maps it and then meets the partition's own typed error, not a refused token
    (seen under load in a full run: SharedMemoryUnavailableError for a released
    partition)."""
    arenas = SharedArenas(DaemonConfig(network_memory="2mb", shared_memory_per_app="1mb"))
    a = arenas.pool_for("a")
    assert a is not None
    pool_a = a.create_buffer_pool(1, 2)
    token = arenas.issue_token(a)
    pool_a.destroy()  # released before the task came for the descriptor
    arenas.release_idle()
    assert arenas.pools() == [a] and a.arena_fd is not None
    if end == "redeemed":
        assert arenas.redeem(token) is a
        assert arenas.redeem(token) is None  # once
    else:
        arenas.revoke(token)
        assert arenas.redeem(token) is None
    arenas.release_idle()
    assert len(arenas) == 0 and a.is_destroyed
    assert arenas.close()
