"""CheckpointStorage on real files (tmp_path, file:// URL) and on fsspec's memory://."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest

from client.streaming import CheckpointMetadata, CheckpointStorage
from client.streaming.checkpoint_storage import METADATA_FILE
from exchange.errors import ConfigError, IllegalStateError, UsageError
from exchange.state import CorruptSnapshotError, KeyedStateBackend

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
        handle = storage.write_task_state(cid, t, f"state of {t} at {cid}".encode())
        files[t] = handle.rsplit("/", 1)[-1]
    meta = CheckpointMetadata(cid, 1000 + cid, files, frozenset({"src-1"}), is_final=False)
    if commit:
        storage.commit(meta)
    return meta


def test_layout_and_round_trip(storage: CheckpointStorage) -> None:
    assert storage.latest_completed() is None
    meta = write_checkpoint(storage, 1)
    listing = sorted(
        p.rsplit("/", 1)[-1] for p in storage.fs.ls(storage.checkpoint_dir(1), detail=False)
    )
    assert listing == sorted([METADATA_FILE, "src-0.state", "sink-0.state"])  # no temp left
    assert storage.latest_completed() == meta
    assert storage.read_task_state(1, "src-0") == b"state of src-0 at 1"
    with pytest.raises(UsageError):
        storage.read_task_state(1, "nobody")


def test_real_state_snapshots_survive_the_storage(storage: CheckpointStorage) -> None:
    backend = KeyedStateBackend(8)
    backend.set_current_key("k")
    backend.value_state("op", "v").update({"n": 1})
    storage.write_task_state(3, "keyed-0", backend.snapshot())
    storage.commit(CheckpointMetadata(3, 0, {"keyed-0": "keyed-0.state"}))
    restored = KeyedStateBackend(8)
    restored.restore([("chk-3/keyed-0.state", storage.read_task_state(3, "keyed-0"))])
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
        storage.latest_completed()
    assert err.value.source == str(path) and "chk-2/_metadata" in str(err.value)
    storage.fs.pipe_file(path, data[:-1] + bytes([data[-1] ^ 1]))  # one bit flipped
    with pytest.raises(CorruptSnapshotError, match="checksum"):
        storage.latest_completed()
    storage.fs.pipe_file(path, storage.fs.cat_file(storage.metadata_path(1)))  # another's
    with pytest.raises(CorruptSnapshotError, match="describes checkpoint 1, not 2"):
        storage.latest_completed()


def test_a_missing_state_file_is_a_typed_error(storage: CheckpointStorage) -> None:
    write_checkpoint(storage, 7)
    storage.fs.rm_file(storage.task_state_path(7, "sink-0"))
    with pytest.raises(CorruptSnapshotError, match=r"sink-0\.state"):
        storage.latest_completed()


def test_commit_refuses_missing_files_and_twice(storage: CheckpointStorage) -> None:
    with pytest.raises(UsageError, match="missing"):
        storage.commit(CheckpointMetadata(1, 0, {"t": "t.state"}))
    write_checkpoint(storage, 1)
    with pytest.raises(IllegalStateError, match="already committed"):
        storage.commit(CheckpointMetadata(1, 0, {}))
    with pytest.raises(IllegalStateError, match="already committed"):
        storage.write_task_state(1, "late-task", b"x")
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
            s.task_state_path(1, bad)
    with pytest.raises(UsageError):
        s.checkpoint_dir(-1)
    s.fs.rm(s.root, recursive=True)


def test_metadata_carries_everything() -> None:
    meta = CheckpointMetadata(3, 17, {"a": "a.state"}, frozenset({"b"}), True, {"parallelism": 2})
    assert CheckpointMetadata.from_bytes(meta.to_bytes(), "m") == meta
