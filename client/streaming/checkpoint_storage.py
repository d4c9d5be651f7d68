"""Checkpoint storage on any fsspec URL (a local path, ``file://``, ``memory://``, ``s3://``).

Layout::

    <dir>/_lease                         the driver that owns the job (CheckpointLease)
    <dir>/chk-<id>/<task>-<uuid>.state   one file per task and write, written by the task
    <dir>/chk-<id>/_metadata             written last by the driver: the commit point

Every state write gets a name of its own (``write_task_state``), and the metadata records
the names (and sizes) of the files it commits, so a task left over from a dead attempt or
a dead driver never overwrites a file a committed checkpoint names. The metadata also maps
every operator's uid to the files holding its state, one per old subtask
(``CheckpointMetadata.operators``): state belongs to operators, whatever the chaining.

``commit`` writes the metadata to a temporary name and moves it into place, so a reader sees
either no ``_metadata`` or a whole one; where a move is a copy (object stores), the
checksum in the metadata's header rejects a partial copy, and a single PUT is atomic anyway.
On a local filesystem every file is created with ``O_CREAT|O_EXCL``, mode 0600, and
fsynced, and so is its directory (created 0700) before the write counts as done: a
checkpoint whose metadata exists survives a machine crash.

A checkpoint directory without ``_metadata`` (a crash mid-checkpoint, an aborted one) is
never restored. ``load`` raises CorruptSnapshotError naming the file for a damaged
metadata file, or one naming a missing or torn (wrong size) state file;
``latest_completed`` then falls back to the next older retained checkpoint with a
warning, and raises only when none is whole. With a key (``checkpoint_key`` of the
daemons' secret and the job id) every file carries an HMAC bound to its path, checked
before anything is unpickled; a forged file raises SnapshotAuthenticationError, never a
fallback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import socket
import stat
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import fsspec
from fsspec.implementations.local import LocalFileSystem

from exchange.errors import ConfigError, ExchangeError, IllegalStateError, UsageError
from exchange.state import (
    CorruptSnapshotError,
    SnapshotKind,
    decode_envelope,
    decode_snapshot,
    encode_envelope,
    encode_snapshot,
)

__all__ = [
    "LEASE_FILE",
    "METADATA_FILE",
    "CheckpointDiscardedError",
    "CheckpointLease",
    "CheckpointLeaseError",
    "CheckpointMetadata",
    "CheckpointStorage",
    "StateHandle",
    "operator_files",
]

log = logging.getLogger("exchange.streaming.checkpoints")

METADATA_FILE: Final = "_metadata"
LEASE_FILE: Final = "_lease"
_CHK = re.compile(r"chk-(\d+)")
_TASK_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
_FILE_MODE: Final = 0o600
_DIR_MODE: Final = 0o700


class CheckpointLeaseError(ExchangeError):
    """Another live driver owns the job's checkpoint directory (or took it over from this
    one); ``holder`` describes it (host, pid, since when, until when)."""

    def __init__(self, directory: str, holder: str, detail: str) -> None:
        super().__init__(f"checkpoint directory {directory}: {detail}: {holder}")
        self.directory = directory
        self.holder = holder


class CheckpointDiscardedError(IllegalStateError):
    """The checkpoint's directory went while a task wrote its state into it: the
    coordinator aborted or subsumed that checkpoint meanwhile (the task was late)."""

    def __init__(self, checkpoint_id: int) -> None:
        super().__init__(f"checkpoint {checkpoint_id} was discarded while its state was written")
        self.checkpoint_id = checkpoint_id


@dataclass(frozen=True, slots=True)
class StateHandle:
    """Where a task's state file of one checkpoint went, and its size."""

    path: str
    size: int

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]


