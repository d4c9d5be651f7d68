"""Tests for exchange.protocol.codec (and the messages it frames)."""

from __future__ import annotations

import itertools
import struct
from collections.abc import Callable, Iterable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exchange.errors import (
    AuthenticationError,
    BadMagicError,
    FrameTooLargeError,
    LocalProtocolError,
    PartitionError,
    PartitionNotFoundError,
    PartitionReleasedError,
    ProducerFailedError,
    ProtocolError,
    SubpartitionIndexError,
    TransportError,
    UnknownMessageError,
    UsageError,
    VersionMismatchError,
)
from exchange.partition.result_partition_id import ResultPartitionID
from exchange.protocol import (
    BUFFER_RESPONSE_HEADER_SIZE,
    DEFAULT_MAX_FRAME_SIZE,
    FRAME_HEADER_SIZE,
    MAGIC,
    MAX_CONTROL_FRAME_SIZE,
    MAX_ERROR_MESSAGE_BYTES,
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
    Ping,
    Pong,
    ResumeConsumption,
    ServerHello,
    encode,
    encode_buffer_response_header,
    error_for_response,
    error_response_for,
    max_frame_size_for,
    register_message,
    unregister_message,
)

SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

u16 = st.integers(0, 2**16 - 1)
u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
nonces = st.binary(min_size=16, max_size=16)
macs = st.binary(min_size=32, max_size=32)
dataset_ids = st.text(min_size=1, max_size=80).filter(lambda s: len(s.encode("utf-8")) <= 255)
partition_ids = st.builds(ResultPartitionID, dataset_ids, u32, u64)
payloads = st.binary(max_size=3000)

MESSAGES: st.SearchStrategy[Message] = st.one_of(
    st.builds(ClientHello, u16, nonces),
    st.builds(ServerHello, u16, st.booleans(), nonces),
    st.builds(AuthResponse, macs),
    st.builds(AuthOk, macs),
    st.builds(PartitionRequest, partition_ids, u32, u64, u32),
    st.builds(BufferResponse, u64, u32, u32, st.sampled_from(DataType), st.booleans(), payloads),
    st.builds(AddCredit, u64, st.integers(1, 2**32 - 1)),
    st.builds(ResumeConsumption, u64),
    st.builds(NewBufferSize, u64, st.integers(1, 2**32 - 1)),
    st.builds(CancelPartitionRequest, u64),
    st.just(CloseRequest()),
    st.builds(ErrorResponse, st.sampled_from(ErrorCode), st.text(max_size=200), st.none() | u64),
)


def frame_bytes(msg: Message) -> bytes:
    return b"".join(encode(msg))


