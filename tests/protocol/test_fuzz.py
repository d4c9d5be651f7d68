"""Hostile input for InPlaceFrameDecoder: every input either decodes or raises ProtocolError.

Anything else escaping (struct.error, UnicodeDecodeError, ValueError, IndexError, a
UsageError from a message constructor) fails these tests. Each input is also fed in one
chunk and byte by byte, and both ways must agree.
"""

from __future__ import annotations

import itertools
import struct

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exchange.errors import ProtocolError
from exchange.partition.result_partition_id import ResultPartitionID
from exchange.protocol import (
    MAGIC,
    MAX_CONTROL_FRAME_SIZE,
    AddCredit,
    AuthOk,
    AuthResponse,
    BufferResponse,
    CancelPartitionRequest,
    ClientHello,
    CloseRequest,
    DataType,
    ErrorCode,
    ErrorResponse,
    InPlaceFrameDecoder,
    Message,
    MessageId,
    NewBufferSize,
    PartitionRequest,
    ResumeConsumption,
    ServerHello,
    encode,
)

FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])

CORPUS: list[bytes] = [
    b"".join(encode(m))
    for m in (
        ClientHello(1, bytes(range(16))),
        ServerHello(1, True, bytes(16)),
        AuthResponse(bytes(range(32))),
        AuthOk(bytes(32)),
        PartitionRequest(ResultPartitionID("shuffle-\u00e9-1", 7, 99), 3, 2**40, 8),
        BufferResponse(5, 1, 2, DataType.DATA_BUFFER, False, b"records" * 5),
        BufferResponse(5, 2, 0, DataType.EVENT_BUFFER, True, b"\x00\x01"),
        AddCredit(9, 4),
        ResumeConsumption(9),
        NewBufferSize(9, 4096),
        CancelPartitionRequest(9),
        CloseRequest(),
        ErrorResponse(ErrorCode.PRODUCER_FAILED, "producer died: \u2603", 9),
        ErrorResponse(ErrorCode.SERVER_SHUTDOWN, "bye"),
    )
]


Outcome = tuple[list[Message], type[ProtocolError] | None, int]


def decode(data: bytes, chunks: list[bytes]) -> Outcome:
    """Messages, the error type (or None) and the bytes left over."""
    decoder = InPlaceFrameDecoder(MAX_CONTROL_FRAME_SIZE)
    out: list[Message] = []
    try:
        for chunk in chunks:
            out.extend(decoder.feed(chunk))
    except ProtocolError as exc:
        # Anything else propagates and fails the test.
        assert decoder.error is exc
        try:
            decoder.feed(CORPUS[0])
        except ProtocolError as again:
            assert type(again) is type(exc)
        else:
            raise AssertionError("a poisoned decoder accepted more input") from None
        return out, type(exc), 0
    assert all(isinstance(m, Message) for m in out)
    return out, None, decoder.buffered


def check(data: bytes) -> None:
    whole = decode(data, [data])
    by_byte = decode(data, [data[i : i + 1] for i in range(len(data))])
    assert whole[1] is by_byte[1]
    if whole[1] is None:
        assert whole == by_byte
    else:
        # Byte by byte, the frames before the bad one were returned before the error.
        assert whole[0] == by_byte[0][: len(whole[0])]


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes(data: bytes) -> None:
    check(data)


@FUZZ
@given(
    st.sampled_from([int(i) for i in MessageId] + [0, 64, 200]),
    st.binary(max_size=120),
    st.integers(-3, 3),
)
def test_random_bodies_behind_a_valid_header(msg_id: int, body: bytes, skew: int) -> None:
    # Random bytes almost never get past the magic; this reaches the body decoders.
    length = max(0, 9 + len(body) + skew)
    check(struct.pack(">IIB", length, MAGIC, msg_id) + body)


@st.composite
def mutated_frames(draw: st.DrawFn) -> bytes:
    frames = draw(st.lists(st.sampled_from(CORPUS), min_size=1, max_size=3))
    data = bytearray(b"".join(frames))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]))
        at = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and data:
            data[at] = draw(st.sampled_from([0x00, 0x01, 0x02, 0x7F, 0x80, 0xFF]))
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=4))
        elif op == "delete" and data:
            del data[at : at + draw(st.integers(1, 4))]
        elif op == "truncate":
            del data[at:]
    return bytes(data)


@FUZZ
@given(mutated_frames())
def test_mutated_valid_frames(data: bytes) -> None:
    check(data)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(CORPUS), min_size=1, max_size=5), st.data())
def test_valid_streams_in_random_chunks_decode_identically(
    frames: list[bytes], data: st.DataObject
) -> None:
    stream = b"".join(frames)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=10)))
    bounds = [0, *cuts, len(stream)]
    chunks = [stream[a:b] for a, b in itertools.pairwise(bounds)]
    whole = decode(stream, [stream])
    assert whole[1] is None and len(whole[0]) == len(frames)
    assert decode(stream, chunks) == whole
