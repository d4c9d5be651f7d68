"""The snapshot file format: a fixed header, then a payload (pickle protocol 5 of plain dicts).

Layout (big endian)::

    magic  4 bytes  b"XSNP"
    version u16     FORMAT_VERSION
    kind   u16      what the payload is (SnapshotKind): keyed state, operator state, metadata
    length u64      payload bytes
    crc32  u32      of the payload
    payload

With a key (``encode_envelope(..., key=k, context=c)``) the version is ``KEYED_VERSION``
and a 32-byte HMAC-SHA256 follows the header::

    header (version KEYED_VERSION) | mac 32 bytes | payload
    mac = HMAC-SHA256(key, u32 len(context) | context | header | payload)

``context`` binds the bytes to where they belong (the checkpoint storage passes the file's
path relative to its root, ``chk-N/<name>``), so a file copied to another name or another
checkpoint does not verify. The key of a job's checkpoints is ``checkpoint_key(secret,
job_id)``: derived from the daemons' shared secret, one per job.

``decode`` checks the header (and the MAC, before anything is unpickled) and raises
CorruptSnapshotError (naming the source) on a short, truncated, padded, altered or
mismatched file, and SnapshotAuthenticationError when a key is expected and the MAC is
missing or wrong (or a MAC is present and no key is configured). The payload of keyed and
operator state is pickled, so it must come from the job's own checkpoint directory:
unpickling runs code named in the file. Without a key, whoever can write that directory
can run code in the job; with one, only a holder of the key can.
"""

from __future__ import annotations

import hashlib
import hmac
import pickle
import struct
import zlib
from enum import IntEnum
from typing import Any, Final

from exchange.errors import UsageError
from exchange.state.errors import CorruptSnapshotError, SnapshotAuthenticationError

__all__ = [
    "FORMAT_VERSION",
    "HEADER",
    "KEYED_VERSION",
    "MAC_SIZE",
    "MAGIC",
    "SnapshotKind",
    "checkpoint_key",
    "decode_envelope",
    "decode_snapshot",
    "encode_envelope",
    "encode_snapshot",
]

MAGIC: Final = b"XSNP"
FORMAT_VERSION: Final = 1
#: The version of an envelope that carries a MAC after its header.
KEYED_VERSION: Final = 2
HEADER: Final = struct.Struct(">4sHHQI")
MAC_SIZE: Final = hashlib.sha256().digest_size
_CONTEXT_LEN: Final = struct.Struct(">I")
_KEY_LABEL: Final = b"exchange-checkpoint-key-v1\x00"
PICKLE_PROTOCOL: Final = 5


class SnapshotKind(IntEnum):
    KEYED_STATE = 1
    OPERATOR_STATE = 2
    CHECKPOINT_METADATA = 3
    TASK_STATE = 4


def checkpoint_key(secret: bytes, job_id: str) -> bytes:
    """The key of job ``job_id``'s checkpoint files under the shared secret ``secret``."""
    if not isinstance(secret, bytes) or not secret:
        raise UsageError("secret must be non-empty bytes")
    if not isinstance(job_id, str) or not job_id:
        raise UsageError(f"job_id must be a non-empty str, got {job_id!r}")
    return hmac.new(secret, _KEY_LABEL + job_id.encode("utf-8"), hashlib.sha256).digest()


def _mac(
    key: bytes, context: bytes, header: bytes | memoryview, payload: bytes | memoryview
) -> bytes:
    mac = hmac.new(key, _CONTEXT_LEN.pack(len(context)) + context, hashlib.sha256)
    mac.update(header)
    mac.update(payload)
    return mac.digest()


def _check_key(key: bytes | None) -> None:
    if key is not None and (not isinstance(key, bytes) or len(key) < 16):
        raise UsageError("a checkpoint key must be bytes of at least 16 (checkpoint_key())")


