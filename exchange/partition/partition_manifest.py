"""PartitionManifest: what a daemon leaves on disk so that its successor knows its partitions.

A daemon's partition (``ResultPartition(..., keep_manifest=True)``) keeps one small JSON
file, ``<stem>.manifest``, next to its spill files ``<stem>.<i>.bin``:

* from creation on, state ``writing`` (pipelined and blocking partitions alike);
* once a blocking partition is finished, state ``finished`` with every subpartition's
  file name, size, CRC-32 and buffer counts;
* deleted when the partition is released (before its files), kept when a daemon shuts
  down cleanly (``ResultPartition.keep_spilled_data``).

Every write goes to a new temporary file (``O_EXCL``, mode 0600) that is fsynced and
renamed over the manifest, so a crash leaves the old manifest or the new one, never half
of one; the body carries its own CRC-32, so a damaged manifest is told from a valid one.
With a key (``manifest_key(secret)``: the daemon has a secret) the body carries an
HMAC-SHA256 instead, and a manifest without one or with a wrong one is refused with an
:class:`~exchange.errors.IntegrityError`: who cannot compute the daemon's key cannot make
a daemon serve files it did not write. (The spill files themselves are covered by the
CRC-32s the manifest lists and by the directory's privacy, not by a MAC of their own.)

At startup the daemon reads every manifest of its spill directory (``scan``): a
``finished`` blocking partition whose files are intact (present, of the recorded size,
with the recorded checksum) is served again; one whose files are not is refused with a
:class:`~exchange.errors.PartitionDataLostError`; a partition still ``writing`` died with
the old daemon and its readers get a ProducerFailedError. ``exchange/`` does no socket
I/O; reading and writing these files is the partition's own storage, as BoundedData is.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import math
import os
import stat
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Final

from exchange.errors import CorruptRecordError, IntegrityError, PartitionDataLostError
from exchange.partition.bounded_data import BOUNDED_DATA_KINDS
from exchange.partition.result_partition_id import ResultPartitionID
from exchange.partition.result_partition_type import ResultPartitionType

__all__ = [
    "MANIFEST_SUFFIX",
    "ManifestState",
    "PartitionManifest",
    "SpilledSubpartition",
    "decode_manifest",
    "delete_partition_files",
    "encode_manifest",
    "manifest_key",
    "orphan_spill_files",
    "read_manifest",
    "scan_manifests",
    "verify_spilled_data",
    "wrap_body",
    "write_manifest",
]

MANIFEST_SUFFIX: Final = ".manifest"
_TMP_SUFFIX: Final = ".manifest.tmp"
FORMAT_VERSION: Final = 1
#: A manifest is a few hundred bytes per subpartition; anything far larger is not one.
MAX_MANIFEST_BYTES: Final = 16 * 1024 * 1024
_CHUNK: Final = 1 << 20


class ManifestState(Enum):
    WRITING = "writing"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class SpilledSubpartition:
    """One finished blocking subpartition's file."""

    file: str  # name in the manifest's directory
    size: int
    crc32: int
    buffers: int
    data_buffers: int
    payload_bytes: int


