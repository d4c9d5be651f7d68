"""Checkpoint storage on any fsspec URL (a local path, ``file://``, ``memory://``, ``s3://``).

Layout::

    <dir>/chk-<id>/<task>.state     one file per task, written by the task
    <dir>/chk-<id>/_metadata        written last by the driver: the commit point

``commit`` writes the metadata to a temporary name and moves it into place, so a reader sees
either no ``_metadata`` or a whole one; where a move is a copy (object stores), the
checksum in the metadata's header rejects a partial copy, and a single PUT is atomic anyway.
A checkpoint directory without ``_metadata`` (a crash mid-checkpoint, an aborted one) is
never restored. The metadata is JSON in the snapshot envelope (version, checksum); a
corrupt one, or one naming a missing state file, raises CorruptSnapshotError naming the
file rather than silently falling back to an older checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import fsspec

from exchange.errors import ConfigError, IllegalStateError, UsageError
from exchange.state import CorruptSnapshotError, SnapshotKind, decode_envelope, encode_envelope

__all__ = ["METADATA_FILE", "CheckpointMetadata", "CheckpointStorage"]

METADATA_FILE: Final = "_metadata"
_CHK = re.compile(r"chk-(\d+)")
_TASK_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")


@dataclass(frozen=True, slots=True)
class CheckpointMetadata:
    """What a completed checkpoint holds: each task's state file, relative to its directory."""

    checkpoint_id: int
    timestamp: int
    task_files: Mapping[str, str]
    finished_tasks: frozenset[str] = frozenset()
    is_final: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict)  # JSON-able (e.g. job settings)

    def to_bytes(self) -> bytes:
        doc = {
            "checkpoint_id": self.checkpoint_id,
            "timestamp": self.timestamp,
            "task_files": dict(self.task_files),
            "finished_tasks": sorted(self.finished_tasks),
            "is_final": self.is_final,
            "extra": dict(self.extra),
        }
        return encode_envelope(SnapshotKind.CHECKPOINT_METADATA, json.dumps(doc).encode())

    @classmethod
    def from_bytes(cls, data: bytes, source: str) -> CheckpointMetadata:
        body = decode_envelope(data, SnapshotKind.CHECKPOINT_METADATA, source)
        try:
            doc = json.loads(bytes(body))
            meta = cls(
                checkpoint_id=int(doc["checkpoint_id"]),
                timestamp=int(doc["timestamp"]),
                task_files={str(k): str(v) for k, v in doc["task_files"].items()},
                finished_tasks=frozenset(str(t) for t in doc["finished_tasks"]),
                is_final=bool(doc["is_final"]),
                extra=dict(doc.get("extra", {})),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptSnapshotError(source, f"not checkpoint metadata: {exc!r}") from exc
        return meta


class CheckpointStorage:
    """The checkpoint directory of one job (Flink's ``FsCheckpointStorage``)."""

    def __init__(
        self, url: str, *, retained: int = 1, storage_options: Mapping[str, Any] | None = None
    ) -> None:
        if type(retained) is not int or retained < 1:
            raise ConfigError("retained", f"must be an int >= 1, got {retained!r}")
        self.url = url
        self.retained = retained
        self.fs, root = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
        self.root = root.rstrip("/") or "/"
        self.fs.makedirs(self.root, exist_ok=True)

    # -- paths -----------------------------------------------------------------------------

    def checkpoint_dir(self, checkpoint_id: int) -> str:
        if type(checkpoint_id) is not int or checkpoint_id < 0:
            raise UsageError(f"checkpoint id must be an int >= 0, got {checkpoint_id!r}")
        return f"{self.root}/chk-{checkpoint_id}"

    def metadata_path(self, checkpoint_id: int) -> str:
        return f"{self.checkpoint_dir(checkpoint_id)}/{METADATA_FILE}"

    def task_state_path(self, checkpoint_id: int, task_id: str) -> str:
        if not _TASK_ID.fullmatch(task_id):
            raise UsageError(f"task id {task_id!r} is not a safe file name ([A-Za-z0-9._-])")
        return f"{self.checkpoint_dir(checkpoint_id)}/{task_id}.state"

    # -- writing ----------------------------------------------------------------------------

    def write_task_state(self, checkpoint_id: int, task_id: str, data: bytes) -> str:
        """Write a task's snapshot; returns its path (the handle the task acknowledges)."""
        path = self.task_state_path(checkpoint_id, task_id)
        if self.fs.exists(self.metadata_path(checkpoint_id)):
            raise IllegalStateError(f"checkpoint {checkpoint_id} is already committed")
        self.fs.makedirs(self.checkpoint_dir(checkpoint_id), exist_ok=True)
        self.fs.pipe_file(path, bytes(data))
        return str(path)

    def commit(self, metadata: CheckpointMetadata) -> str:
        """Write ``_metadata`` last, atomically: the checkpoint is complete once it is there.

        Every task file it names must exist. Returns the metadata's path.
        """
        cid = metadata.checkpoint_id
        final = self.metadata_path(cid)
        if self.fs.exists(final):
            raise IllegalStateError(f"checkpoint {cid} is already committed ({final})")
        for task, name in metadata.task_files.items():
            path = f"{self.checkpoint_dir(cid)}/{name}"
            if "/" in name or not self.fs.exists(path):
                raise UsageError(f"checkpoint {cid}: state file {name!r} of task {task!r} missing")
        tmp = f"{self.checkpoint_dir(cid)}/{METADATA_FILE}.inprogress-{uuid.uuid4().hex}"
        self.fs.pipe_file(tmp, metadata.to_bytes())
        try:
            self.fs.mv(tmp, final)
        except BaseException:
            self._rm_quietly(tmp)
            raise
        return str(final)

    # -- reading ----------------------------------------------------------------------------

    def load(self, checkpoint_id: int) -> CheckpointMetadata:
        """The validated metadata of a committed checkpoint; CorruptSnapshotError names the
        file when it is damaged, names another checkpoint or a missing state file."""
        path = self.metadata_path(checkpoint_id)
        try:
            data = self.fs.cat_file(path)
        except FileNotFoundError:
            raise IllegalStateError(
                f"checkpoint {checkpoint_id} is not committed ({path})"
            ) from None
        meta = CheckpointMetadata.from_bytes(data, str(path))
        if meta.checkpoint_id != checkpoint_id:
            raise CorruptSnapshotError(
                str(path), f"describes checkpoint {meta.checkpoint_id}, not {checkpoint_id}"
            )
        for task, name in meta.task_files.items():
            if "/" in name or not self.fs.exists(f"{self.checkpoint_dir(checkpoint_id)}/{name}"):
                raise CorruptSnapshotError(
                    str(path), f"state file {name!r} of task {task!r} is missing"
                )
        return meta

    def read_task_state(self, checkpoint_id: int, task_id: str) -> bytes:
        meta = self.load(checkpoint_id)
        name = meta.task_files.get(task_id)
        if name is None:
            raise UsageError(f"checkpoint {checkpoint_id} has no state of task {task_id!r}")
        data: bytes = self.fs.cat_file(f"{self.checkpoint_dir(checkpoint_id)}/{name}")
        return data

    def checkpoint_ids(self) -> list[int]:
        """Ids of every checkpoint directory, committed or not, ascending."""
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        ids = []
        for entry in entries:
            m = _CHK.fullmatch(str(entry).rstrip("/").rsplit("/", 1)[-1])
            if m:
                ids.append(int(m.group(1)))
        return sorted(ids)

    def completed_ids(self) -> list[int]:
        """Ids of committed checkpoints (with ``_metadata``), ascending; not validated."""
        return [i for i in self.checkpoint_ids() if self.fs.exists(self.metadata_path(i))]

    def latest_completed(self) -> CheckpointMetadata | None:
        """The newest committed checkpoint, validated; half-written ones are skipped."""
        completed = self.completed_ids()
        return self.load(completed[-1]) if completed else None

    # -- deleting ---------------------------------------------------------------------------

    def discard(self, checkpoint_id: int) -> None:
        """Delete a checkpoint: its metadata first, so it is never seen half-deleted."""
        self._rm_quietly(self.metadata_path(checkpoint_id))
        directory = self.checkpoint_dir(checkpoint_id)
        if self.fs.exists(directory):
            self.fs.rm(directory, recursive=True)

    def apply_retention(self) -> list[int]:
        """Keep the ``retained`` newest committed checkpoints; delete older committed ones and
        uncommitted directories older than the newest committed (never newer ones: they may
        be in progress). Returns the ids deleted."""
        completed = self.completed_ids()
        if not completed:
            return []
        keep = set(completed[-self.retained :])
        newest = completed[-1]
        doomed = [i for i in self.checkpoint_ids() if i < newest and i not in keep]
        for i in doomed:
            self.discard(i)
        return doomed

    def _rm_quietly(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(path)
