"""The compiled framing (exchange/serialization/framing.pyx), fuzzed against a plain
reference split: any bytes, fed in one piece, byte by byte or in any chunking, give the
same payloads, the same error and the same unconsumed tail."""

from __future__ import annotations

import itertools
import struct
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exchange.errors import CorruptRecordError, RecordTooLargeError
from exchange.serialization.framing import SCRATCH_KEEP, LengthPrefixedDecoder

LIMIT = 300


class Collect(LengthPrefixedDecoder):
    """Each frame's payload, copied, as one record."""

    __slots__ = ()

    def _deliver(self, payload: memoryview) -> None:
        self._ready.append(bytes(payload))


def reference(data: bytes, limit: int) -> tuple[list[bytes], type[Exception] | None, bytes]:
    """Payloads, the error (None) and the bytes of the incomplete frame at the end."""
    out: list[bytes] = []
    pos = 0
    while len(data) - pos >= 4:
        (n,) = struct.unpack_from(">I", data, pos)
        if n > limit:
            return out, RecordTooLargeError, b""
        if pos + 4 + n > len(data):
            break
        out.append(data[pos + 4 : pos + 4 + n])
        pos += 4 + n
    return out, None, data[pos:]


def decode(pieces: list[bytes], limit: int) -> tuple[list[bytes], type[Exception] | None, Any]:
    dec = Collect(limit)
    got: list[bytes] = []
    error: type[Exception] | None = None
    for piece in pieces:
        try:
            dec.feed(piece)
        except CorruptRecordError as exc:  # pragma: no cover - deferred to take()
            raise AssertionError(f"feed raised {exc!r}") from exc
        try:  # take() until it has nothing: records first, then their error
            while records := dec.take():
                got += records
        except CorruptRecordError as exc:
            error = type(exc)
            break
    tail = None if error else dec.unconsumed_bytes()
    if error is None:
        assert dec.has_partial_record == bool(tail)
        assert dec.buffered_bytes == len(tail)
    else:
        assert dec.has_partial_record  # an error is never a clean boundary
    return got, error, tail


def chunked(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points)] or [b""]


frames = st.lists(st.binary(max_size=LIMIT + 20), max_size=8).map(
    lambda payloads: b"".join(struct.pack(">I", len(p)) + p for p in payloads)
)
streams = st.tuples(frames, st.binary(max_size=12)).map(lambda t: t[0] + t[1]) | st.binary(
    max_size=600
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=streams, cuts=st.lists(st.integers(0, 10_000), max_size=12))
def test_any_chunking_gives_the_reference_split(data: bytes, cuts: list[int]) -> None:
    payloads, error, tail = reference(data, LIMIT)
    expected = (payloads, error, None if error else tail)
    assert decode([data], LIMIT) == expected
    assert decode(chunked(data, cuts), LIMIT) == expected
    assert decode([data[i : i + 1] for i in range(len(data))] or [b""], LIMIT) == expected


@settings(max_examples=50, deadline=None)
@given(size=st.integers(SCRATCH_KEEP - 8, SCRATCH_KEEP + 8), piece=st.integers(1000, 70_000))
def test_a_frame_around_the_scratch_size_is_assembled_whole(size: int, piece: int) -> None:
    payload = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    data = struct.pack(">I", size) + payload + struct.pack(">I", 2) + b"ok"
    assert decode(chunked(data, list(range(piece, len(data), piece))), 1 << 20) == (
        [payload, b"ok"],
        None,
        b"",
    )


def test_non_byte_views_are_read_as_their_bytes() -> None:
    data = struct.pack(">I", 4) + b"abcd"
    words = memoryview(bytearray(data)).cast("I")  # format "I": fed as its 8 bytes
    dec = Collect(LIMIT)
    dec.feed(words)
    assert dec.take() == [b"abcd"]
    with pytest.raises(NotImplementedError):
        LengthPrefixedDecoder(LIMIT).feed(data)  # the base delivers to no one