@dataclass(frozen=True, slots=True)
class PartitionManifest:
    partition_id: ResultPartitionID
    partition_type: ResultPartitionType
    state: ManifestState
    num_subpartitions: int
    segment_size: int
    bounded_data_kind: str
    finished_at: float | None = None  # wall-clock seconds, when finished
    subpartitions: tuple[SpilledSubpartition, ...] = ()
    app_id: str = ""  # the application that owns it ("": none; docs/security.md)

    def to_json(self) -> dict[str, Any]:
        pid = self.partition_id
        return {
            "version": FORMAT_VERSION,
            "dataset_id": pid.dataset_id,
            "partition_index": pid.partition_index,
            "attempt_id": pid.attempt_id,
            "type": self.partition_type.value,
            "state": self.state.value,
            "num_subpartitions": self.num_subpartitions,
            "segment_size": self.segment_size,
            "bounded_data_kind": self.bounded_data_kind,
            "finished_at": self.finished_at,
            "app_id": self.app_id,
            "subpartitions": [
                [s.file, s.size, s.crc32, s.buffers, s.data_buffers, s.payload_bytes]
                for s in self.subpartitions
            ],
        }

    @classmethod
    def from_json(cls, body: Any, path: Path) -> PartitionManifest:
        """Parse a manifest body; CorruptRecordError naming ``path`` when it is not one."""
        try:
            if body["version"] != FORMAT_VERSION:
                raise CorruptRecordError(
                    f"{path}: manifest format {body['version']!r}, expected {FORMAT_VERSION}"
                )
            pid = ResultPartitionID(body["dataset_id"], body["partition_index"], body["attempt_id"])
            subs = tuple(
                SpilledSubpartition(_str(f), *map(_count, (size, crc, b, d, n)))
                for f, size, crc, b, d, n in body["subpartitions"]
            )
            finished_at = body["finished_at"]
            if finished_at is not None and (
                type(finished_at) not in (int, float) or not math.isfinite(finished_at)
            ):
                raise ValueError(f"finished_at {finished_at!r}")
            manifest = cls(
                pid,
                ResultPartitionType(body["type"]),
                ManifestState(body["state"]),
                _count(body["num_subpartitions"]),
                _count(body["segment_size"]),
                _kind(body["bounded_data_kind"]),
                None if finished_at is None else float(finished_at),
                subs,
                _app_id(body.get("app_id", "")),  # absent: written before applications
            )
        except CorruptRecordError:
            raise
        except (KeyError, TypeError, ValueError) as e:  # UsageError is a ValueError
            raise CorruptRecordError(f"{path}: not a partition manifest: {e!r}") from None
        if manifest.state is ManifestState.FINISHED and (
            len(subs) != manifest.num_subpartitions
            or any(os.sep in s.file or s.file in ("", ".", "..") for s in subs)
        ):
            raise CorruptRecordError(f"{path}: manifest lists bad subpartition files")
        return manifest


def _count(value: Any) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"{value!r} is not a count")
    return value


def _kind(value: Any) -> str:
    if value not in BOUNDED_DATA_KINDS:
        raise ValueError(f"bounded_data_kind {value!r} is not one of {BOUNDED_DATA_KINDS}")
    return str(value)


def _str(value: Any) -> str:
    if type(value) is not str:
        raise ValueError(f"{value!r} is not a string")
    return value


def _app_id(value: Any) -> str:
    # the handshake's limit (exchange.protocol.messages.MAX_APP_ID_BYTES)
    if len(_str(value).encode("utf-8", "surrogatepass")) > 255:
        raise ValueError(f"app_id of more than 255 bytes: {value!r}")
    return str(value)


def manifest_key(secret: bytes) -> bytes:
    """The key a daemon with ``secret`` signs its manifests with (never the secret itself)."""
    return hmac.new(secret, b"exchange-manifest-v1", hashlib.sha256).digest()


def encode_manifest(manifest: PartitionManifest, key: bytes | None = None) -> bytes:
    """The manifest file's bytes: its body as JSON, with the body's CRC-32 (or, with
    ``key``, its HMAC-SHA256)."""
    return wrap_body(json.dumps(manifest.to_json(), sort_keys=True, separators=(",", ":")), key)


def wrap_body(body: str, key: bytes | None = None) -> bytes:
    """A manifest body (JSON text) with its checksum or MAC, as a manifest file holds it."""
    raw = body.encode()
    outer: dict[str, Any] = (
        {"crc32": zlib.crc32(raw)}
        if key is None
        else {"hmac": hmac.new(key, raw, hashlib.sha256).hexdigest()}
    )
    outer["body"] = body
    return json.dumps(outer).encode() + b"\n"


