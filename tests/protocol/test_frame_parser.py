"""The compiled frame parser (exchange/protocol/frame_parser.pyx).

It is the extension, never Python source; streams of many frames decode to exactly what
was encoded whatever the reads look like (one chunk, byte by byte, random chunkings,
reads shorter than ``get_buffer()`` offered, any ``read_ahead``); hostile headers raise
the codec's typed errors with the same messages however the bytes arrive.
"""

from __future__ import annotations

import importlib.machinery
import random
import struct
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import exchange
from exchange.buffers.buffer import DataType
from exchange.errors import BadMagicError, FrameTooLargeError, ProtocolError, UnknownMessageError
from exchange.protocol import codec, frame_parser
from exchange.protocol.codec import (
    DEFAULT_MAX_FRAME_SIZE,
    DEFAULT_READ_AHEAD,
    MAGIC,
    MAX_CONTROL_FRAME_SIZE,
    BufferResponseHeader,
    InPlaceFrameDecoder,
    PayloadReceived,
    encode,
)
from exchange.protocol.messages import (
    AddCredit,
    BufferResponse,
    CloseRequest,
    ErrorCode,
    ErrorResponse,
    Message,
    Ping,
)

PACKAGE = Path(exchange.__file__).resolve().parent


# -- compiled, and only compiled -----------------------------------------------------------


def test_every_pyx_module_is_imported_as_a_built_extension_with_no_python_twin() -> None:
    sources = sorted(PACKAGE.rglob("*.pyx"))
    assert sources, "exchange/ has no Cython sources"
    for pyx in sources:
        name = ".".join(pyx.relative_to(PACKAGE.parent).with_suffix("").parts)
        module = __import__(name, fromlist=["_"])
        assert isinstance(module.__loader__, importlib.machinery.ExtensionFileLoader), (
            f"{name} was imported from {module.__file__}, not the compiled extension"
        )
        assert not pyx.with_suffix(".py").exists(), f"{name} has a pure-Python twin"
        built = Path(module.__file__ or "")
        assert built.stat().st_mtime >= pyx.stat().st_mtime, (
            f"{built.name} is older than {pyx.name}: rebuild it (make setup, or "
            "pip install -e .) before testing"
        )


def test_codec_hands_out_the_compiled_classes() -> None:
    assert codec.InPlaceFrameDecoder is frame_parser.InPlaceFrameDecoder
    assert codec.BUFFER_RESPONSE_SPEC.parse is frame_parser.parse_buffer_response
    for cls in (InPlaceFrameDecoder, BufferResponseHeader, PayloadReceived):
        assert cls.__module__ == "exchange.protocol.frame_parser"
        with pytest.raises((AttributeError, TypeError)):
            cls.extra_attribute = 1  # type: ignore[attr-defined]  # a C type: no new attributes


# -- streams of many frames, however they arrive --------------------------------------------

SEG = 32 * 1024


def data(rid: int, seq: int, size: int) -> BufferResponse:
    payload = bytes((seq + i) % 251 for i in range(size))
    return BufferResponse(rid, seq, seq % 7, DataType.DATA_BUFFER, seq % 2 == 0, payload)


def event(rid: int, seq: int) -> BufferResponse:
    return BufferResponse(rid, seq, 0, DataType.EVENT_BUFFER, False, b"\x00\x01\x02")


CONTROL: list[Message] = [
    AddCredit(3, 2),
    Ping(),
    ErrorResponse(ErrorCode.PRODUCER_FAILED, "died: \u2603", 9),
    CloseRequest(),
]


class Segments:
    """A body sink: a fresh 'segment' per data buffer; events are decoded inline."""

    def __init__(self) -> None:
        self.handed: list[bytearray] = []

    def __call__(self, header: BufferResponseHeader) -> memoryview | None:
        if not header.data_type.is_buffer:
            return None
        seg = bytearray(SEG)
        self.handed.append(seg)
        return memoryview(seg)[: header.size]


def expected(msgs: list[Message]) -> list[Any]:
    out: list[Any] = []
    for m in msgs:
        if isinstance(m, BufferResponse) and m.data_type.is_buffer:
            h = BufferResponseHeader(
                m.receiver_id, m.sequence_number, m.backlog, m.data_type, m.compressed, m.size
            )
            out.append((h, bytes(m.payload)))
        else:
            out.append(m)
    return out


def transport(dec: InPlaceFrameDecoder, stream: bytes, reads: list[int]) -> list[Any]:
    """Deliver ``stream`` as a socket would: each read fills at most what ``get_buffer()``
    offered, and at most the next of ``reads`` (cycled) bytes."""
    out: list[Any] = []
    pos, i = 0, 0
    while pos < len(stream):
        buf = dec.get_buffer(-1)
        assert buf.nbytes > 0 and not buf.readonly
        k = min(buf.nbytes, len(stream) - pos, reads[i % len(reads)])
        i += 1
        buf[:k] = stream[pos : pos + k]
        pos += k
        out.extend(dec.buffer_updated(k))
    return out


def normalized(items: list[Any], sink: Segments) -> list[Any]:
    landed = [i for i in items if isinstance(i, PayloadReceived)]
    assert [i.payload.obj for i in landed] == sink.handed  # each in its own segment, in order
    return [(i.header, bytes(i.payload)) if isinstance(i, PayloadReceived) else i for i in items]


