"""InPlaceFrameDecoder: payloads land in the sink's view; hostile input only raises
ProtocolError, checked before the sink is asked for anything; fed whole and byte by byte.
"""

from __future__ import annotations

import itertools
import struct
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exchange.buffers.buffer import DataType
from exchange.errors import (
    BadMagicError,
    FrameTooLargeError,
    ProtocolError,
    UnknownMessageError,
    UsageError,
)
from exchange.partition.result_partition_id import ResultPartitionID
from exchange.protocol import (
    MAGIC,
    MAX_CONTROL_FRAME_SIZE,
    AddCredit,
    AuthOk,
    BufferResponse,
    CloseRequest,
    ErrorCode,
    ErrorResponse,
    InPlaceFrameDecoder,
    Message,
    MessageId,
    PartitionRequest,
    ServerHello,
    encode,
)
from exchange.protocol.codec import (
    BufferResponseHeader,
    DataFrameSpec,
    PayloadReceived,
)
from exchange.protocol.local_messages import PushBuffer
from tests.kit.reference_frame_decoder import FrameDecoder

SEG = 4096


def frame(msg: Message) -> bytes:
    return b"".join(encode(msg))


class Sink:
    """Hands out fresh 'segments' for data buffers; None for events (decoded inline)."""

    def __init__(self, accept_events: bool = False) -> None:
        self.headers: list[Any] = []
        self.segments: list[bytearray] = []
        self.accept_events = accept_events

    def __call__(self, header: BufferResponseHeader) -> memoryview | None:
        self.headers.append(header)
        if not header.data_type.is_buffer and not self.accept_events:
            return None
        if header.size > SEG:
            raise ProtocolError(f"{header.size} bytes exceed the segment")
        seg = bytearray(SEG)
        self.segments.append(seg)
        return memoryview(seg)[: header.size]


def decode_all(decoder: InPlaceFrameDecoder, chunks: list[bytes]) -> list[Any]:
    out: list[Any] = []
    for chunk in chunks:
        out.extend(decoder.feed(chunk))
    return out


def normalized(items: list[Any]) -> list[Any]:
    """Landed payloads as (header, bytes) so that two runs compare equal."""
    return [(i.header, bytes(i.payload)) if isinstance(i, PayloadReceived) else i for i in items]


DATA = BufferResponse(3, 0, 5, DataType.DATA_BUFFER, False, bytes(range(256)) * 10)
EVENT = BufferResponse(3, 1, 0, DataType.EVENT_BUFFER, False, b"\x00\x01")
CONTROL: list[Message] = [
    ServerHello(1, True, bytes(16)),
    AuthOk(bytes(32)),
    ErrorResponse(ErrorCode.PRODUCER_FAILED, "died: \u2603", 9),
    ErrorResponse(ErrorCode.SERVER_SHUTDOWN, "bye"),
    AddCredit(1, 2),
    CloseRequest(),
]


@pytest.mark.parametrize("chunking", ["whole", "bytes", "odd"])
def test_payload_lands_in_the_sink_view_and_control_frames_decode(chunking: str) -> None:
    stream = b"".join(frame(m) for m in [CONTROL[0], DATA, EVENT, *CONTROL[1:], DATA])
    if chunking == "whole":
        chunks = [stream]
    elif chunking == "bytes":
        chunks = [stream[i : i + 1] for i in range(len(stream))]
    else:
        chunks = [stream[i : i + 7] for i in range(0, len(stream), 7)]
    sink = Sink()
    out = decode_all(InPlaceFrameDecoder(body_sink=sink), chunks)
    header = BufferResponseHeader(3, 0, 5, DataType.DATA_BUFFER, False, DATA.size)
    assert (
        normalized(out)
        == [
            CONTROL[0],
            (header, DATA.payload),
            EVENT,  # the sink declined: decoded as an ordinary message
            *CONTROL[1:],
            (header, DATA.payload),
        ]
    )
    # ... and the payload bytes are in the segments, where the views point.
    assert [bytes(s[: DATA.size]) for s in sink.segments] == [DATA.payload] * 2
    landed = [i for i in out if isinstance(i, PayloadReceived)]
    assert landed[0].payload.obj is sink.segments[0]


def test_without_a_sink_it_decodes_like_the_reference_decoder() -> None:
    msgs = [*CONTROL, DATA, EVENT, PartitionRequest(ResultPartitionID("x", 1), 0, 2, 3)]
    stream = b"".join(frame(m) for m in msgs)
    assert InPlaceFrameDecoder().feed(stream) == FrameDecoder().feed(stream) == msgs