def decode_manifest(data: bytes, path: Path, key: bytes | None = None) -> PartitionManifest:
    """Parse a manifest file's bytes; CorruptRecordError (naming ``path``) for anything
    that is not an intact manifest; with ``key``, IntegrityError for one whose HMAC is
    missing or wrong."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise CorruptRecordError(f"{path}: larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        outer = json.loads(data)
        body_bytes = outer["body"].encode()
        if key is not None:
            mac = outer.get("hmac")
            if not isinstance(mac, str):
                raise IntegrityError(
                    f"{path}: manifest carries no HMAC, but this daemon signs its manifests "
                    "(it has a secret): refused as forged or written without the key"
                )
            expected = hmac.new(key, body_bytes, hashlib.sha256).hexdigest()
            if not hmac.compare_digest(mac.encode(), expected.encode()):
                raise IntegrityError(
                    f"{path}: manifest HMAC does not match this daemon's key: refused as "
                    "forged or written by a daemon with another secret"
                )
        elif zlib.crc32(body_bytes) != outer["crc32"]:
            raise CorruptRecordError(f"{path}: manifest checksum mismatch")
        body = json.loads(body_bytes)
    except CorruptRecordError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise CorruptRecordError(f"{path}: manifest is not valid JSON: {e!r}") from None
    return PartitionManifest.from_json(body, path)


def write_manifest(
    path: Path, manifest: PartitionManifest, *, sync: bool = True, key: bytes | None = None
) -> None:
    """Write atomically: a new temporary file (fsynced when ``sync``) renamed over ``path``;
    signed with ``key`` if given. On failure (a full disk) the temporary file is removed."""
    tmp = path.with_name(path.name[: -len(MANIFEST_SUFFIX)] + _TMP_SUFFIX)
    data = encode_manifest(manifest, key)
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()  # left by a crash of this very write
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def read_manifest(path: Path, key: bytes | None = None) -> PartitionManifest:
    """Read and check one manifest; CorruptRecordError when it is damaged (IntegrityError,
    with ``key``, when it is not signed with it)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    with open(fd, "rb") as f:
        data = f.read(MAX_MANIFEST_BYTES + 1)
    return decode_manifest(data, path, key)


def verify_spilled_data(manifest: PartitionManifest, directory: Path) -> None:
    """Check that every file of a finished manifest is present, whole and unchanged.

    Raises PartitionDataLostError saying which file and what is wrong with it.
    """
    pid = manifest.partition_id
    for sub in manifest.subpartitions:
        path = directory / sub.file
        try:
            st = path.lstat()  # a symlink is not a spill file the daemon wrote
        except FileNotFoundError:
            raise PartitionDataLostError(f"spill file {path} is missing", pid) from None
        if not stat.S_ISREG(st.st_mode):
            raise PartitionDataLostError(f"spill file {path} is not a regular file", pid)
        size = st.st_size
        if size != sub.size:
            what = "truncated" if size < sub.size else "longer than written"
            raise PartitionDataLostError(
                f"spill file {path} is {what} ({size} of {sub.size} bytes)", pid
            )
        crc = 0
        with open(os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW), "rb", 0) as f:
            while chunk := f.read(_CHUNK):
                crc = zlib.crc32(chunk, crc)
        if crc != sub.crc32:
            raise PartitionDataLostError(
                f"spill file {path} is corrupt (CRC-32 {crc:08x}, written {sub.crc32:08x})", pid
            )


def scan_manifests(directory: Path) -> Iterator[Path]:
    """The manifests in ``directory`` (leftover temporary files are deleted)."""
    for path in sorted(directory.iterdir()):
        if path.name.endswith(_TMP_SUFFIX):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        elif path.name.endswith(MANIFEST_SUFFIX):
            yield path


def delete_partition_files(manifest_path: Path) -> None:
    """Delete a manifest and every spill file of its stem (``<stem>.<i>.bin``)."""
    stem = manifest_path.name[: -len(MANIFEST_SUFFIX)]
    with contextlib.suppress(FileNotFoundError):
        manifest_path.unlink()
    for path in manifest_path.parent.glob(f"{_glob_escape(stem)}.*.bin"):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def orphan_spill_files(directory: Path) -> list[Path]:
    """Spill files (``<stem>.<i>.bin``) whose stem has no manifest: left by a crash between
    a release's manifest deletion and its file deletion."""
    stems = {p.name[: -len(MANIFEST_SUFFIX)] for p in directory.glob("*" + MANIFEST_SUFFIX)}
    orphans = []
    for path in directory.glob("*.bin"):
        stem, _, rest = path.name[: -len(".bin")].rpartition(".")
        if stem and rest.isdigit() and stem not in stems:
            orphans.append(path)
    return orphans


def _glob_escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[]" else c for c in name)