@dataclass(frozen=True, slots=True)
class CheckpointMetadata:
    """What a completed checkpoint holds: each task's state file (relative to its
    directory), each file's size, and which files hold each operator's state."""

    checkpoint_id: int
    timestamp: int
    task_files: Mapping[str, str]
    finished_tasks: frozenset[str] = frozenset()
    is_final: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict)  # JSON-able (e.g. job settings)
    #: operator uid -> the state file of each of its subtasks (None: the subtask had
    #: finished and wrote none); the operator's parallelism is the tuple's length
    operators: Mapping[str, tuple[str | None, ...]] = field(default_factory=dict)
    #: state file name -> its size in bytes (a torn file is caught before it is read)
    sizes: Mapping[str, int] = field(default_factory=dict)

    def to_bytes(self, *, key: bytes | None = None, context: bytes = b"") -> bytes:
        doc = {
            "checkpoint_id": self.checkpoint_id,
            "timestamp": self.timestamp,
            "task_files": dict(self.task_files),
            "finished_tasks": sorted(self.finished_tasks),
            "is_final": self.is_final,
            "extra": dict(self.extra),
            "operators": {uid: list(files) for uid, files in self.operators.items()},
            "sizes": dict(self.sizes),
        }
        return encode_envelope(
            SnapshotKind.CHECKPOINT_METADATA, json.dumps(doc).encode(), key=key, context=context
        )

    @classmethod
    def from_bytes(
        cls, data: bytes, source: str, *, key: bytes | None = None, context: bytes = b""
    ) -> CheckpointMetadata:
        body = decode_envelope(
            data, SnapshotKind.CHECKPOINT_METADATA, source, key=key, context=context
        )
        try:
            doc = json.loads(bytes(body))
            meta = cls(
                checkpoint_id=int(doc["checkpoint_id"]),
                timestamp=int(doc["timestamp"]),
                task_files={str(k): str(v) for k, v in doc["task_files"].items()},
                finished_tasks=frozenset(str(t) for t in doc["finished_tasks"]),
                is_final=bool(doc["is_final"]),
                extra=dict(doc.get("extra", {})),
                operators={
                    str(uid): tuple(None if f is None else str(f) for f in files)
                    for uid, files in doc["operators"].items()
                },
                sizes={str(k): int(v) for k, v in doc["sizes"].items()},
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptSnapshotError(source, f"not checkpoint metadata: {exc!r}") from exc
        return meta


class CheckpointStorage:
    """The checkpoint directory of one job (Flink's ``FsCheckpointStorage``).

    ``key``: the job's checkpoint key (``exchange.state.checkpoint_key``); with one, every
    file written carries an HMAC and every file read must carry a valid one.
    """

    def __init__(
        self,
        url: str,
        *,
        retained: int = 1,
        storage_options: Mapping[str, Any] | None = None,
        key: bytes | None = None,
    ) -> None:
        if type(retained) is not int or retained < 1:
            raise ConfigError("retained", f"must be an int >= 1, got {retained!r}")
        if key is not None and (not isinstance(key, bytes) or len(key) < 16):
            raise ConfigError("key", "a checkpoint key must be bytes of at least 16")
        self.url = url
        self.retained = retained
        self.key = key
        self.fs, root = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
        self.root = root.rstrip("/") or "/"
        #: a local filesystem: private modes, O_EXCL and fsync apply
        self.local = isinstance(self.fs, LocalFileSystem)
        self._makedirs(self.root)
        if self.local:
            _check_private_dir(self.root)

    # -- paths -----------------------------------------------------------------------------

    def checkpoint_dir(self, checkpoint_id: int) -> str:
        if type(checkpoint_id) is not int or checkpoint_id < 0:
            raise UsageError(f"checkpoint id must be an int >= 0, got {checkpoint_id!r}")
        return f"{self.root}/chk-{checkpoint_id}"

    def metadata_path(self, checkpoint_id: int) -> str:
        return f"{self.checkpoint_dir(checkpoint_id)}/{METADATA_FILE}"

    def state_path(self, checkpoint_id: int, name: str) -> str:
        """The path of state file ``name`` (as the metadata records it) of a checkpoint."""
        if not _TASK_ID.fullmatch(name):
            raise UsageError(f"state file {name!r} is not a safe file name ([A-Za-z0-9._-])")
        return f"{self.checkpoint_dir(checkpoint_id)}/{name}"

    @staticmethod
    def _context(checkpoint_id: int, name: str) -> bytes:
        """What a file's MAC is bound to: its path relative to the storage's root."""
        return f"chk-{checkpoint_id}/{name}".encode()

    # -- writing ----------------------------------------------------------------------------

    def write_task_state(
        self, checkpoint_id: int, task_id: str, state: dict[str, Any]
    ) -> StateHandle:
        """Write a task's snapshot (a dict, pickled) under a name no other write uses;
        returns its handle (the path is what the task acknowledges)."""
        if not _TASK_ID.fullmatch(task_id) or len(task_id) > 150:
            raise UsageError(f"task id {task_id!r} is not a safe file name ([A-Za-z0-9._-])")
        if self.fs.exists(self.metadata_path(checkpoint_id)):
            raise IllegalStateError(f"checkpoint {checkpoint_id} is already committed")
        name = f"{task_id}-{uuid.uuid4().hex}.state"
        data = encode_snapshot(
            SnapshotKind.TASK_STATE,
            state,
            key=self.key,
            context=self._context(checkpoint_id, name),
        )
        directory = self.checkpoint_dir(checkpoint_id)
        self._makedirs(directory)
        path = self.state_path(checkpoint_id, name)
        try:
            self._write_new(path, data)
        except FileNotFoundError:
            if self.fs.exists(directory):
                raise
            raise CheckpointDiscardedError(checkpoint_id) from None
        return StateHandle(str(path), len(data))

    def commit(self, metadata: CheckpointMetadata) -> str:
        """Write ``_metadata`` last, atomically: the checkpoint is complete once it is there.

        Every task file it names must exist; their sizes are recorded. Returns the
        metadata's path.
        """
        cid = metadata.checkpoint_id
        final = self.metadata_path(cid)
        if self.fs.exists(final):
            raise IllegalStateError(f"checkpoint {cid} is already committed ({final})")
        sizes = {}
        for task, name in metadata.task_files.items():
            try:
                sizes[name] = int(self.fs.size(self.state_path(cid, name)))
            except (FileNotFoundError, UsageError):
                raise UsageError(
                    f"checkpoint {cid}: state file {name!r} of task {task!r} missing"
                ) from None
        for uid, files in metadata.operators.items():
            for f in files:
                if f is not None and f not in sizes:
                    raise UsageError(f"checkpoint {cid}: operator {uid!r} names {f!r}, no task's")
        data = dataclasses.replace(metadata, sizes=sizes).to_bytes(
            key=self.key, context=self._context(cid, METADATA_FILE)
        )
        tmp = f"{self.checkpoint_dir(cid)}/{METADATA_FILE}.inprogress-{uuid.uuid4().hex}"
        self._write_new(tmp, data)
        try:
            if self.local:
                os.rename(tmp, final)
                _fsync_dir(self.checkpoint_dir(cid))
            else:
                self.fs.mv(tmp, final)
        except BaseException:
            self._rm_quietly(tmp)
            raise
        return str(final)

    # -- reading ----------------------------------------------------------------------------

    def load(self, checkpoint_id: int) -> CheckpointMetadata:
        """The validated metadata of a committed checkpoint; CorruptSnapshotError names the
        file when it is damaged, names another checkpoint, or a missing or torn state file;
        SnapshotAuthenticationError when its MAC does not verify."""
        path = self.metadata_path(checkpoint_id)
        try:
            data = self.fs.cat_file(path)
        except FileNotFoundError:
            raise IllegalStateError(
                f"checkpoint {checkpoint_id} is not committed ({path})"
            ) from None
        meta = CheckpointMetadata.from_bytes(
            data, str(path), key=self.key, context=self._context(checkpoint_id, METADATA_FILE)
        )
        if meta.checkpoint_id != checkpoint_id:
            raise CorruptSnapshotError(
                str(path), f"describes checkpoint {meta.checkpoint_id}, not {checkpoint_id}"
            )
        for task, name in meta.task_files.items():
            try:
                size = int(self.fs.size(self.state_path(checkpoint_id, name)))
            except (FileNotFoundError, UsageError):
                raise CorruptSnapshotError(
                    str(path), f"state file {name!r} of task {task!r} is missing"
                ) from None
            if size != meta.sizes.get(name):
                raise CorruptSnapshotError(
                    str(path),
                    f"state file {name!r} of task {task!r} has {size} bytes, "
                    f"{meta.sizes.get(name)} were committed (torn or replaced)",
                )
        return meta

    def read_task_state(self, checkpoint_id: int, name: str) -> dict[str, Any]:
        """The dict state file ``name`` of a checkpoint holds (checked: envelope and MAC)."""
        path = self.state_path(checkpoint_id, name)
        data = self.fs.cat_file(path)
        return decode_snapshot(
            data,
            SnapshotKind.TASK_STATE,
            str(path),
            key=self.key,
            context=self._context(checkpoint_id, name),
        )

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
        """The newest whole committed checkpoint. A torn or damaged newer one is skipped
        with a warning (its output may be repeated); CorruptSnapshotError when no committed
        checkpoint is whole, SnapshotAuthenticationError for a forged one (never skipped)."""
        completed = self.completed_ids()
        first_error: CorruptSnapshotError | None = None
        for cid in reversed(completed):
            try:
                meta = self.load(cid)
            except CorruptSnapshotError as exc:
                first_error = first_error or exc
                log.warning(
                    "checkpoint %d is not whole, falling back to an older one (records "
                    "after the older one are read again; output it committed may be "
                    "repeated): %s",
                    cid,
                    exc,
                )
                continue
            except IllegalStateError:  # deleted meanwhile (retention of another attempt)
                continue
            if first_error is not None:
                log.warning("restoring from checkpoint %d instead", cid)
            return meta
        if first_error is not None:
            raise first_error
        return None

    # -- the driver's lease -----------------------------------------------------------------

    def acquire_lease(self, owner: str, ttl: float) -> CheckpointLease:
        """Own the directory for one driver (CheckpointLeaseError if another live one does)."""
        return CheckpointLease.acquire(self, owner, ttl)

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

    # -- files ------------------------------------------------------------------------------

    def _makedirs(self, path: str) -> None:
        if not self.local:
            self.fs.makedirs(path, exist_ok=True)
            return
        missing = []
        p = path
        while not os.path.isdir(p):
            missing.append(p)
            parent = os.path.dirname(p)
            if parent == p:
                break
            p = parent
        for d in reversed(missing):
            with contextlib.suppress(FileExistsError):
                os.mkdir(d, _DIR_MODE)
            _fsync_dir(os.path.dirname(d))

    def _write_new(self, path: str, data: bytes) -> None:
        """Create ``path`` (never an existing file) with ``data``, durably where local."""
        if not self.local:
            self.fs.pipe_file(path, bytes(data))
            return
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, _FILE_MODE)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise
        os.close(fd)
        _fsync_dir(os.path.dirname(path))

    def _rm_quietly(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(path)


def _fsync_dir(path: str) -> None:
    fd = os.open(path or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _check_private_dir(path: str) -> None:
    """A local checkpoint directory must be this user's and writable by nobody else:
    whoever can write it can run code in the job (state is pickled)."""
    st = os.stat(path)
    if st.st_uid != os.geteuid():
        raise ConfigError(
            "checkpoint_dir",
            f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}): "
            "whoever can write it can run code in the job; use a directory of your own",
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(
            "checkpoint_dir",
            f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}): "
            f"whoever can write it can run code in the job; chmod go-w {path}",
        )