def test_the_body_is_received_straight_into_the_segment() -> None:
    """After the header, get_buffer() is the rest of the target: no copy for the body."""
    sink = Sink()
    dec = InPlaceFrameDecoder(body_sink=sink, read_ahead=64)
    data = frame(DATA)
    buf = dec.get_buffer(65536)
    assert buf.nbytes == 64  # read ahead is bounded, so little body goes through scratch
    buf[:64] = data[:64]
    assert dec.buffer_updated(64) == []
    assert dec.landing
    rest = dec.get_buffer(65536)
    assert rest.obj is sink.segments[0]  # the kernel would write into the segment
    assert rest.nbytes == len(data) - 64
    rest[:] = data[64:]
    (got,) = dec.buffer_updated(len(data) - 64)
    assert isinstance(got, PayloadReceived) and bytes(got.payload) == DATA.payload
    assert not dec.landing and dec.buffered == 0


def test_a_zero_byte_payload_lands_at_once() -> None:
    msg = BufferResponse(1, 0, 0, DataType.DATA_BUFFER, False, b"")
    out = InPlaceFrameDecoder(body_sink=Sink()).feed(frame(msg) + frame(CloseRequest()))
    assert normalized(out) == [
        (BufferResponseHeader(1, 0, 0, DataType.DATA_BUFFER, False, 0), b""),
        CloseRequest(),
    ]


def test_a_control_frame_larger_than_the_scratch_is_read_whole() -> None:
    big = BufferResponse(1, 0, 0, DataType.EVENT_BUFFER, False, b"e" * 30_000)
    dec = InPlaceFrameDecoder(32 * 1024 + 64, body_sink=Sink())
    stream = frame(big) + frame(AddCredit(1, 1))
    assert dec.feed(stream) == [big, AddCredit(1, 1)]
    dec2 = InPlaceFrameDecoder(32 * 1024 + 64, body_sink=Sink())
    assert decode_all(dec2, [stream[i : i + 1000] for i in range(0, len(stream), 1000)]) == [
        big,
        AddCredit(1, 1),
    ]


# -- hostile headers: checked before the sink is asked for a buffer --------------------------


def br_header(length: int, size: int, data_type: int = 0, compressed: int = 0) -> bytes:
    return struct.pack(">IIBQIIBBI", length, MAGIC, 11, 1, 0, 0, data_type, compressed, size)


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (br_header(10_000_000, 10_000_000 - 31), FrameTooLargeError),
        (br_header(31 + 10, 11), ProtocolError),  # declared size disagrees with the length
        (br_header(31 + 10, 10, data_type=7), ProtocolError),
        (br_header(31 + 10, 10, compressed=2), ProtocolError),
        (struct.pack(">IIB", 20, MAGIC, 11) + bytes(11), ProtocolError),  # shorter than fixed
        (struct.pack(">IIB", 20, 0xCAFEBABE, 11), BadMagicError),
        (struct.pack(">IIB", 9, MAGIC, 99), UnknownMessageError),
        (struct.pack(">IIB", 5, MAGIC, 11), ProtocolError),
    ],
)
@pytest.mark.parametrize("by_byte", [False, True])
def test_hostile_headers_never_reach_the_sink(
    data: bytes, error: type[ProtocolError], by_byte: bool
) -> None:
    sink = Sink()
    dec = InPlaceFrameDecoder(body_sink=sink)
    chunks = [data[i : i + 1] for i in range(len(data))] if by_byte else [data]
    with pytest.raises(error):
        decode_all(dec, chunks)
    assert sink.segments == [] and sink.headers == []
    assert dec.error is not None
    with pytest.raises(type(dec.error)):  # poisoned
        dec.feed(frame(CloseRequest()))
    assert dec.get_buffer().nbytes > 0  # the transport may still deliver: it is discarded


def test_accept_limits_the_ids_a_role_decodes() -> None:
    dec = InPlaceFrameDecoder(accept={MessageId.BUFFER_RESPONSE, MessageId.ERROR_RESPONSE})
    with pytest.raises(UnknownMessageError):
        dec.feed(frame(ErrorResponse(ErrorCode.INTERNAL, "x")) + frame(AddCredit(1, 1)))
    push = PushBuffer(0, DataType.DATA_BUFFER, b"abc")  # a local-endpoint message
    with pytest.raises(UnknownMessageError):
        InPlaceFrameDecoder(accept={MessageId.BUFFER_RESPONSE}).feed(frame(push))