@st.composite
def streams(draw: st.DrawFn) -> list[Message]:
    kinds = st.sampled_from(["data", "big", "empty", "event", "control"])
    msgs: list[Message] = []
    for seq, kind in enumerate(draw(st.lists(kinds, min_size=1, max_size=24))):
        rid = draw(st.integers(0, 2**64 - 1))
        if kind == "data":
            msgs.append(data(rid, seq, draw(st.integers(1, 3000))))
        elif kind == "big":
            msgs.append(data(rid, seq, SEG))
        elif kind == "empty":
            msgs.append(data(rid, seq, 0))
        elif kind == "event":
            msgs.append(event(rid, seq))
        else:
            msgs.append(draw(st.sampled_from(CONTROL)))
    return msgs


READ_AHEADS = st.sampled_from([9, 10, 31, 64, 1024, 40_000, 256 * 1024])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams(), READ_AHEADS, st.randoms(use_true_random=False))
def test_many_frames_decode_exactly_in_one_chunk_by_byte_and_in_random_chunkings(
    msgs: list[Message], read_ahead: int, rng: random.Random
) -> None:
    stream = b"".join(b"".join(encode(m)) for m in msgs)
    want = expected(msgs)
    chunkings = {
        "one chunk": [len(stream)],
        "random": [rng.randint(1, 70_000) for _ in range(rng.randint(1, 20))],
        "small random": [rng.randint(1, 40) for _ in range(rng.randint(1, 20))],
    }
    if len(stream) < 20_000:
        chunkings["byte by byte"] = [1]
    for name, reads in chunkings.items():
        sink = Segments()
        dec = InPlaceFrameDecoder(DEFAULT_MAX_FRAME_SIZE, body_sink=sink, read_ahead=read_ahead)
        got = normalized(transport(dec, stream, reads), sink)
        assert got == want, name
        assert dec.buffered == 0 and not dec.landing and dec.error is None
        assert dec.bytes_received == len(stream)


def test_a_read_of_many_frames_is_parsed_in_one_call() -> None:
    msgs: list[Message] = [data(1, i, 4096) for i in range(20)]
    stream = b"".join(b"".join(encode(m)) for m in msgs)
    sink = Segments()
    dec = InPlaceFrameDecoder(body_sink=sink)
    first = len(b"".join(encode(msgs[0])))
    got = transport(dec, stream[:first], [1 << 20])  # the first payload: batching begins
    rest = len(stream) - first
    buf = dec.get_buffer(-1)
    assert buf.nbytes >= rest  # one read may carry the rest of the batch
    buf[:rest] = stream[first:]
    got += dec.buffer_updated(rest)
    assert normalized(got, sink) == expected(msgs)


def test_the_scratch_stays_small_until_a_payload_lands() -> None:
    """A connection that receives no data (not authenticated yet, control frames only)
    holds a 4 KiB scratch, not ``read_ahead``."""
    control = b"".join(b"".join(encode(m)) for m in CONTROL * 50)
    sink = Segments()
    dec = InPlaceFrameDecoder(body_sink=sink)
    assert transport(dec, control, [1 << 20]) == CONTROL * 50
    assert dec.get_buffer(-1).nbytes <= MAX_CONTROL_FRAME_SIZE
    transport(dec, b"".join(encode(event(1, 0))), [1 << 20])  # declined by the sink
    assert dec.get_buffer(-1).nbytes <= MAX_CONTROL_FRAME_SIZE
    transport(dec, b"".join(encode(data(1, 1, 10))), [1 << 20])
    assert dec.get_buffer(-1).nbytes == DEFAULT_READ_AHEAD


# -- hostile headers: the codec's typed errors, same messages, however they arrive ----------


def header(length: int, magic: int = MAGIC, msg_id: int = 11) -> bytes:
    return struct.pack(">IIB", length, magic, msg_id)


HOSTILE: list[tuple[bytes, ProtocolError]] = [
    (header(DEFAULT_MAX_FRAME_SIZE + 1), FrameTooLargeError(DEFAULT_MAX_FRAME_SIZE + 1, 32832)),
    (header(20, 0xCAFEBABE), BadMagicError(0xCAFEBABE, MAGIC)),
    (header(9, msg_id=99), UnknownMessageError(99)),
    (header(5), ProtocolError("frame length 5 is shorter than the frame header")),
    (header(20) + bytes(11), ProtocolError("frame 11 of 20 bytes is too short")),
    (
        struct.pack(">IIBQIIBBI", 41, MAGIC, 11, 1, 0, 0, 0, 0, 11),
        ProtocolError("BufferResponse declares 11 payload bytes, has 10"),
    ),
    (
        struct.pack(">IIBQIIBBI", 41, MAGIC, 11, 1, 0, 0, 9, 0, 10),
        ProtocolError("BufferResponse with unknown data type 9"),
    ),
    (
        struct.pack(">IIBQIIBBI", 41, MAGIC, 11, 1, 0, 0, 0, 2, 10),
        ProtocolError("compressed must be 0 or 1, got 2"),
    ),
]


@pytest.mark.parametrize(("bad", "error"), HOSTILE, ids=lambda v: type(v).__name__)
@pytest.mark.parametrize("reads", [[1], [3, 50], [1 << 20]], ids=["bytes", "mixed", "whole"])
def test_hostile_headers_raise_the_typed_error_with_its_message(
    bad: bytes, error: ProtocolError, reads: list[int]
) -> None:
    assert DEFAULT_MAX_FRAME_SIZE == 32832
    good = b"".join(b"".join(encode(m)) for m in [data(1, 0, 100), *CONTROL[:2]])
    sink = Segments()
    dec = InPlaceFrameDecoder(body_sink=sink)
    with pytest.raises(type(error)) as info:
        transport(dec, good + bad + bytes(64), reads)
    assert str(info.value) == str(error)
    assert dec.error is info.value
    with pytest.raises(type(error)):  # poisoned
        dec.feed(b"".join(encode(Ping())))
