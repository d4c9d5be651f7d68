"""The snapshot file format: a fixed header, then a payload (pickle protocol 5 of plain dicts).

Layout (big endian)::

    magic  4 bytes  b"XSNP"
    version u16     FORMAT_VERSION
    kind   u16      what the payload is (SnapshotKind): keyed state, operator state, metadata
    length u64      payload bytes
    crc32  u32      of the payload
    payload

``decode`` checks the header before reading anything else and raises CorruptSnapshotError
(naming the source) on a short, truncated, padded, altered or mismatched file. The payload of
keyed and operator state is pickled, so it must come from the job's own checkpoint directory:
unpickling runs code named in the file.
"""

from __future__ import annotations

import pickle
import struct
import zlib
from enum import IntEnum
from typing import Any, Final

from exchange.state.errors import CorruptSnapshotError

__all__ = [
    "FORMAT_VERSION",
    "HEADER",
    "MAGIC",
    "SnapshotKind",
    "decode_envelope",
    "decode_snapshot",
    "encode_envelope",
    "encode_snapshot",
]

MAGIC: Final = b"XSNP"
FORMAT_VERSION: Final = 1
HEADER: Final = struct.Struct(">4sHHQI")
PICKLE_PROTOCOL: Final = 5


class SnapshotKind(IntEnum):
    KEYED_STATE = 1
    OPERATOR_STATE = 2
    CHECKPOINT_METADATA = 3
    TASK_STATE = 4


def encode_envelope(kind: SnapshotKind, payload: bytes) -> bytes:
    """The header for ``payload``, then the payload."""
    return HEADER.pack(MAGIC, FORMAT_VERSION, kind, len(payload), zlib.crc32(payload)) + payload


def decode_envelope(
    data: bytes | memoryview, kind: SnapshotKind, source: str = "<bytes>"
) -> memoryview:
    """The payload of ``data``, checked against its header; raises CorruptSnapshotError."""
    view = memoryview(data)
    if len(view) < HEADER.size:
        raise CorruptSnapshotError(
            source, f"{len(view)} bytes, shorter than the {HEADER.size}-byte header"
        )
    magic, version, got_kind, length, crc = HEADER.unpack_from(view)
    if magic != MAGIC:
        raise CorruptSnapshotError(source, f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise CorruptSnapshotError(
            source, f"format version {version} not supported (this side reads {FORMAT_VERSION})"
        )
    if got_kind != kind:
        name = (
            SnapshotKind(got_kind).name if got_kind in SnapshotKind._value2member_map_ else got_kind
        )
        raise CorruptSnapshotError(source, f"holds {name}, expected {kind.name}")
    body = view[HEADER.size :]
    if len(body) != length:
        what = "truncated" if len(body) < length else "trailing bytes"
        raise CorruptSnapshotError(
            source, f"{what}: payload of {len(body)} bytes, header says {length}"
        )
    if zlib.crc32(body) != crc:
        raise CorruptSnapshotError(source, "checksum mismatch")
    return body


def encode_snapshot(kind: SnapshotKind, state: dict[Any, Any]) -> bytes:
    """``state`` (a plain dict) pickled with protocol 5, in an envelope."""
    return encode_envelope(kind, pickle.dumps(state, protocol=PICKLE_PROTOCOL))


def decode_snapshot(
    data: bytes | memoryview, kind: SnapshotKind, source: str = "<bytes>"
) -> dict[Any, Any]:
    """The dict ``encode_snapshot`` wrote; raises CorruptSnapshotError."""
    body = decode_envelope(data, kind, source)
    try:
        state = pickle.loads(body)
    except Exception as exc:  # a checksummed payload that does not unpickle
        raise CorruptSnapshotError(source, f"payload does not unpickle: {exc!r}") from exc
    if not isinstance(state, dict):
        raise CorruptSnapshotError(source, f"payload is a {type(state).__name__}, not a dict")
    return state
