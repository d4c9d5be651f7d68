"""Attacks on the spill directory and the daemon's files, against real daemons.

Each test reproduces what another local user (``nobody``, uid 65534) or a full disk (a
2 MiB tmpfs) did to a daemon before, and checks that it is refused or survived with
nothing lost: pools whole, no file or descriptor left behind (docs/security.md, Spill
files and manifests).
"""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from client.consumer import PartitionLocation, PartitionReader
from client.local_connection import release_dataset
from client.producer import PartitionWriter
from client.runtime import get_runtime
from exchange.errors import (
    CorruptRecordError,
    IntegrityError,
    LimitExceededError,
    PartitionReleasedError,
    SpillError,
)
from exchange.partition.partition_manifest import (
    decode_manifest,
    encode_manifest,
    manifest_key,
    read_manifest,
)
from exchange.partition.result_partition_id import ResultPartitionID

pytestmark = pytest.mark.timeout(180)

Daemon = Any
NOBODY = 65534
FAST: dict[str, Any] = {"backoff_initial": 0.01, "backoff_max": 0.04}
PARTS = "partitions"


def _root_with_nobody() -> bool:
    if os.geteuid() != 0:
        return False
    try:
        pwd.getpwuid(NOBODY)
    except KeyError:
        return False
    return True


needs_root = pytest.mark.skipif(
    not _root_with_nobody(), reason="needs root and the local user nobody (uid 65534)"
)


