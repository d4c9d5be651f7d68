"""CheckpointStorage on real files (tmp_path, file:// URL) and on fsspec's memory://: unique
state file names, torn checkpoints, private modes and fsync on local disks, HMAC'd files,
and the driver's lease."""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest

from client.streaming import CheckpointMetadata, CheckpointStorage
from client.streaming.checkpoint_storage import (
    LEASE_FILE,
    METADATA_FILE,
    CheckpointDiscardedError,
    CheckpointLeaseError,
    StateHandle,
)
from exchange.errors import ConfigError, IllegalStateError, UsageError
from exchange.state import (
    CorruptSnapshotError,
    KeyedStateBackend,
    SnapshotAuthenticationError,
    SnapshotKind,
    checkpoint_key,
    encode_snapshot,
)

TASKS = ("src-0", "sink-0")


@pytest.fixture(params=["path", "file-url", "memory"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[CheckpointStorage]:
    if request.param == "path":
        yield CheckpointStorage(str(tmp_path / "ckpt"), retained=2)
    elif request.param == "file-url":
        yield CheckpointStorage(f"file://{tmp_path}/ckpt", retained=2)
    else:
        root = f"/ckpt-{uuid.uuid4().hex}"
        yield CheckpointStorage(f"memory://{root}", retained=2)
        fsspec.filesystem("memory").rm(root, recursive=True)


def write_checkpoint(
    storage: CheckpointStorage, cid: int, *, commit: bool = True
) -> CheckpointMetadata:
    files = {}
    for t in TASKS:
        handle = storage.write_task_state(cid, t, {"state": f"{t} at {cid}"})
        files[t] = handle.name
    meta = CheckpointMetadata(
        cid,
        1000 + cid,
        files,
        frozenset({"src-1"}),
        is_final=False,
        operators={"src": (files["src-0"], None), "sink": (files["sink-0"],)},
    )
    if commit:
        storage.commit(meta)
        return storage.load(cid)
    return meta


def names(storage: CheckpointStorage, cid: int) -> list[str]:
    return sorted(
        p.rsplit("/", 1)[-1] for p in storage.fs.ls(storage.checkpoint_dir(cid), detail=False)
    )


def test_layout_and_round_trip(storage: CheckpointStorage) -> None:
    assert storage.latest_completed() is None
    meta = write_checkpoint(storage, 1)
    assert names(storage, 1) == sorted([METADATA_FILE, *meta.task_files.values()])  # no temp
    assert all(meta.task_files[t].startswith(f"{t}-") for t in TASKS)
    assert storage.latest_completed() == meta
    assert meta.operators == {
        "src": (meta.task_files["src-0"], None),
        "sink": (meta.task_files["sink-0"],),
    }
    assert set(meta.sizes) == set(meta.task_files.values())
    assert storage.read_task_state(1, meta.task_files["src-0"]) == {"state": "src-0 at 1"}
    with pytest.raises(FileNotFoundError):
        storage.read_task_state(1, "nobody.state")
    with pytest.raises(UsageError):
        storage.read_task_state(1, "../escape")


def test_every_write_has_a_name_of_its_own(storage: CheckpointStorage) -> None:
    """A task of a dead attempt (or a dead driver) writing the same task's state under the
    same checkpoint id never replaces the file the committed metadata names."""
    meta = write_checkpoint(storage, 2, commit=False)
    zombie = storage.write_task_state(2, "src-0", {"state": "zombie"})
    assert isinstance(zombie, StateHandle) and zombie.name != meta.task_files["src-0"]
    storage.commit(meta)
    assert storage.read_task_state(2, meta.task_files["src-0"]) == {"state": "src-0 at 2"}
    assert storage.latest_completed() == storage.load(2)


def test_real_state_snapshots_survive_the_storage(storage: CheckpointStorage) -> None:
    backend = KeyedStateBackend(8)
    backend.set_current_key("k")
    backend.value_state("op", "v").update({"n": 1})
    handle = storage.write_task_state(3, "keyed-0", {"keyed": backend.snapshot()})
    storage.commit(CheckpointMetadata(3, 0, {"keyed-0": handle.name}))
    restored = KeyedStateBackend(8)
    state = storage.read_task_state(3, handle.name)
    restored.restore([(handle.name, state["keyed"])])
    restored.set_current_key("k")
    assert restored.value_state("op", "v").value() == {"n": 1}


def test_half_written_checkpoints_are_ignored(storage: CheckpointStorage) -> None:
    good = write_checkpoint(storage, 4)
    write_checkpoint(storage, 5, commit=False)  # the driver died before the metadata
    storage.fs.makedirs(storage.checkpoint_dir(6), exist_ok=True)  # a metadata copy cut short
    storage.fs.pipe_file(f"{storage.checkpoint_dir(6)}/{METADATA_FILE}.inprogress-x", b"XSNP")
    assert storage.checkpoint_ids() == [4, 5, 6]
    assert storage.completed_ids() == [4]
    assert storage.latest_completed() == good


def test_corrupt_metadata_is_a_typed_error_naming_the_file(storage: CheckpointStorage) -> None:
    write_checkpoint(storage, 1)
    write_checkpoint(storage, 2)
    path = storage.metadata_path(2)
    data = storage.fs.cat_file(path)
    storage.fs.pipe_file(path, data[:-4])  # truncated
    with pytest.raises(CorruptSnapshotError, match="truncated") as err:
        storage.load(2)
    assert err.value.source == str(path) and "chk-2/_metadata" in str(err.value)
    storage.fs.pipe_file(path, data[:-1] + bytes([data[-1] ^ 1]))  # one bit flipped
    with pytest.raises(CorruptSnapshotError, match="checksum"):
        storage.load(2)
    storage.fs.pipe_file(path, storage.fs.cat_file(storage.metadata_path(1)))  # another's
    with pytest.raises(CorruptSnapshotError, match="describes checkpoint 1, not 2"):
        storage.load(2)


@pytest.mark.parametrize("tear", ["metadata", "state-file", "missing-state-file"])
def test_a_torn_newest_checkpoint_falls_back_to_an_older_one(
    storage: CheckpointStorage, tear: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A torn newest checkpoint (a crash of the machine mid-write) is skipped with a
    warning; the restore uses the newest whole one; only when none is whole it raises."""
    first = write_checkpoint(storage, 1)
    newest = write_checkpoint(storage, 2)
    path = (
        storage.metadata_path(2)
        if tear == "metadata"
        else storage.state_path(2, newest.task_files["sink-0"])
    )
    if tear == "missing-state-file":
        storage.fs.rm_file(path)
    else:
        storage.fs.pipe_file(path, storage.fs.cat_file(path)[:-7])
    with caplog.at_level(logging.WARNING, "exchange.streaming.checkpoints"):
        assert storage.latest_completed() == first
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "checkpoint 2 is not whole" in warned and "restoring from checkpoint 1" in warned
    with pytest.raises(CorruptSnapshotError, match=r"sink-0|truncated"):
        storage.load(2)
    storage.discard(1)
    with pytest.raises(CorruptSnapshotError):  # nothing whole left: never a silent fresh start
        storage.latest_completed()


def test_a_missing_state_file_is_a_typed_error(storage: CheckpointStorage) -> None:
    meta = write_checkpoint(storage, 7)
    storage.fs.rm_file(storage.state_path(7, meta.task_files["sink-0"]))
    with pytest.raises(CorruptSnapshotError, match=r"sink-0-[0-9a-f]+\.state"):
        storage.load(7)


def test_commit_refuses_missing_files_and_twice(storage: CheckpointStorage) -> None:
    with pytest.raises(UsageError, match="missing"):
        storage.commit(CheckpointMetadata(1, 0, {"t": "t.state"}))
    h = storage.write_task_state(1, "t", {})
    with pytest.raises(UsageError, match=r"names 'other\.state'"):
        storage.commit(CheckpointMetadata(1, 0, {"t": h.name}, operators={"op": ("other.state",)}))
    storage.discard(1)
    write_checkpoint(storage, 1)
    with pytest.raises(IllegalStateError, match="already committed"):
        storage.commit(CheckpointMetadata(1, 0, {}))
    with pytest.raises(IllegalStateError, match="already committed"):
        storage.write_task_state(1, "late-task", {})
    with pytest.raises(IllegalStateError, match="not committed"):
        storage.load(99)


def test_retention_keeps_the_newest_and_never_touches_newer_in_progress(
    storage: CheckpointStorage,
) -> None:
    write_checkpoint(storage, 1)
    write_checkpoint(storage, 2, commit=False)  # aborted
    write_checkpoint(storage, 3)
    write_checkpoint(storage, 4)
    write_checkpoint(storage, 5, commit=False)  # in progress
    assert storage.apply_retention() == [1, 2]
    assert storage.checkpoint_ids() == [3, 4, 5]
    assert storage.completed_ids() == [3, 4]
    assert storage.apply_retention() == []


def test_discard(storage: CheckpointStorage) -> None:
    write_checkpoint(storage, 1)
    storage.discard(1)
    storage.discard(1)  # idempotent
    storage.discard(42)
    assert storage.checkpoint_ids() == [] and storage.latest_completed() is None


def test_a_new_storage_object_resumes_from_the_directory(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/resume"
    first = CheckpointStorage(url)
    write_checkpoint(first, 8)
    write_checkpoint(first, 9, commit=False)
    again = CheckpointStorage(url)  # a new driver given the same directory
    latest = again.latest_completed()
    assert latest is not None and latest.checkpoint_id == 8


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError):
        CheckpointStorage("memory://x", retained=0)
    s = CheckpointStorage(f"memory:///bad-{uuid.uuid4().hex}")
    for bad in ("../escape", "a/b", "", ".hidden"):
        with pytest.raises(UsageError):
            s.state_path(1, bad)
        with pytest.raises(UsageError):
            s.write_task_state(1, bad, {})
    with pytest.raises(ConfigError):
        CheckpointStorage("memory://x", key=b"short")
    with pytest.raises(UsageError):
        s.checkpoint_dir(-1)
    s.fs.rm(s.root, recursive=True)


def test_metadata_carries_everything() -> None:
    meta = CheckpointMetadata(
        3,
        17,
        {"a": "a.state"},
        frozenset({"b"}),
        True,
        {"parallelism": 2},
        operators={"op": ("a.state", None)},
        sizes={"a.state": 9},
    )
    assert CheckpointMetadata.from_bytes(meta.to_bytes(), "m") == meta


# -- local files: private, exclusive, durable ---------------------------------------------------


def test_local_files_are_private(tmp_path: Path) -> None:
    storage = CheckpointStorage(str(tmp_path / "a" / "ckpt"))
    meta = write_checkpoint(storage, 1)
    for d in (tmp_path / "a", tmp_path / "a" / "ckpt", tmp_path / "a" / "ckpt" / "chk-1"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    for name in (*meta.task_files.values(), METADATA_FILE):
        f = tmp_path / "a" / "ckpt" / "chk-1" / name
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    with pytest.raises(FileExistsError):  # never writes through an existing name
        storage._write_new(storage.state_path(1, meta.task_files["src-0"]), b"x")


def test_a_directory_others_can_write_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ConfigError, match=r"writable by group or others.*chmod go-w"):
        CheckpointStorage(str(shared))
    if os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o700)
    os.chown(foreign, 65534, 65534)  # nobody
    with pytest.raises(ConfigError, match="belongs to uid 65534"):
        CheckpointStorage(str(foreign))


def test_state_and_metadata_are_fsynced_with_their_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every file and the directory that names it are fsynced before the write returns."""
    synced: list[str] = []
    real = os.fsync

    def spy(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    storage = CheckpointStorage(str(tmp_path / "ckpt"))
    monkeypatch.setattr(os, "fsync", spy)
    h = storage.write_task_state(1, "t", {"x": 1})
    # chk-1 created (its parent fsynced), then the file and chk-1 itself
    assert synced == [storage.root, h.path, storage.checkpoint_dir(1)]
    synced.clear()
    storage.commit(CheckpointMetadata(1, 0, {"t": h.name}))
    tmp, *dirs = synced
    assert tmp.startswith(storage.metadata_path(1) + ".inprogress-")  # fsynced, then renamed
    assert dirs == [storage.checkpoint_dir(1), storage.checkpoint_dir(1)]


# -- keyed files (a secret configured) --------------------------------------------------------

KEY = checkpoint_key(b"a shared secret of the daemons", "job-1")


def test_a_key_authenticates_every_file(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    keyed = CheckpointStorage(url, key=KEY, retained=3)
    meta = write_checkpoint(keyed, 1)
    assert keyed.latest_completed() == meta
    assert keyed.read_task_state(1, meta.task_files["src-0"]) == {"state": "src-0 at 1"}
    # the same files under another job's key, or with no key: refused, never unpickled
    other = CheckpointStorage(url, key=checkpoint_key(b"a shared secret of the daemons", "j2"))
    with pytest.raises(SnapshotAuthenticationError, match="MAC mismatch"):
        other.load(1)
    with pytest.raises(SnapshotAuthenticationError, match="no checkpoint key is configured"):
        CheckpointStorage(url).load(1)


class _Boom:
    def __reduce__(self) -> Any:
        return (os.system, ("touch pwned",))


@pytest.mark.parametrize("forgery", ["unkeyed", "other-key", "moved", "swapped-metadata"])
def test_a_forged_file_is_refused_before_it_is_unpickled(
    tmp_path: Path, forgery: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whoever can write the checkpoint directory but lacks the key cannot get a pickle of
    theirs loaded: plain, under another key, a genuine file moved to another name, a
    genuine metadata file of another checkpoint."""
    monkeypatch.chdir(tmp_path)
    storage = CheckpointStorage(str(tmp_path / "ckpt"), key=KEY, retained=3)
    write_checkpoint(storage, 1)
    meta = write_checkpoint(storage, 2)
    victim = meta.task_files["src-0"]
    path = storage.state_path(2, victim)
    evil = {"operators": _Boom()}
    if forgery == "unkeyed":
        forged = encode_snapshot(SnapshotKind.TASK_STATE, evil)
    elif forgery == "other-key":
        forged = encode_snapshot(
            SnapshotKind.TASK_STATE,
            evil,
            key=checkpoint_key(b"attacker's own secret", "job-1"),
            context=f"chk-2/{victim}".encode(),
        )
    elif forgery == "moved":  # a genuine file of checkpoint 1, copied over this one
        forged = storage.fs.cat_file(storage.state_path(1, storage.load(1).task_files["src-0"]))
    else:
        path = storage.metadata_path(2)
        forged = storage.fs.cat_file(storage.metadata_path(1))
    os.unlink(path)
    Path(path).write_bytes(forged)
    with pytest.raises(SnapshotAuthenticationError) as err:
        if forgery == "swapped-metadata":
            storage.latest_completed()  # a forged newest is refused, not skipped
        else:
            storage.read_task_state(2, victim)
    assert str(path) in str(err.value)
    assert not (tmp_path / "pwned").exists()


# -- the driver's lease -----------------------------------------------------------------------


def test_a_second_driver_is_refused_naming_the_first(storage: CheckpointStorage) -> None:
    first = storage.acquire_lease("driver of job j (app-1)", ttl=60)
    with pytest.raises(CheckpointLeaseError, match="another driver of this job is running") as e:
        storage.acquire_lease("driver of job j (app-2)", ttl=60)
    assert "app-1" in e.value.holder and f"pid {os.getpid()}" in e.value.holder
    first.check()
    first.renew()
    first.release()
    again = storage.acquire_lease("driver of job j (app-2)", ttl=60)  # released: free
    again.release()
    assert not storage.fs.exists(f"{storage.root}/{LEASE_FILE}")


def test_an_expired_lease_is_taken_over_and_its_holder_fails_loudly(
    storage: CheckpointStorage,
) -> None:
    stalled = storage.acquire_lease("stalled driver", ttl=0.3)  # never renewed
    time.sleep(0.4)
    fresh = storage.acquire_lease("new driver", ttl=60)
    with pytest.raises(CheckpointLeaseError, match=r"took over.*new driver"):
        stalled.check()
    with pytest.raises(CheckpointLeaseError):
        stalled.renew()
    stalled.release()  # not its lease any more: left alone
    fresh.check()
    fresh.release()


def test_keep_alive_renews_and_reports_a_lost_lease(storage: CheckpointStorage) -> None:
    lease = storage.acquire_lease("driver", ttl=3)
    path = f"{storage.root}/{LEASE_FILE}"

    def expires() -> float:
        return float(json.loads(storage.fs.cat_file(path))["expires"])

    first = expires()
    lease.keep_alive()
    try:
        deadline = time.monotonic() + 30
        while expires() <= first:  # renewed every ttl / 3, pushing the expiry on
            assert time.monotonic() < deadline, "never renewed"
            time.sleep(0.05)
        with pytest.raises(CheckpointLeaseError, match="another driver of this job"):
            storage.acquire_lease("rival", ttl=60)
        lease.check()
        # someone removes the lease and takes the directory: the next renewal notices
        storage.fs.rm_file(path)
        rival = storage.acquire_lease("rival", ttl=60)
        deadline = time.monotonic() + 30
        while lease.lost is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lease.lost is not None and "rival" in lease.lost.holder
        with pytest.raises(CheckpointLeaseError):
            lease.check()
        rival.release()
    finally:
        lease.release()


def test_a_dead_local_drivers_lease_is_free_at_once(tmp_path: Path) -> None:
    """A driver of this host that died (SIGKILL, no release) frees the job without waiting
    for its lease to expire."""
    url = str(tmp_path / "ckpt")
    code = (
        "import sys; from client.streaming.checkpoint_storage import CheckpointStorage; "
        "CheckpointStorage(sys.argv[1]).acquire_lease('dead driver', ttl=3600)"
    )
    subprocess.run([sys.executable, "-c", code, url], check=True, cwd=Path(__file__).parents[2])
    held = json.loads((tmp_path / "ckpt" / LEASE_FILE).read_text())
    assert held["owner"] == "dead driver" and held["expires"] > time.time() + 3000
    lease = CheckpointStorage(url).acquire_lease("new driver", ttl=60)
    lease.check()
    lease.release()


def test_a_checkpoint_discarded_while_a_task_writes_its_state_is_a_typed_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A late task writing state into a checkpoint the coordinator discarded meanwhile
    (aborted, or uncommitted and older than the newest committed) gets
    CheckpointDiscardedError, which the task takes as "nothing to acknowledge"."""
    storage = CheckpointStorage(str(tmp_path / "ckpt"))
    original = storage._write_new

    def discarded_first(path: str, data: bytes) -> None:
        storage.discard(4)  # the coordinator, between the task's mkdir and its write
        original(path, data)

    monkeypatch.setattr(storage, "_write_new", discarded_first)
    with pytest.raises(CheckpointDiscardedError) as info:
        storage.write_task_state(4, "v1-1", {"n": 1})
    assert info.value.checkpoint_id == 4
    assert isinstance(info.value, IllegalStateError)