# -- the lease --------------------------------------------------------------------------------


def _process_start(pid: int) -> str | None:
    """The start time of process ``pid`` (Linux; None elsewhere or when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return fields[19].decode()
    except (OSError, IndexError):
        return None


class CheckpointLease:
    """One driver's claim on a job's checkpoint directory (``<dir>/_lease``).

    ``acquire`` creates the lease file exclusively; an existing one is taken over only
    when it expired (its driver stopped renewing: ``ttl`` seconds of wall clock) or names a
    process of this host that no longer runs (a dead local driver frees it at once).
    Otherwise CheckpointLeaseError names the holder. ``keep_alive`` renews it every
    ``ttl / 3`` on a thread; a renewal (or ``check``, before every metadata commit) that
    finds another holder's lease records/raises CheckpointLeaseError: two drivers that raced
    for an expired lease both think they won only until the loser's next renewal.
    """

    def __init__(self, storage: CheckpointStorage, owner: str, ttl: float) -> None:
        self.storage = storage
        self.path = f"{storage.root}/{LEASE_FILE}"
        self.ttl = ttl
        self.token = uuid.uuid4().hex
        self.pid = os.getpid()
        self.doc = {
            "token": self.token,
            "owner": owner,
            "host": socket.gethostname(),
            "pid": self.pid,
            "pid_start": _process_start(self.pid),
            "since": time.time(),
        }
        #: why keep_alive stopped (another holder took the lease), else None
        self.lost: CheckpointLeaseError | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def acquire(cls, storage: CheckpointStorage, owner: str, ttl: float) -> CheckpointLease:
        if not isinstance(ttl, int | float) or isinstance(ttl, bool) or not 0 < ttl < 1e9:
            raise ConfigError("lease_timeout", f"seconds > 0, got {ttl!r}")
        lease = cls(storage, owner, float(ttl))
        for _ in range(3):
            if lease._create():
                lease._check_mine()
                return lease
            held = lease._read()
            if held is not None and not lease._stale(held):
                raise CheckpointLeaseError(
                    storage.root, _describe(held), "another driver of this job is running"
                )
            lease._break(held)
        raise CheckpointLeaseError(
            storage.root, "(changing)", "the lease changed hands three times while acquiring"
        )

    def _body(self) -> bytes:
        return json.dumps({**self.doc, "expires": time.time() + self.ttl}).encode()

    def _create(self) -> bool:
        fs = self.storage.fs
        if self.storage.local:
            try:
                self.storage._write_new(self.path, self._body())
            except FileExistsError:
                return False
            return True
        if fs.exists(self.path):  # object stores: no exclusive create; check, then write
            return False
        fs.pipe_file(self.path, self._body())
        return True

    def _read(self) -> dict[str, Any] | None:
        """The lease's document; None when it is gone or unreadable (a torn write)."""
        try:
            doc = json.loads(self.storage.fs.cat_file(self.path))
        except FileNotFoundError:
            return None
        except ValueError:
            return {}
        return doc if isinstance(doc, dict) else {}

    def _stale(self, held: dict[str, Any]) -> bool:
        try:
            if float(held["expires"]) < time.time():
                return True
            if held["host"] == socket.gethostname() and held["pid"] != self.pid:
                start = _process_start(int(held["pid"]))
                return start is None or (held.get("pid_start") not in (None, start))
        except (KeyError, TypeError, ValueError):
            return True  # not a lease this code wrote whole
        return False

    def _break(self, held: dict[str, Any] | None) -> None:
        """Remove a stale lease (moved aside first, so two breakers remove one file)."""
        if held is None:
            return
        aside = f"{self.path}.stale-{uuid.uuid4().hex}"
        try:
            self.storage.fs.mv(self.path, aside)
        except FileNotFoundError:
            return
        log.warning("took over the stale lease of %s", _describe(held))
        self.storage._rm_quietly(aside)

    def _check_mine(self) -> None:
        held = self._read()
        if held is None or held.get("token") != self.token:
            raise CheckpointLeaseError(
                self.storage.root,
                _describe(held or {}),
                "another driver took over this job's checkpoint directory",
            )

    def check(self) -> None:
        """Raise CheckpointLeaseError unless this driver still holds the lease."""
        if self.lost is not None:
            raise self.lost
        self._check_mine()

    def renew(self) -> None:
        self._check_mine()
        fs = self.storage.fs
        tmp = f"{self.path}.renew-{uuid.uuid4().hex}"
        self.storage._write_new(tmp, self._body())
        try:
            if self.storage.local:
                os.replace(tmp, self.path)
                _fsync_dir(self.storage.root)
            else:
                fs.mv(tmp, self.path)
        except BaseException:
            self.storage._rm_quietly(tmp)
            raise

    def keep_alive(self) -> None:
        """Renew every ``ttl / 3`` on a daemon thread until ``release``."""

        def run() -> None:
            while not self._stop.wait(self.ttl / 3):
                try:
                    self.renew()
                except CheckpointLeaseError as exc:
                    self.lost = exc
                    log.error("%s", exc)
                    return
                except OSError as exc:  # storage unreachable: try again, expire if it lasts
                    log.warning("could not renew the lease of %s: %s", self.path, exc)

        self._thread = threading.Thread(target=run, name="checkpoint-lease", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop renewing and delete the lease if it is still this driver's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        held = self._read()
        if held is not None and held.get("token") == self.token:
            self.storage._rm_quietly(self.path)


def _describe(held: Mapping[str, Any]) -> str:
    if not held:
        return "an unreadable lease"
    try:
        left = float(held["expires"]) - time.time()
        since = time.strftime("%H:%M:%S", time.localtime(float(held["since"])))
    except (KeyError, TypeError, ValueError):
        return f"lease {dict(held)!r}"
    return (
        f"{held.get('owner')} (host {held.get('host')}, pid {held.get('pid')}, since "
        f"{since}; the lease expires in {max(left, 0.0):.0f} s unless renewed)"
    )


def operator_files(
    task_files: Mapping[str, str], subtasks: Mapping[str, Sequence[str | None]]
) -> dict[str, tuple[str | None, ...]]:
    """``operators`` of a CheckpointMetadata: for each operator uid the state file of each
    of its subtasks, given each task's file and the tasks (in subtask order, None for
    none) that run each operator."""
    return {
        uid: tuple(None if t is None else task_files.get(t) for t in tasks)
        for uid, tasks in subtasks.items()
    }