def as_nobody(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` (Python, ``sys.argv[1:]`` = args) as uid/gid 65534 in a child."""
    prelude = "import os, sys; os.setgroups([]); os.setgid(65534); os.setuid(65534)\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + code, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def records(n: int, size: int = 100) -> list[tuple[int, bytes]]:
    return [(i, bytes([i % 251]) * size) for i in range(n)]


def write(
    d: Daemon,
    pid: ResultPartitionID,
    recs: list[Any],
    n: int = 1,
    secret: bytes | None = None,
) -> None:
    with PartitionWriter(
        pid, n, blocking=True, daemon_socket=d.local_socket, secret=secret, buffer_timeout=-1
    ) as w:
        w.emit_all(recs, partition_func=lambda k: k % n)


def read(d: Daemon, pid: ResultPartitionID, sub: int = 0, secret: bytes | None = None) -> Any:
    loc = PartitionLocation(pid, sub, d.data_address, d.daemon_id, None)
    with PartitionReader([loc], secret=secret, **FAST) as reader:
        return list(reader)


def release(d: Daemon, dataset: str, secret: bytes | None = None) -> int:
    done = release_dataset(d.local_socket, dataset, secret=secret)
    return get_runtime().run(done)  # type: ignore[no-any-return]


def daemon_files(d: Daemon) -> list[str]:
    return sorted(p.name for p in (Path(d.spill_dir) / PARTS).iterdir() if p.name != ".lock")


def open_fds(d: Daemon) -> int:
    return len(os.listdir(f"/proc/{d.proc.pid}/fd"))


def wait_fds(d: Daemon, at_most: int, timeout: float = 20.0) -> None:
    """Poll until the daemon holds at most ``at_most`` descriptors (connections of a
    failed producer close after a grace period)."""
    deadline = time.monotonic() + timeout
    while (n := open_fds(d)) > at_most:
        assert time.monotonic() < deadline, f"{n} descriptors open, expected <= {at_most}"
        time.sleep(0.05)


def wait_stderr(d: Daemon, text: str, timeout: float = 20.0) -> str:
    """The daemon's stderr once it holds ``text`` (read on a thread: poll for it)."""
    deadline = time.monotonic() + timeout
    while text not in d.stderr:
        assert time.monotonic() < deadline, f"{text!r} not logged: {d.stderr}"
        time.sleep(0.05)
    return str(d.stderr)


def refused(args: list[str], env: dict[str, str] | None = None) -> str:
    """Start a daemon expected to refuse; its stderr."""
    helpers: Any = __import__("exchange_tests_daemon_helpers")
    base = ["--host", "127.0.0.1", "--data-port", "0", "--http-port", "0"]
    proc = subprocess.run(
        [sys.executable, "-m", "server", *base, *args],
        capture_output=True,
        text=True,
        cwd=helpers.ROOT,
        env=helpers.child_env(**(env or {})),
        timeout=60,
    )
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "ready" not in proc.stdout
    return proc.stderr


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A directory like /tmp (1777): every local user may create entries in it."""
    path = Path(tempfile.mkdtemp(prefix="xs-tmp-"))
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


# -- the spill directory ---------------------------------------------------------------------


@needs_root
def test_default_spill_dir_precreated_by_another_user_is_refused(shared_tmp: Path) -> None:
    # the attack: nobody creates the daemon's default directory first, world-writable, to
    # read spilled records and swap spill files under the daemon
    squat = shared_tmp / f"exchange-{os.geteuid()}"
    made = as_nobody(
        "import os, sys; os.mkdir(sys.argv[1], 0o777); os.chmod(sys.argv[1], 0o777)", str(squat)
    )
    assert made.returncode == 0, made.stderr
    err = refused([], env={"TMPDIR": str(shared_tmp)})
    assert "spill_dir" in err and str(squat) in err and f"uid {NOBODY}" in err
    assert "choose another --spill-dir" in err  # says how to fix it
    assert list(squat.iterdir()) == []  # nothing of the daemon went into it


def test_group_or_world_writable_spill_dir_is_refused(tmp_path: Path) -> None:
    spill = tmp_path / "spill"
    spill.mkdir()
    spill.chmod(0o777)
    err = refused(["--spill-dir", str(spill)])
    assert "writable by other users" in err and f"chmod go-w {spill}" in err
    spill.chmod(0o1777)  # sticky, like /tmp: still refused
    assert "writable by other users" in refused(["--spill-dir", str(spill)])
    spill.chmod(0o775)
    assert "writable by other users" in refused(["--spill-dir", str(spill)])
    assert list(spill.iterdir()) == []


@needs_root
def test_partitions_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    spill = tmp_path / "spill"
    (spill / PARTS).mkdir(parents=True, mode=0o700)
    os.chown(spill / PARTS, NOBODY, NOBODY)
    err = refused(["--spill-dir", str(spill)])
    assert f"belongs to uid {NOBODY}" in err
    os.chown(spill / PARTS, 0, 0)
    (spill / PARTS).chmod(0o755)
    assert "chmod 700" in refused(["--spill-dir", str(spill)])


@needs_root
def test_spill_files_are_private_to_the_daemons_user(start_daemon: Callable[..., Daemon]) -> None:
    old = os.umask(0)  # whatever umask the daemon was started with
    try:
        d = start_daemon()
    finally:
        os.umask(old)
    pid = ResultPartitionID("private", 0, 0)
    recs = records(3000)
    write(d, pid, recs, n=2)
    parts = Path(d.spill_dir) / PARTS
    assert stat.S_IMODE(parts.stat().st_mode) == 0o700
    files = daemon_files(d)
    assert len(files) == 3  # two spill files and the manifest
    for name in files:
        st = (parts / name).stat()
        assert stat.S_IMODE(st.st_mode) == 0o600, name
        assert st.st_uid == os.geteuid()
    # the attack: another local user reads records out of the spill files
    probe = as_nobody(
        "import os, sys\n"
        "for p in sys.argv[1:]:\n"
        "    try:\n"
        "        open(p, 'rb').read(1); print('READ', p)\n"
        "    except PermissionError:\n"
        "        print('DENIED', p)\n",
        *[str(parts / name) for name in files],
    )
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split().count("DENIED") == 3, probe.stdout
    assert read(d, pid, 0) + read(d, pid, 1) == sorted(recs, key=lambda r: r[0] % 2)
    assert release(d, "private") == 1
    d.wait_stats(lambda s: s["partitions"]["count"] == 0)
    assert daemon_files(d) == []


def test_a_second_daemon_on_the_same_spill_dir_refuses_to_start(
    start_daemon: Callable[..., Daemon],
) -> None:
    d = start_daemon()
    pid = ResultPartitionID("first", 0, 0)
    recs = records(2000)
    write(d, pid, recs)
    before = daemon_files(d)
    err = refused(["--spill-dir", d.spill_dir, "--local-socket", d.spill_dir + "/other.sock"])
    assert f"is in use by daemon pid {d.proc.pid}" in err and "its own --spill-dir" in err
    assert daemon_files(d) == before  # nothing of the first daemon's was touched
    assert read(d, pid) == recs
    assert release(d, "first") == 1


def test_files_outside_its_own_directory_are_never_touched(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    spill = tmp_path / "spill"
    spill.mkdir()
    # left by a daemon of an earlier version (or anyone): not the daemon's to serve or delete
    for name in ("old-0-0-0123abcd.manifest", "old-0-0-0123abcd.0.bin", "x.manifest.tmp"):
        (spill / name).write_bytes(b"not the daemon's")
    d = start_daemon(spill_dir=str(spill))
    assert d.info["recovered"] == {"restored": 0, "refused": 0, "failed": 0, "expired": 0}
    assert "old-0-0-0123abcd.manifest" in wait_stderr(d, "earlier version")
    d.stop_clean()
    assert sorted(p.name for p in spill.iterdir() if p.is_file()) == [
        "old-0-0-0123abcd.0.bin",
        "old-0-0-0123abcd.manifest",
        "x.manifest.tmp",
    ]


@pytest.mark.parametrize("storage", ["file", "mmap"])
def test_a_spill_file_swapped_under_a_finished_partition_is_detected(
    start_daemon: Callable[..., Daemon], storage: str
) -> None:
    d = start_daemon(f"--blocking-shuffle-type={storage}")
    pid = ResultPartitionID("swap", 0, 0)
    recs = records(2000)
    write(d, pid, recs)
    assert read(d, pid) == recs
    (victim,) = (Path(d.spill_dir) / PARTS).glob("swap-*.0.bin")
    forged = victim.with_name("forged")
    forged.write_bytes(b"\x00" * victim.stat().st_size)  # same size, other records
    os.replace(forged, victim)
    if storage == "file":  # each reader opens the file, checking its inode
        with pytest.raises(PartitionReleasedError, match="was replaced after it was written"):
            read(d, pid)
    else:  # mapped at finish, after the same check: the forged file is never read
        assert read(d, pid) == recs
    assert release(d, "swap") == 1
    d.wait_pool_whole()
    # the swapped file is not the daemon's: it is left alone, the manifest is gone
    assert daemon_files(d) == [victim.name]
    victim.unlink()


# -- manifests -------------------------------------------------------------------------------


def test_a_forged_manifest_is_refused_when_the_daemon_has_a_secret(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(b"a-secret-of-the-daemons")
    secret_file.chmod(0o600)
    secret = b"a-secret-of-the-daemons"
    spill = tmp_path / "spill"
    spill.mkdir(mode=0o700)
    flags = ("--secret-file", str(secret_file))
    d1 = start_daemon(*flags, spill_dir=str(spill))
    good, bad = ResultPartitionID("good", 0, 0), ResultPartitionID("forged", 0, 0)
    write(d1, good, records(100), secret=secret)
    write(d1, bad, records(100), secret=secret)
    d1.stop_clean()  # keeps finished partitions for the next daemon
    (manifest,) = (spill / PARTS).glob("forged-*.manifest")
    key = manifest_key(secret)
    real = read_manifest(manifest, key)  # signed with the daemon's key
    with pytest.raises(CorruptRecordError):
        read_manifest(manifest)  # it carries no CRC: only the key checks it
    # the attack: rewrite it with a body of one's choosing and a valid CRC (no key)
    manifest.write_bytes(encode_manifest(real))
    with pytest.raises(IntegrityError, match="no HMAC"):
        decode_manifest(manifest.read_bytes(), manifest, key)
    # or with an HMAC under another key
    other = encode_manifest(real, manifest_key(b"a-guessed-secret-value"))
    with pytest.raises(IntegrityError, match="does not match"):
        decode_manifest(other, manifest, key)
    d2 = start_daemon(*flags, spill_dir=str(spill))
    assert d2.info["recovered"] == {"restored": 1, "refused": 1, "failed": 0, "expired": 0}
    wait_stderr(d2, "no HMAC")  # logged: the forged manifest and its files go
    assert read(d2, good, secret=secret) == records(100)
    assert not list((spill / PARTS).glob("forged-*"))  # refused and deleted
    assert release(d2, "good", secret) == 1


# -- a full disk -----------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs, unmounted at teardown."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "disk"
    mnt.mkdir(mode=0o700)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_disk_fails_the_producer_with_a_spill_error_and_leaks_nothing(
    small_disk: Path, start_daemon: Callable[..., Daemon]
) -> None:
    # no quota, no floor: the producer runs into ENOSPC itself
    d = start_daemon(
        "--spill-quota-per-app=0", "--spill-min-free=0", spill_dir=str(small_disk / "spill")
    )
    base_fds = open_fds(d)
    with pytest.raises(SpillError) as info:
        write(d, ResultPartitionID("big", 0, 0), records(40_000, 100), n=4)  # ~4 MB
    text = str(info.value)
    assert "is full" in text and str(small_disk / "spill" / PARTS) in text
    st = d.wait_stats(lambda s: s["partitions"]["count"] == 0 and s["network"]["local_pools"] == 0)
    assert st["network"]["available_segments"] == st["network"]["total_segments"]
    assert daemon_files(d) == []  # its files are deleted: the disk is free again
    assert st["spill"]["bytes"] == 0
    wait_fds(d, base_fds)
    with pytest.raises(PartitionReleasedError, match="is full"):
        read(d, ResultPartitionID("big", 0, 0))
    # and later blocking partitions work
    small = ResultPartitionID("small", 0, 0)
    write(d, small, records(1000))
    assert read(d, small) == records(1000)
    assert release(d, "small") == 1


def test_the_spill_quota_refuses_one_application_before_the_disk_is_full(
    small_disk: Path, start_daemon: Callable[..., Daemon]
) -> None:
    d = start_daemon(
        "--spill-quota-per-app=600kb", "--spill-min-free=0", spill_dir=str(small_disk / "spill")
    )
    with pytest.raises(SpillError, match="spill_quota_per_app=614400") as info:
        write(d, ResultPartitionID("q", 0, 0), records(10_000, 100))  # ~1 MB > 600 KiB
    assert str(small_disk / "spill" / PARTS) in str(info.value)
    d.wait_stats(lambda s: s["partitions"]["count"] == 0)
    assert daemon_files(d) == []  # the refused partition's bytes count no more
    assert d.stats()["spill"] == {
        "bytes": 0,
        "quota_per_app": 600 * 1024,
        "min_free": 0,
        "readers": 0,
        "reader_memory_bytes": 0,
    }
    ok = ResultPartitionID("q", 1, 0)
    write(d, ok, records(4_000, 100))  # ~430 KB: under the quota
    assert read(d, ok) == records(4_000, 100)
    assert release(d, "q") == 1
    st = d.wait_stats(lambda s: s["partitions"]["count"] == 0)
    assert st["network"]["available_segments"] == st["network"]["total_segments"]
    assert daemon_files(d) == []


def test_the_free_space_floor_refuses_new_spills_before_the_disk_is_full(
    small_disk: Path, start_daemon: Callable[..., Daemon]
) -> None:
    d = start_daemon(
        "--spill-quota-per-app=0", "--spill-min-free=1mb", spill_dir=str(small_disk / "spill")
    )
    written = []
    with pytest.raises(SpillError, match="spill_min_free") as info:
        for i in range(10):  # 10 x 430 KB would not fit on the 2 MiB disk
            pid = ResultPartitionID("f", i, 0)
            write(d, pid, records(4_000, 100))
            written.append(pid)
    assert str(small_disk / "spill" / PARTS) in str(info.value)
    assert 1 <= len(written) <= 3
    st = os.statvfs(small_disk)
    assert st.f_bavail * st.f_frsize >= 512 * 1024  # refused well before the disk was full
    for pid in written:  # what was written before stays readable
        assert read(d, pid) == records(4_000, 100)
    assert release(d, "f") == len(written)
    st2 = d.wait_stats(lambda s: s["partitions"]["count"] == 0)
    assert st2["network"]["available_segments"] == st2["network"]["total_segments"]
    assert daemon_files(d) == []


# -- many subpartitions, many readers ----------------------------------------------------------


def test_wide_blocking_partitions_open_files_lazily_and_are_capped(
    start_daemon: Callable[..., Daemon],
) -> None:
    d = start_daemon("--max-subpartitions-per-partition=600")
    with pytest.raises(LimitExceededError, match="max_subpartitions_per_partition=600"):
        write(d, ResultPartitionID("wide", 0, 0), records(10), n=601)
    base = open_fds(d)
    pid = ResultPartitionID("wide", 1, 0)
    w = PartitionWriter(pid, 500, blocking=True, daemon_socket=d.local_socket, buffer_timeout=-1)
    try:
        w.emit_all(records(50), partition_func=lambda k: 0)  # one subpartition written
        w.flush()
        d.wait_stats(lambda s: s["partitions"]["count"] == 1)
        assert open_fds(d) < base + 20  # not one descriptor per subpartition
        assert daemon_files(d) and len(daemon_files(d)) < 10
    finally:
        w.close()
    assert read(d, pid, 0) == records(50)
    assert release(d, "wide") == 1
    d.wait_stats(lambda s: s["partitions"]["count"] == 0)
    assert daemon_files(d) == []
    wait_fds(d, base)


def test_readers_of_ones_own_partition_are_bounded(start_daemon: Callable[..., Daemon]) -> None:
    d = start_daemon("--max-readers-per-app=10", "--max-reader-memory-per-app=512kb")
    pid = ResultPartitionID("hot", 0, 0)
    recs = records(20_000, 100)  # ~2 MB: a reader holds its view until it is read
    write(d, pid, recs)
    base = open_fds(d)
    # the attack: many requests for one's own blocking partition (each took a descriptor
    # and 64 KiB of read buffers outside network memory)
    locs = [PartitionLocation(pid, 0, d.data_address, d.daemon_id, None) for _ in range(30)]
    with pytest.raises(LimitExceededError, match="max_reader"), PartitionReader(locs, **FAST) as r:
        for _ in r:
            pass
    d.wait_stats(lambda s: s["spill"]["readers"] == 0)  # every place in the budget back
    assert read(d, pid) == recs  # one reader goes on
    wait_fds(d, base)
    assert release(d, "hot") == 1
    d.wait_pool_whole()


def _three_readers_of(
    d: Daemon, dataset: str
) -> tuple[list[tuple[int, bytes]], list[PartitionLocation]]:
    """A finished blocking partition of 20,000 records, and three readers' locations of it."""
    pid = ResultPartitionID(dataset, 0, 0)
    recs = records(20_000, 100)
    write(d, pid, recs)
    return recs, [PartitionLocation(pid, 0, d.data_address, d.daemon_id, None) for _ in range(3)]


def test_reader_memory_budget_counts_read_buffers(start_daemon: Callable[..., Daemon]) -> None:
    # 32 KiB segments: a file reader holds two; 128 KiB lets two readers in, not three
    # (an mmap reader holds none: test_mmap_readers_hold_no_reader_memory)
    d = start_daemon("--max-reader-memory-per-app=128kb", "--blocking-shuffle-type=file")
    recs, locs = _three_readers_of(d, "mem")
    with (
        pytest.raises(LimitExceededError, match="max_reader_memory_per_app=131072"),
        PartitionReader(locs, **FAST) as r,
    ):
        for _ in r:
            pass
    locs = locs[:2]
    # two readers grow into no room (the two fill the budget) and are never refused for it
    with PartitionReader(locs, **FAST) as r:
        assert len(list(r)) == 2 * len(recs)
    st = d.wait_stats(lambda s: s["spill"]["readers"] == 0)
    assert st["spill"]["reader_memory_bytes"] == 0
    assert release(d, "mem") == 1
    d.wait_pool_whole()


def test_grown_read_segments_are_given_back_in_every_path(
    start_daemon: Callable[..., Daemon],
) -> None:
    # room to grow (64 MiB by default): file readers may take up to 8 read segments each;
    # whatever they grew to, the application's reader memory is 0 once they are gone
    d = start_daemon("--blocking-shuffle-type=file")
    recs, locs = _three_readers_of(d, "grow")
    with PartitionReader(locs, **FAST) as r:  # read to the end
        assert len(list(r)) == 3 * len(recs)
    st = d.wait_stats(lambda s: s["spill"]["readers"] == 0)
    assert st["spill"]["reader_memory_bytes"] == 0
    with PartitionReader(locs, **FAST) as r:  # a consumer gone mid-way: connection lost
        for i, _ in enumerate(r):
            if i == 1000:
                break
    st = d.wait_stats(lambda s: s["spill"]["readers"] == 0)
    assert st["spill"]["reader_memory_bytes"] == 0
    assert release(d, "grow") == 1
    d.wait_pool_whole()


def test_mmap_readers_hold_no_reader_memory(start_daemon: Callable[..., Daemon]) -> None:
    # mmap storage: readers send slices of the mapped file, so the budget that refused a
    # third file reader above lets three (and more) in, and counts no bytes
    d = start_daemon("--max-reader-memory-per-app=128kb", "--blocking-shuffle-type=mmap")
    recs, locs = _three_readers_of(d, "mem")
    with PartitionReader(locs, **FAST) as r:
        assert len(list(r)) == 3 * len(recs)
    st = d.wait_stats(lambda s: s["spill"]["readers"] == 0)
    assert st["spill"]["reader_memory_bytes"] == 0
    assert release(d, "mem") == 1
    d.wait_pool_whole()