def test_errors_of_the_sink_poison_the_decoder() -> None:
    too_big = BufferResponse(1, 0, 0, DataType.DATA_BUFFER, False, b"x" * (SEG + 1))
    dec = InPlaceFrameDecoder(body_sink=Sink())
    with pytest.raises(ProtocolError, match="exceed the segment"):
        dec.feed(frame(too_big))
    with pytest.raises(ProtocolError):
        dec.feed(frame(CloseRequest()))

    def wrong_size(header: Any) -> memoryview:
        return memoryview(bytearray(header.size + 1))

    dec = InPlaceFrameDecoder(body_sink=wrong_size)
    with pytest.raises(UsageError, match="exact size"):
        dec.feed(frame(DATA))
    with pytest.raises(ProtocolError, match="UsageError"):
        dec.feed(frame(CloseRequest()))


def test_bad_arguments() -> None:
    with pytest.raises(UsageError):
        InPlaceFrameDecoder(MAX_CONTROL_FRAME_SIZE - 1)
    with pytest.raises(UsageError):
        InPlaceFrameDecoder(read_ahead=8)


# -- the local endpoint's PushBuffer can land in place too ---------------------------------

_PUSH = struct.Struct(">IB")


def parse_push(prefix: memoryview, payload_size: int) -> tuple[int, DataType, int]:
    sub, dt = _PUSH.unpack(prefix)
    if dt > 2:
        raise ProtocolError(f"bad data type {dt}")
    return sub, DataType(dt), payload_size


def test_push_buffer_payload_lands_in_a_reserved_segment() -> None:
    segment = bytearray(SEG)

    def reserve(header: tuple[int, DataType, int]) -> memoryview | None:
        _sub, dt, size = header
        return memoryview(segment)[:size] if dt.is_buffer else None

    dec = InPlaceFrameDecoder(
        body_sink=reserve,
        data_frames={PushBuffer.MESSAGE_ID: DataFrameSpec(_PUSH.size, parse_push)},
    )
    data = PushBuffer(7, DataType.DATA_BUFFER, b"records!" * 100)
    event = PushBuffer(0xFFFFFFFF, DataType.EVENT_BUFFER, b"\x00")
    out = dec.feed(frame(data) + frame(event))
    assert normalized(out) == [((7, DataType.DATA_BUFFER, 800), data.payload), event]
    assert bytes(segment[:800]) == data.payload
    with pytest.raises(ProtocolError, match="bad data type"):
        dec.feed(struct.pack(">IIBIB", 14, MAGIC, 66, 1, 9))


# -- fuzzing: every input decodes or raises ProtocolError, whole or byte by byte --------------

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CORPUS = [frame(m) for m in [*CONTROL, DATA, EVENT]]
Outcome = tuple[list[Any], type[ProtocolError] | None, int]


def run(chunks: list[bytes]) -> Outcome:
    dec = InPlaceFrameDecoder(MAX_CONTROL_FRAME_SIZE, body_sink=Sink(), read_ahead=16)
    out: list[Any] = []
    try:
        for chunk in chunks:
            out.extend(dec.feed(chunk))
    except ProtocolError as exc:
        assert dec.error is exc
        with pytest.raises(type(exc)):
            dec.feed(CORPUS[0])
        return normalized(out), type(exc), 0
    return normalized(out), None, dec.buffered


def check(data: bytes) -> None:
    whole = run([data])
    by_byte = run([data[i : i + 1] for i in range(len(data))])
    assert whole[1] is by_byte[1]
    if whole[1] is None:
        assert whole == by_byte
    else:
        assert whole[0] == by_byte[0][: len(whole[0])]


@FUZZ
@given(st.binary(max_size=200))
def test_random_bytes(data: bytes) -> None:
    check(data)


@FUZZ
@given(
    st.sampled_from([int(i) for i in MessageId] + [0, 66, 200]),
    st.binary(max_size=120),
    st.integers(-3, 3),
)
def test_random_bodies_behind_a_valid_header(msg_id: int, body: bytes, skew: int) -> None:
    check(struct.pack(">IIB", max(0, 9 + len(body) + skew), MAGIC, msg_id) + body)


@st.composite
def mutated_frames(draw: st.DrawFn) -> bytes:
    data = bytearray(b"".join(draw(st.lists(st.sampled_from(CORPUS), min_size=1, max_size=3))))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
        at = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
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
    chunks = [stream[a:b] for a, b in itertools.pairwise([0, *cuts, len(stream)])]
    whole = run([stream])
    assert whole[1] is None and len(whole[0]) == len(frames)
    assert run(chunks) == whole
