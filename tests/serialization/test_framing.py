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

from exchange.buffers.buffer import Buffer, FreeingRecycler
from exchange.errors import (
    CorruptRecordError,
    IllegalReferenceCountError,
    ProtocolError,
    RecordTooLargeError,
)
from exchange.events.events import EndOfPartitionEvent
from exchange.memory.memory_segment import MemorySegment
from exchange.serialization.framing import (
    ITEM_DATA,
    ITEM_DRAINED,
    ITEM_OVERTAKEN,
    SCRATCH_KEEP,
    LengthPrefixedDecoder,
    feed_batch,
)
from exchange.serialization.record_codec import MsgpackCodec

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


def in_buffers(pieces: list[bytes]) -> list[Buffer]:
    """Each piece as a slice at an odd offset of a segment of its own, 0xFF bytes around
    it (what the decoder reads outside the slice would show as a wrong payload)."""
    out = []
    for i, piece in enumerate(pieces):
        seg = MemorySegment.allocate_unpooled(len(piece) + 16)
        seg.put(0, b"\xff" * (len(piece) + 16))
        seg.put(3 + i % 5, piece)
        whole = Buffer(seg, FreeingRecycler, len(piece) + 16)
        out.append(whole.read_only_slice(3 + i % 5, len(piece)))
        whole.release()  # the slice holds its own reference
    return out


def decode_batch(pieces: list[bytes], limit: int) -> tuple[list[bytes], type[Exception] | None]:
    """``feed_batch`` over the pieces as a reader's hand-off batch: payloads, error."""
    dec = Collect(limit)
    out: list[Any] = []
    batch: list[tuple[int, int, Any]] = [(ITEM_DATA, 0, buf) for buf in in_buffers(pieces)]
    error: type[Exception] | None = None
    try:
        n = feed_batch([dec], set(), batch, out)
        assert n == sum(len(records) for _, _, records in out)
        assert not dec.take()  # deferred, as after feed: the error comes at the next take
    except CorruptRecordError as exc:
        error = type(exc)
    assert all(records for _, _, records in out)  # a buffer that completes none adds nothing
    return [r for _, _, records in out for r in records], error


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


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=streams, cuts=st.lists(st.integers(0, 10_000), max_size=12))
def test_a_batch_of_buffers_gives_the_reference_split(data: bytes, cuts: list[int]) -> None:
    """``feed_batch`` reads each buffer's bytes from its segment (at its offset, no
    further) exactly as ``feed`` reads them from a memoryview."""
    payloads, error, _ = reference(data, LIMIT)
    got, got_error = decode_batch(chunked(data, cuts), LIMIT)
    assert got_error is error
    assert got == payloads[: len(got)] if error else got == payloads


def test_a_batch_dispatches_buffers_to_their_channels_and_keeps_other_items() -> None:
    frame = struct.pack(">I", 2) + b"ab"
    decs = [Collect(LIMIT), Collect(LIMIT)]
    a, b, c = in_buffers([frame[:3], frame[3:] + frame, frame])
    event = EndOfPartitionEvent()
    out: list[Any] = []
    batch: list[tuple[int, int, Any]] = [
        (ITEM_DATA, 0, a),  # completes nothing: no item
        (ITEM_OVERTAKEN, 1, (c, (7,))),  # a priority barrier overtook it: its buffer
        (ITEM_DRAINED, 0, None),  # only an unaligned handler cares: dropped
        (ITEM_DATA, 0, b),
        (1, 1, event),  # any other kind goes through as it is
    ]
    assert feed_batch(decs, set(), batch, out) == 3
    assert out == [
        (ITEM_DATA, 1, [b"ab"]),
        (ITEM_DATA, 0, [b"ab", b"ab"]),
        (1, 1, event),
    ]
    assert not decs[0].has_partial_record


def test_a_batch_checks_ended_channels_dead_buffers_and_python_decoders() -> None:
    (buf,) = in_buffers([struct.pack(">I", 2) + b"ab"])
    with pytest.raises(ProtocolError, match="channel 1 sent data after its EndOfData"):
        feed_batch([Collect(LIMIT), Collect(LIMIT)], {1}, [(ITEM_DATA, 1, buf)], [])
    codec = MsgpackCodec()  # a decoder written in Python: fed the buffer's memoryview
    enc = codec.new_encoder()
    (packed,) = in_buffers([bytes(enc.encode_batch([[1, "x"], None]))])
    out: list[Any] = []
    assert feed_batch([codec.new_decoder()], set(), [(ITEM_DATA, 0, packed)], out) == 2
    assert out == [(ITEM_DATA, 0, [[1, "x"], None])]
    buf.release()
    with pytest.raises(IllegalReferenceCountError):  # a released buffer is never read
        feed_batch([Collect(LIMIT)], set(), [(ITEM_DATA, 0, buf)], [])


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
