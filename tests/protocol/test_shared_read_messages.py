"""The local-endpoint messages of in-place reads (RequestArena, NoArena, SharedArena's
consumer offer, ArenaMapped, SharedBufferResponse, RecycleSegments): each decodes to
itself in one chunk and byte by byte, and a malformed body is a ProtocolError."""

from __future__ import annotations

import struct

import pytest

from exchange.buffers.buffer import DataType
from exchange.errors import ProtocolError
from exchange.protocol import FRAME_HEADER_SIZE, MAGIC, InPlaceFrameDecoder, Message, encode
from exchange.protocol.local_messages import (
    ARENA_TOKEN_SIZE,
    MAX_SHARED_BUFFERS,
    ArenaMapped,
    NoArena,
    RecycleSegments,
    RequestArena,
    SharedArena,
    SharedBufferResponse,
    encode_recycle,
    encode_shared_buffers,
    pack_shared_buffer,
)

TOKEN = bytes(range(ARENA_TOKEN_SIZE))
VALID: list[Message] = [
    RequestArena(),
    NoArena("shared_memory = off"),
    SharedArena(TOKEN, 1 << 20, (), 32768),
    SharedArena(TOKEN, 1 << 20, (0, 1, 31), 32768),
    ArenaMapped(),
    SharedBufferResponse(((2**64 - 1, 2**32 - 1, 0, 0, 1, 31, 512, 4096),)),
    SharedBufferResponse(tuple((1, i, 0, 0, 0, i, 0, 100) for i in range(MAX_SHARED_BUFFERS))),
    RecycleSegments((7,)),
    RecycleSegments(tuple(range(1000))),
]


def frame(msg: Message) -> bytes:
    return b"".join(encode(msg))


def raw(msg_id: int, body: bytes) -> bytes:
    return struct.pack(">IIB", FRAME_HEADER_SIZE + len(body), MAGIC, msg_id) + body


@pytest.mark.parametrize("msg", VALID, ids=lambda m: type(m).__name__)
def test_round_trip_in_one_chunk_and_byte_by_byte(msg: Message) -> None:
    data = frame(msg)
    assert InPlaceFrameDecoder().feed(data) == [msg]
    dec = InPlaceFrameDecoder()
    out: list[Message] = []
    for i in range(len(data)):
        out.extend(dec.feed(data[i : i + 1]))  # type: ignore[arg-type]
    assert out == [msg]


def test_the_hot_path_encoders_write_the_same_frames() -> None:
    msg = VALID[5]
    assert isinstance(msg, SharedBufferResponse)
    ((rid, seq, backlog, _, compressed, segment, offset, size),) = msg.buffers
    entry = pack_shared_buffer(rid, seq, backlog, bool(compressed), segment, offset, size)
    assert frame(msg) == encode_shared_buffers([entry])
    assert frame(RecycleSegments((5, 6))) == encode_recycle([5, 6])
    # 30 bytes of descriptor instead of the buffer
    assert len(entry) == 30


def _sbr_body(**patch: int) -> bytes:
    fields = dict(rid=1, seq=0, backlog=0, dt=0, comp=0, seg=1, off=0, size=10)
    fields.update(patch)
    return struct.pack(">QIIBBIII", *fields.values())


BAD = {
    "descriptor of an event": raw(85, _sbr_body(dt=int(DataType.EVENT_BUFFER))),
    "descriptor of an unknown data type": raw(85, _sbr_body(dt=200)),
    "descriptor compressed 2": raw(85, _sbr_body(comp=2)),
    "descriptor truncated": raw(85, _sbr_body()[:-1]),
    "descriptor trailing byte": raw(85, _sbr_body() + b"\x00"),
    "no descriptor": raw(85, b""),
    "too many descriptors": raw(85, _sbr_body() * (MAX_SHARED_BUFFERS + 1)),
    "recycle of nothing": raw(86, b""),
    "recycle not whole indices": raw(86, b"\x00\x00\x01"),
    "recycle of too many": raw(86, bytes(4 * (1 << 16) + 4)),
    "offer with segment size 0": frame(SharedArena(TOKEN, 1 << 20, (), 32768)).replace(
        b"\xcd\x80\x00", b"\xcd\x00\x00"
    ),
    "offer not whole segments": frame(SharedArena(TOKEN, (1 << 20) + 1, (), 32768)),
    "request with a body": raw(83, b"\x81\xa1a\x01"),
}


@pytest.mark.parametrize("data", BAD.values(), ids=BAD.keys())
def test_malformed_bodies_are_protocol_errors(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        InPlaceFrameDecoder().feed(data)


def test_encoders_refuse_empty_and_oversized_batches() -> None:
    with pytest.raises(ProtocolError):
        encode_recycle([])
    with pytest.raises(ProtocolError):
        encode_recycle([0] * ((1 << 16) + 1))
    with pytest.raises(ProtocolError):
        encode_shared_buffers([])
    with pytest.raises(ProtocolError):
        encode_shared_buffers([_sbr_body()] * (MAX_SHARED_BUFFERS + 1))