def feed_all(decoder: InPlaceFrameDecoder, chunks: Iterable[bytes]) -> list[Message]:
    out: list[Message] = []
    for chunk in chunks:
        out.extend(decoder.feed(chunk))
    return out


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    bounds = [0, *points, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


def raw_frame(msg_id: int, body: bytes, length: int | None = None, magic: int = MAGIC) -> bytes:
    size = FRAME_HEADER_SIZE + len(body) if length is None else length
    return struct.pack(">IIB", size, magic, msg_id) + body


# -- round trips --------------------------------------------------------------------------


@SETTINGS
@given(st.lists(MESSAGES, min_size=1, max_size=6))
def test_round_trip_in_one_chunk(msgs: list[Message]) -> None:
    stream = b"".join(frame_bytes(m) for m in msgs)
    decoder = InPlaceFrameDecoder()
    assert decoder.feed(stream) == msgs
    assert decoder.buffered == 0


@settings(max_examples=25, deadline=None)
@given(st.lists(MESSAGES, min_size=1, max_size=3))
def test_round_trip_byte_by_byte(msgs: list[Message]) -> None:
    stream = b"".join(frame_bytes(m) for m in msgs)
    decoder = InPlaceFrameDecoder()
    assert feed_all(decoder, (stream[i : i + 1] for i in range(len(stream)))) == msgs
    assert decoder.buffered == 0


@SETTINGS
@given(st.lists(MESSAGES, min_size=1, max_size=6), st.lists(st.integers(0, 10**6), max_size=12))
def test_round_trip_in_random_splits(msgs: list[Message], cuts: list[int]) -> None:
    stream = b"".join(frame_bytes(m) for m in msgs)
    decoder = InPlaceFrameDecoder()
    assert feed_all(decoder, split_at(stream, cuts)) == msgs
    assert decoder.buffered == 0


@SETTINGS
@given(MESSAGES, st.sampled_from([bytearray, memoryview]))
def test_accepts_bytearray_and_memoryview(msg: Message, kind: Callable[[bytes], object]) -> None:
    data = frame_bytes(msg)
    assert InPlaceFrameDecoder().feed(kind(data)) == [msg]  # type: ignore[arg-type]


# -- exact layout -------------------------------------------------------------------------


def test_frame_header_layout() -> None:
    assert frame_bytes(CloseRequest()) == bytes.fromhex("00000009 badc0ffe 10")
    assert frame_bytes(AddCredit(receiver_id=1, credit=2)) == bytes.fromhex(
        "00000015 badc0ffe 0c 0000000000000001 00000002"
    )


def test_buffer_response_layout() -> None:
    msg = BufferResponse(0x0102030405060708, 9, 10, DataType.EVENT_BUFFER, True, b"xyz")
    pieces = encode(msg)
    assert pieces[0] == bytes.fromhex(
        "00000022 badc0ffe 0b 0102030405060708 00000009 0000000a 01 01 00000003"
    )
    assert len(pieces[0]) == BUFFER_RESPONSE_HEADER_SIZE
    assert pieces[0] == encode_buffer_response_header(
        0x0102030405060708, 9, 10, DataType.EVENT_BUFFER, True, 3
    )


def test_partition_request_layout() -> None:
    msg = PartitionRequest(ResultPartitionID("ab", 3, 4), 5, 6, 7)
    assert frame_bytes(msg) == bytes.fromhex(
        "00000029 badc0ffe 0a 0002 6162 00000003 0000000000000004 00000005"
        " 0000000000000006 00000007"
    )


def test_partition_request_with_floating_credit_layout() -> None:
    """The optional trailing floating_credit: 4 bytes more; a decoder takes both forms
    (a client from before the field sends none: None), nothing in between."""
    msg = PartitionRequest(ResultPartitionID("ab", 3, 4), 5, 6, 7, 8)
    data = frame_bytes(msg)
    assert data == bytes.fromhex(
        "0000002d badc0ffe 0a 0002 6162 00000003 0000000000000004 00000005"
        " 0000000000000006 00000007 00000008"
    )
    assert InPlaceFrameDecoder().feed(data) == [msg]
    assert feed_all(InPlaceFrameDecoder(), [data[i : i + 1] for i in range(len(data))]) == [msg]
    old = PartitionRequest(ResultPartitionID("ab", 3, 4), 5, 6, 7)
    assert InPlaceFrameDecoder().feed(frame_bytes(old)) == [old]
    assert old.floating_credit is None
    torn = struct.pack(">I", len(data) - 2) + data[4:-2]  # half the trailing field
    with pytest.raises(ProtocolError, match="expected 32 or 36"):
        InPlaceFrameDecoder().feed(torn)
    with pytest.raises(UsageError, match="floating_credit"):
        PartitionRequest(ResultPartitionID("ab", 3, 4), 5, 6, 7, -1)


def test_error_response_layout() -> None:
    assert frame_bytes(ErrorResponse(ErrorCode.CANCELLED, "no", 5)) == bytes.fromhex(
        "00000018 badc0ffe 11 0006 01 0000000000000005 0002 6e6f"
    )
    assert frame_bytes(ErrorResponse(ErrorCode.INTERNAL, "")) == bytes.fromhex(
        "00000016 badc0ffe 11 0009 00 0000000000000000 0000"
    )


def test_hello_and_auth_layouts() -> None:
    nonce = bytes(range(16))
    assert frame_bytes(ClientHello(1, nonce)) == bytes.fromhex("0000001b badc0ffe 01 0001") + nonce
    assert frame_bytes(ServerHello(1, True, nonce)) == (
        bytes.fromhex("0000001c badc0ffe 02 0001 01") + nonce
    )
    mac = bytes(range(32))
    assert frame_bytes(AuthResponse(mac)) == bytes.fromhex("0000002a badc0ffe 03") + mac + b"\0"
    assert frame_bytes(AuthResponse(mac, "app-1")) == (
        bytes.fromhex("0000002f badc0ffe 03") + mac + b"\x05app-1"
    )
    assert InPlaceFrameDecoder().feed(frame_bytes(AuthResponse(mac, "app-1"))) == [
        AuthResponse(mac, "app-1")
    ]
    assert frame_bytes(AuthOk(mac)) == bytes.fromhex("00000029 badc0ffe 04") + mac


# -- zero copy ----------------------------------------------------------------------------


def test_encode_passes_the_payload_object_through() -> None:
    payload = bytes(1000)
    view = memoryview(bytearray(500))
    for p in (payload, view):
        pieces = encode(BufferResponse(1, 0, 0, DataType.DATA_BUFFER, False, p))
        assert len(pieces) == 2
        assert pieces[1] is p
    header = encode(BufferResponse(1, 0, 0, DataType.DATA_BUFFER, False, view))[0]
    assert struct.unpack_from(">I", header, 27)[0] == 500


def test_bytearray_input_is_copied() -> None:
    data = bytearray(frame_bytes(BufferResponse(1, 0, 0, DataType.DATA_BUFFER, False, b"x" * 8)))
    (msg,) = InPlaceFrameDecoder().feed(data)
    data[-8:] = b"y" * 8
    assert isinstance(msg, BufferResponse)
    assert bytes(msg.payload) == b"x" * 8


def test_buffer_response_helpers() -> None:
    msg = BufferResponse(1, 0, 0, DataType.EVENT_BUFFER, False, memoryview(b"abcd")[1:])
    assert msg.size == 3
    assert not msg.is_buffer
    assert "payload" not in repr(msg)


# -- limits -------------------------------------------------------------------------------


def test_oversized_length_rejected_from_the_header_alone() -> None:
    decoder = InPlaceFrameDecoder()
    with pytest.raises(FrameTooLargeError) as info:
        decoder.feed(struct.pack(">IIB", 2**31, MAGIC, MessageId.BUFFER_RESPONSE))
    assert info.value.size == 2**31
    assert info.value.limit == DEFAULT_MAX_FRAME_SIZE


def test_oversized_length_rejected_when_header_arrives_byte_by_byte() -> None:
    header = struct.pack(">IIB", 2**31, MAGIC, MessageId.BUFFER_RESPONSE)
    decoder = InPlaceFrameDecoder()
    for i in range(FRAME_HEADER_SIZE - 1):
        assert decoder.feed(header[i : i + 1]) == []
    with pytest.raises(FrameTooLargeError):
        decoder.feed(header[-1:])


def test_frame_at_the_limit_passes_one_byte_more_fails() -> None:
    limit = max_frame_size_for(8192)
    fits = limit - BUFFER_RESPONSE_HEADER_SIZE
    msg = BufferResponse(1, 0, 0, DataType.DATA_BUFFER, False, bytes(fits))
    assert InPlaceFrameDecoder(limit).feed(frame_bytes(msg)) == [msg]
    big = BufferResponse(1, 0, 0, DataType.DATA_BUFFER, False, bytes(fits + 1))
    with pytest.raises(FrameTooLargeError) as info:
        InPlaceFrameDecoder(limit).feed(frame_bytes(big)[:FRAME_HEADER_SIZE])
    assert (info.value.size, info.value.limit) == (limit + 1, limit)


def _at_the_limit(limit: int, extra: int = 0) -> tuple[BufferResponse, bytes]:
    fits = limit - BUFFER_RESPONSE_HEADER_SIZE + extra
    msg = BufferResponse(
        1, 0, 0, DataType.DATA_BUFFER, False, bytes(range(256)) * (fits // 256) + bytes(fits % 256)
    )
    return msg, frame_bytes(msg)


@pytest.mark.parametrize("split", range(1, FRAME_HEADER_SIZE + 1))
@pytest.mark.parametrize("after", [False, True], ids=["alone", "after-a-frame"])
def test_a_frame_at_the_limit_decodes_when_its_header_arrives_split(
    split: int, after: bool
) -> None:
    """The header checked across reads as in one read: a frame of
    exactly the limit passes, one byte more fails, at every split of the header, alone or
    behind a whole frame in the same read."""
    limit = max_frame_size_for(8192)
    msg, data = _at_the_limit(limit)
    assert len(data) == limit
    lead = frame_bytes(AddCredit(1, 1)) if after else b""
    first, rest = lead + data[:split], data[split:]
    expected = [AddCredit(1, 1), msg] if after else [msg]
    assert feed_all(InPlaceFrameDecoder(limit), [first, rest]) == expected
    _, big = _at_the_limit(limit, 1)
    first = lead + big[:split]
    decoder = InPlaceFrameDecoder(limit)
    with pytest.raises(FrameTooLargeError) as info:
        decoder.feed(first)
        decoder.feed(big[split:])
    assert (info.value.size, info.value.limit) == (limit + 1, limit)


@pytest.mark.parametrize(
    "name", ["x" * 255, "\u20ac" * 85, "a" + "\u00e9" * 127], ids=["ascii", "3-byte", "2-byte"]
)
def test_a_dataset_id_of_exactly_255_bytes_is_decoded(name: str) -> None:
    assert len(name.encode("utf-8")) == 255
    msg = PartitionRequest(ResultPartitionID(name, 7, 9), 3, 2, 1)
    data = frame_bytes(msg)
    assert InPlaceFrameDecoder().feed(data) == [msg]
    assert feed_all(InPlaceFrameDecoder(), [data[i : i + 1] for i in range(len(data))]) == [msg]


def test_a_dataset_id_of_256_bytes_is_refused_both_ways() -> None:
    with pytest.raises(UsageError):
        ResultPartitionID("x" * 256, 7, 9)
    # the frame of a 255-byte id, its name length patched to 256 and one byte more
    data = frame_bytes(PartitionRequest(ResultPartitionID("x" * 255, 7, 9), 3, 2, 1))
    (length,) = struct.unpack_from(">I", data)
    body = bytearray(data[FRAME_HEADER_SIZE:])
    (name_len,) = struct.unpack_from(">H", body)
    assert name_len == 255
    struct.pack_into(">H", body, 0, 256)
    body[2:2] = b"x"
    patched = struct.pack(">IIB", length + 1, MAGIC, MessageId.PARTITION_REQUEST) + bytes(body)
    with pytest.raises(ProtocolError, match="dataset id of 256 bytes"):
        InPlaceFrameDecoder().feed(patched)


def test_length_shorter_than_the_header() -> None:
    for length in (0, 1, FRAME_HEADER_SIZE - 1):
        with pytest.raises(ProtocolError, match="shorter"):
            InPlaceFrameDecoder().feed(raw_frame(MessageId.CLOSE_REQUEST, b"", length=length))


def test_max_frame_size_for() -> None:
    assert DEFAULT_MAX_FRAME_SIZE == 32 * 1024 + 64
    assert max_frame_size_for(32 * 1024) == DEFAULT_MAX_FRAME_SIZE
    assert max_frame_size_for(1 << 20) == (1 << 20) + 64
    assert max_frame_size_for(128) == MAX_CONTROL_FRAME_SIZE
    for bad in (0, -1):
        with pytest.raises(UsageError):
            max_frame_size_for(bad)
    with pytest.raises(UsageError):
        InPlaceFrameDecoder(MAX_CONTROL_FRAME_SIZE - 1)


def test_largest_control_frame_fits_the_smallest_limit() -> None:
    msg = ErrorResponse(ErrorCode.INTERNAL, "\u20ac" * 5000, 1)
    frame = frame_bytes(msg)
    assert len(frame) <= MAX_CONTROL_FRAME_SIZE
    assert InPlaceFrameDecoder(MAX_CONTROL_FRAME_SIZE).feed(frame) == [msg]
    pid = ResultPartitionID("x" * 255, 1, 2)
    assert len(frame_bytes(PartitionRequest(pid, 0, 0, 0))) <= MAX_CONTROL_FRAME_SIZE


def test_buffered_reports_a_partial_frame() -> None:
    frame = frame_bytes(AddCredit(1, 1))
    decoder = InPlaceFrameDecoder()
    decoder.feed(frame[:5])
    assert decoder.buffered == 5
    decoder.feed(frame[5:12])
    assert decoder.buffered == 12
    assert decoder.feed(frame[12:]) == [AddCredit(1, 1)]
    assert decoder.buffered == 0


# -- malformed frames ---------------------------------------------------------------------


def test_bad_magic() -> None:
    with pytest.raises(BadMagicError) as info:
        InPlaceFrameDecoder().feed(raw_frame(MessageId.CLOSE_REQUEST, b"", magic=0xCAFEBABE))
    assert info.value.magic == 0xCAFEBABE


# 64..89 belong to the local endpoint (exchange.protocol.local_messages), 128..149 to the
# driver's services (exchange.protocol.driver_messages), once imported.
@pytest.mark.parametrize("msg_id", [0, 5, 9, 20, 63, 100, 127, 159, 160, 255])
def test_unknown_id_rejected_before_the_body(msg_id: int) -> None:
    with pytest.raises(UnknownMessageError) as info:
        InPlaceFrameDecoder().feed(struct.pack(">IIB", 100, MAGIC, msg_id))
    assert info.value.msg_id == msg_id


VALID: list[Message] = [
    ClientHello(1, bytes(16)),
    ServerHello(1, False, bytes(16)),
    AuthResponse(bytes(32)),
    AuthOk(bytes(32)),
    PartitionRequest(ResultPartitionID("ds", 1, 2), 3, 4, 5),
    BufferResponse(1, 2, 3, DataType.DATA_BUFFER, False, b"payload"),
    AddCredit(1, 2),
    ResumeConsumption(1),
    NewBufferSize(1, 2),
    CancelPartitionRequest(1),
    CloseRequest(),
    ErrorResponse(ErrorCode.INTERNAL, "boom", 7),
    Ping(),
    Pong(),
]


def test_valid_corpus_covers_every_message_id() -> None:
    assert [type(m).MESSAGE_ID for m in VALID] == [int(i) for i in MessageId]
    stream = b"".join(frame_bytes(m) for m in VALID)
    assert InPlaceFrameDecoder().feed(stream) == VALID


@pytest.mark.parametrize("msg", VALID, ids=lambda m: type(m).__name__)
def test_truncated_and_trailing_bodies(msg: Message) -> None:
    frame = frame_bytes(msg)
    msg_id, body = frame[8], frame[FRAME_HEADER_SIZE:]
    if body:
        with pytest.raises(ProtocolError):
            InPlaceFrameDecoder().feed(raw_frame(msg_id, body[:-1]))
    with pytest.raises(ProtocolError):
        InPlaceFrameDecoder().feed(raw_frame(msg_id, body + b"\x00"))
    assert InPlaceFrameDecoder().feed(raw_frame(msg_id, body)) == [msg]


def _patched(msg: Message, offset: int, value: bytes) -> bytes:
    """``msg``'s frame with ``value`` written at body offset ``offset``."""
    frame = bytearray(frame_bytes(msg))
    at = FRAME_HEADER_SIZE + offset
    frame[at : at + len(value)] = value
    return bytes(frame)


BAD_BODIES = {
    "data_type unknown": _patched(VALID[5], 16, bytes([len(DataType)])),
    "data_type 255": _patched(VALID[5], 16, b"\xff"),
    "compressed 2": _patched(VALID[5], 17, b"\x02"),
    "payload size too big": _patched(VALID[5], 18, struct.pack(">I", 8)),
    "payload size too small": _patched(VALID[5], 18, struct.pack(">I", 6)),
    "auth_required 2": _patched(VALID[1], 2, b"\x02"),
    "credit 0": _patched(VALID[6], 8, struct.pack(">I", 0)),
    "buffer size 0": _patched(VALID[8], 8, struct.pack(">I", 0)),
    "error code 0": _patched(VALID[11], 0, struct.pack(">H", 0)),
    "error code 99": _patched(VALID[11], 0, struct.pack(">H", 99)),
    "has_receiver 2": _patched(VALID[11], 2, b"\x02"),
    "no receiver but id": _patched(ErrorResponse(ErrorCode.INTERNAL, "x"), 3, b"\x01"),
    "message length lies": _patched(VALID[11], 11, struct.pack(">H", 3)),
    "message not utf-8": _patched(VALID[11], 13, b"\xff"),
    "dataset id not utf-8": _patched(VALID[4], 2, b"\xc3\x28"),
    "dataset id length lies": _patched(VALID[4], 0, struct.pack(">H", 3)),
    "empty dataset id": raw_frame(10, struct.pack(">H", 0) + bytes(28)),
    "dataset id too long": raw_frame(10, struct.pack(">H", 256) + b"a" * 256 + bytes(28)),
    "error message too long": raw_frame(
        17, struct.pack(">HBQH", 9, 0, 0, MAX_ERROR_MESSAGE_BYTES + 1) + b"a" * 2049
    ),
    "buffer response too short": raw_frame(11, bytes(10)),
}


@pytest.mark.parametrize("frame", BAD_BODIES.values(), ids=BAD_BODIES.keys())
def test_bad_bodies_raise_protocol_error(frame: bytes) -> None:
    with pytest.raises(ProtocolError):
        InPlaceFrameDecoder().feed(frame)
    decoder = InPlaceFrameDecoder()
    with pytest.raises(ProtocolError):
        feed_all(decoder, (frame[i : i + 1] for i in range(len(frame))))


def test_error_poisons_the_decoder() -> None:
    decoder = InPlaceFrameDecoder()
    with pytest.raises(BadMagicError):
        decoder.feed(raw_frame(MessageId.CLOSE_REQUEST, b"", magic=0))
    assert isinstance(decoder.error, BadMagicError)
    with pytest.raises(BadMagicError):
        decoder.feed(frame_bytes(CloseRequest()))
    assert decoder.buffered == 0


def test_empty_feed() -> None:
    decoder = InPlaceFrameDecoder()
    assert decoder.feed(b"") == []
    decoder.feed(b"\x00")
    assert decoder.feed(b"") == []
    assert decoder.buffered == 1


# -- encoding misuse ----------------------------------------------------------------------


def test_encode_rejects_out_of_range_buffer_response() -> None:
    for msg in (
        BufferResponse(-1, 0, 0, DataType.DATA_BUFFER, False, b""),
        BufferResponse(0, 2**32, 0, DataType.DATA_BUFFER, False, b""),
        BufferResponse(0, 0, -5, DataType.DATA_BUFFER, False, b""),
        BufferResponse(0, 0, 0, 7, False, b""),  # type: ignore[arg-type]
    ):
        with pytest.raises(UsageError):
            encode(msg)


def test_encode_rejects_unknown_types() -> None:
    class Stray(Message):
        __slots__ = ()

    with pytest.raises(UsageError):
        encode(Stray())


@pytest.mark.parametrize(
    "build",
    [
        lambda: ClientHello(2**16, bytes(16)),
        lambda: ClientHello(1, bytes(15)),
        lambda: ServerHello(1, 1, bytes(16)),  # type: ignore[arg-type]
        lambda: AuthResponse(bytes(31)),
        lambda: AuthOk("x" * 32),  # type: ignore[arg-type]
        lambda: PartitionRequest(("ds", 1, 2), 0, 0, 0),  # type: ignore[arg-type]
        lambda: PartitionRequest(ResultPartitionID("ds", 1), -1, 0, 0),
        lambda: AddCredit(1, 0),
        lambda: AddCredit(2**64, 1),
        lambda: NewBufferSize(1, 0),
        lambda: ResumeConsumption(True),
        lambda: CancelPartitionRequest(-1),
        lambda: ErrorResponse(3, "x"),  # type: ignore[arg-type]
        lambda: ErrorResponse(ErrorCode.INTERNAL, "x", -1),
    ],
)
def test_control_messages_validate_on_construction(build: Callable[[], Message]) -> None:
    with pytest.raises(UsageError):
        build()


def test_error_response_truncates_long_and_unencodable_messages() -> None:
    msg = ErrorResponse(ErrorCode.INTERNAL, "\u00e9" * 3000)
    assert len(msg.message.encode("utf-8")) <= MAX_ERROR_MESSAGE_BYTES
    assert msg.message.endswith("...")
    assert InPlaceFrameDecoder().feed(frame_bytes(msg)) == [msg]
    odd = ErrorResponse(ErrorCode.INTERNAL, "a\ud800b")
    assert odd.message == "a?b"
    assert InPlaceFrameDecoder().feed(frame_bytes(odd)) == [odd]


def test_error_response_fatality() -> None:
    assert ErrorResponse(ErrorCode.SERVER_SHUTDOWN, "bye").is_fatal
    assert not ErrorResponse(ErrorCode.PARTITION_NOT_FOUND, "?", 0).is_fatal


# -- extension ----------------------------------------------------------------------------


class Ping(Message):
    """A stand-in for a local-endpoint message."""

    __slots__ = ("token",)
    MESSAGE_ID = 100

    def __init__(self, token: bytes) -> None:
        self.token = token

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Ping) and other.token == self.token

    __hash__ = None  # type: ignore[assignment]


def _decode_ping(body: memoryview) -> Ping:
    if len(body) < 1:
        raise ValueError("empty ping")
    return Ping(bytes(body))


@pytest.fixture
def ping_registered() -> Iterable[None]:
    register_message(100, Ping, _decode_ping, lambda m: [m.token[:1], memoryview(m.token)[1:]])
    yield
    unregister_message(100)


@pytest.mark.usefixtures("ping_registered")
def test_registered_message_round_trips() -> None:
    frame = frame_bytes(Ping(b"hello"))
    assert frame[:FRAME_HEADER_SIZE] == struct.pack(">IIB", 14, MAGIC, 100)
    decoder = InPlaceFrameDecoder()
    assert decoder.feed(frame + frame_bytes(AddCredit(1, 1))) == [Ping(b"hello"), AddCredit(1, 1)]


@pytest.mark.usefixtures("ping_registered")
def test_registered_decoder_errors_become_protocol_errors() -> None:
    with pytest.raises(ProtocolError, match="empty ping"):
        InPlaceFrameDecoder().feed(raw_frame(100, b""))


@pytest.mark.usefixtures("ping_registered")
def test_register_rejects_duplicates() -> None:
    with pytest.raises(UsageError):
        register_message(100, AddCredit, _decode_ping, lambda m: [])  # type: ignore[arg-type]
    with pytest.raises(UsageError):
        register_message(101, Ping, _decode_ping, lambda m: [])


def test_register_is_confined_to_the_reserved_range() -> None:
    for msg_id in (11, 63, 160, 255):  # core ids, and past DRIVER_MESSAGE_IDS (128..159)
        with pytest.raises(UsageError):
            register_message(msg_id, Ping, _decode_ping, lambda m: [m.token])
    with pytest.raises(UsageError):
        unregister_message(11)


def test_unregistered_message_is_unknown_again() -> None:
    register_message(100, Ping, _decode_ping, lambda m: [m.token])
    frame = frame_bytes(Ping(b"x"))
    unregister_message(100)
    with pytest.raises(UnknownMessageError):
        InPlaceFrameDecoder().feed(frame)
    with pytest.raises(UsageError):
        encode(Ping(b"x"))


# -- ErrorResponse <-> errors -------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "receiver", "expected"),
    [
        (ErrorCode.PARTITION_NOT_FOUND, 1, PartitionNotFoundError),
        (ErrorCode.PRODUCER_FAILED, 1, ProducerFailedError),
        (ErrorCode.PARTITION_RELEASED, 1, PartitionReleasedError),
        (ErrorCode.AUTH_FAILED, None, AuthenticationError),
        (ErrorCode.PROTOCOL_ERROR, None, LocalProtocolError),
        (ErrorCode.VERSION_MISMATCH, None, LocalProtocolError),
        (ErrorCode.TOO_MANY_CONNECTIONS, None, TransportError),
        (ErrorCode.SERVER_SHUTDOWN, None, TransportError),
        (ErrorCode.CANCELLED, 1, PartitionError),
        (ErrorCode.INVALID_REQUEST, 1, PartitionError),
        (ErrorCode.INTERNAL, 1, PartitionError),
        (ErrorCode.INTERNAL, None, TransportError),
    ],
)
def test_error_for_response(code: ErrorCode, receiver: int | None, expected: type) -> None:
    err = error_for_response(ErrorResponse(code, "why", receiver), "host:1")
    assert type(err) is expected
    assert "why" in str(err)
    assert "host:1" in str(err)
    if isinstance(err, PartitionError):
        assert err.address == "host:1"


def test_error_response_for() -> None:
    cases: list[tuple[BaseException, ErrorCode]] = [
        (PartitionNotFoundError("gone"), ErrorCode.PARTITION_NOT_FOUND),
        (ProducerFailedError("oom"), ErrorCode.PRODUCER_FAILED),
        (PartitionReleasedError("rel"), ErrorCode.PARTITION_RELEASED),
        (SubpartitionIndexError(5, 2), ErrorCode.INVALID_REQUEST),
        (AuthenticationError("no"), ErrorCode.AUTH_FAILED),
        (VersionMismatchError(2, 1), ErrorCode.VERSION_MISMATCH),
        (BadMagicError(0, MAGIC), ErrorCode.PROTOCOL_ERROR),
        (RuntimeError("bug"), ErrorCode.INTERNAL),
    ]
    for exc, code in cases:
        resp = error_response_for(exc)
        assert resp.code is code
        assert resp.is_fatal
        assert str(exc) in resp.message
    assert error_response_for(KeyError("k"), receiver_id=3).receiver_id == 3