def encode_envelope(
    kind: SnapshotKind, payload: bytes, *, key: bytes | None = None, context: bytes = b""
) -> bytes:
    """The header for ``payload`` (and its MAC under ``key``, bound to ``context``), then
    the payload."""
    _check_key(key)
    crc = zlib.crc32(payload)
    if key is None:
        return HEADER.pack(MAGIC, FORMAT_VERSION, kind, len(payload), crc) + payload
    header = HEADER.pack(MAGIC, KEYED_VERSION, kind, len(payload), crc)
    return header + _mac(key, context, header, payload) + payload


def decode_envelope(
    data: bytes | memoryview,
    kind: SnapshotKind,
    source: str = "<bytes>",
    *,
    key: bytes | None = None,
    context: bytes = b"",
) -> memoryview:
    """The payload of ``data``, checked against its header (and its MAC under ``key``);
    raises CorruptSnapshotError or SnapshotAuthenticationError."""
    _check_key(key)
    view = memoryview(data)
    if len(view) < HEADER.size:
        raise CorruptSnapshotError(
            source, f"{len(view)} bytes, shorter than the {HEADER.size}-byte header"
        )
    magic, version, got_kind, length, crc = HEADER.unpack_from(view)
    if magic != MAGIC:
        raise CorruptSnapshotError(source, f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version not in (FORMAT_VERSION, KEYED_VERSION):
        raise CorruptSnapshotError(
            source,
            f"format version {version} not supported (this side reads {FORMAT_VERSION} and "
            f"{KEYED_VERSION})",
        )
    if got_kind != kind:
        name = (
            SnapshotKind(got_kind).name if got_kind in SnapshotKind._value2member_map_ else got_kind
        )
        raise CorruptSnapshotError(source, f"holds {name}, expected {kind.name}")
    if version == FORMAT_VERSION and key is not None:
        raise SnapshotAuthenticationError(
            source, "carries no MAC, but a checkpoint key is configured: refused unread"
        )
    if version == KEYED_VERSION and key is None:
        raise SnapshotAuthenticationError(
            source, "carries a MAC, but no checkpoint key is configured (set the secret)"
        )
    start = HEADER.size + (MAC_SIZE if key is not None else 0)
    if len(view) < start:
        raise CorruptSnapshotError(source, f"{len(view)} bytes, shorter than header and MAC")
    body = view[start:]
    if key is not None and not hmac.compare_digest(
        _mac(key, context, view[: HEADER.size], body), view[HEADER.size : start]
    ):
        raise SnapshotAuthenticationError(
            source, "MAC mismatch: not written by this job under its key (forged or moved)"
        )
    if len(body) != length:
        what = "truncated" if len(body) < length else "trailing bytes"
        raise CorruptSnapshotError(
            source, f"{what}: payload of {len(body)} bytes, header says {length}"
        )
    if zlib.crc32(body) != crc:
        raise CorruptSnapshotError(source, "checksum mismatch")
    return body


def encode_snapshot(
    kind: SnapshotKind, state: dict[Any, Any], *, key: bytes | None = None, context: bytes = b""
) -> bytes:
    """``state`` (a plain dict) pickled with protocol 5, in an envelope."""
    return encode_envelope(
        kind, pickle.dumps(state, protocol=PICKLE_PROTOCOL), key=key, context=context
    )


def decode_snapshot(
    data: bytes | memoryview,
    kind: SnapshotKind,
    source: str = "<bytes>",
    *,
    key: bytes | None = None,
    context: bytes = b"",
) -> dict[Any, Any]:
    """The dict ``encode_snapshot`` wrote; raises CorruptSnapshotError (or
    SnapshotAuthenticationError, checked before anything is unpickled)."""
    body = decode_envelope(data, kind, source, key=key, context=context)
    try:
        state = pickle.loads(body)
    except Exception as exc:  # a checksummed payload that does not unpickle
        raise CorruptSnapshotError(source, f"payload does not unpickle: {exc!r}") from exc
    if not isinstance(state, dict):
        raise CorruptSnapshotError(source, f"payload is a {type(state).__name__}, not a dict")
    return state
