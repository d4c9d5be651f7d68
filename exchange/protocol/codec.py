"""Framing: messages to bytes and back, without I/O.

A frame is ``length u32 | magic u32 | id u8 | body`` (big-endian), ``length`` counting the
whole frame. ``encode`` returns pieces for ``transport.writelines``; a ``BufferResponse``'s
payload is one of them, never copied.

Decoding is the compiled ``InPlaceFrameDecoder`` (``frame_parser.pyx``, re-exported here),
which takes its tables (``_DECODERS``, the data-frame specs) from this module. The
independent pure-Python decoder the fuzz targets compare it with lives in
``tests/kit/reference_frame_decoder.py``: tests only.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from exchange.errors import (
    BadMagicError,
    FrameTooLargeError,
    ProtocolError,
    UnknownMessageError,
    UsageError,
)
from exchange.partition.result_partition_id import MAX_DATASET_ID_BYTES, ResultPartitionID
from exchange.protocol.messages import (
    MAC_SIZE,
    MAX_ERROR_MESSAGE_BYTES,
    NONCE_SIZE,
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
    Message,
    MessageId,
    NewBufferSize,
    PartitionRequest,
    Ping,
    Pong,
    ResumeConsumption,
    ServerHello,
)

__all__ = [
    "BUFFER_RESPONSE_HEADER_SIZE",
    "BUFFER_RESPONSE_SPEC",
    "DEFAULT_MAX_FRAME_SIZE",
    "DEFAULT_READ_AHEAD",
    "DRIVER_MESSAGE_IDS",
    "FRAME_HEADER_SIZE",
    "LOCAL_ENDPOINT_MESSAGE_IDS",
    "MAGIC",
    "MAX_CONTROL_FRAME_SIZE",
    "BodySink",
    "BufferResponseHeader",
    "DataFrameSpec",
    "InPlaceFrameDecoder",
    "PayloadReceived",
    "encode",
    "encode_buffer_response_header",
    "max_frame_size_for",
    "register_message",
    "unregister_message",
]

FRAME_HEADER_SIZE: Final = 9
MAGIC: Final = 0xBADC0FFE
# Frame header plus BufferResponse's fixed fields: receiver, sequence, backlog, type,
# compressed, size.
BUFFER_RESPONSE_HEADER_SIZE: Final = 31
# Room above the segment size for the BufferResponse header.
FRAME_SLACK: Final = 64
# Every built-in control frame fits (the largest is an ErrorResponse with a full message).
MAX_CONTROL_FRAME_SIZE: Final = 4096
DEFAULT_MAX_FRAME_SIZE: Final = 32 * 1024 + FRAME_SLACK
# Reserved for the daemon's local-endpoint protocol, added with ``register_message``.
LOCAL_ENDPOINT_MESSAGE_IDS: Final = range(64, 128)
# Reserved for the driver's services (control, rendezvous: ``driver_messages``), likewise.
DRIVER_MESSAGE_IDS: Final = range(128, 160)

Piece = bytes | memoryview
_M = TypeVar("_M", bound=Message)

_HEADER: Final = struct.Struct(">IIB")
_BR_HEADER: Final = struct.Struct(">IIBQIIBBI")
_BR_BODY: Final = struct.Struct(">QIIBBI")
_CLIENT_HELLO: Final = struct.Struct(f">IIBH{NONCE_SIZE}s")
_SERVER_HELLO: Final = struct.Struct(f">IIBHB{NONCE_SIZE}s")
_MAC: Final = struct.Struct(f">IIB{MAC_SIZE}s")
_PR_TAIL: Final = struct.Struct(">IQIQI")
_ID_U32: Final = struct.Struct(">IIBQI")
_ID: Final = struct.Struct(">IIBQ")
_ERR_FIXED: Final = struct.Struct(">HBQH")
_U16: Final = struct.Struct(">H")
_U32: Final = struct.Struct(">I")

_DATA_TYPES: Final = tuple(sorted(DataType))
_N_DATA_TYPES: Final = len(_DATA_TYPES)
assert [int(t) for t in _DATA_TYPES] == list(range(_N_DATA_TYPES))
_ERROR_CODES: Final = {int(c): c for c in ErrorCode}
_CLOSE_REQUEST_FRAME: Final = _HEADER.pack(FRAME_HEADER_SIZE, MAGIC, MessageId.CLOSE_REQUEST)
_CLOSE_REQUEST: Final = CloseRequest()
_PING_FRAME: Final = _HEADER.pack(FRAME_HEADER_SIZE, MAGIC, MessageId.PING)
_PING: Final = Ping()
_PONG_FRAME: Final = _HEADER.pack(FRAME_HEADER_SIZE, MAGIC, MessageId.PONG)
_PONG: Final = Pong()


def max_frame_size_for(segment_size: int) -> int:
    """The frame limit that fits a full segment in a ``BufferResponse``."""
    if not isinstance(segment_size, int) or segment_size <= 0:
        raise UsageError(f"segment_size must be a positive int, got {segment_size!r}")
    return max(segment_size + FRAME_SLACK, MAX_CONTROL_FRAME_SIZE)


# -- encoding -----------------------------------------------------------------------------


def encode_buffer_response_header(
    receiver_id: int,
    sequence_number: int,
    backlog: int,
    data_type: int,
    compressed: bool,
    payload_size: int,
) -> bytes:
    """Frame header and fixed fields of a ``BufferResponse``; the payload follows as is."""
    if data_type >= _N_DATA_TYPES:
        raise UsageError(f"invalid data_type {data_type!r}")
    try:
        return _BR_HEADER.pack(
            payload_size + BUFFER_RESPONSE_HEADER_SIZE,
            MAGIC,
            11,
            receiver_id,
            sequence_number,
            backlog,
            data_type,
            1 if compressed else 0,
            payload_size,
        )
    except struct.error as exc:
        raise UsageError(f"cannot encode BufferResponse header: {exc}") from exc


def _piece_size(piece: Piece) -> int:
    return piece.nbytes if isinstance(piece, memoryview) else len(piece)


def _enc_buffer_response(m: BufferResponse) -> list[Piece]:
    p = m.payload
    header = encode_buffer_response_header(
        m.receiver_id, m.sequence_number, m.backlog, m.data_type, m.compressed, _piece_size(p)
    )
    return [header, p]


def _enc_client_hello(m: ClientHello) -> list[Piece]:
    s = _CLIENT_HELLO
    return [s.pack(s.size, MAGIC, MessageId.CLIENT_HELLO, m.version, m.client_nonce)]


def _enc_server_hello(m: ServerHello) -> list[Piece]:
    s = _SERVER_HELLO
    auth = 1 if m.auth_required else 0
    return [s.pack(s.size, MAGIC, MessageId.SERVER_HELLO, m.version, auth, m.server_nonce)]


def _enc_auth_response(m: AuthResponse) -> list[Piece]:
    app = m.app_id.encode("utf-8")
    head = _MAC.pack(_MAC.size + 1 + len(app), MAGIC, MessageId.AUTH_RESPONSE, m.mac)
    return [b"".join((head, bytes((len(app),)), app))]


def _enc_auth_ok(m: AuthOk) -> list[Piece]:
    return [_MAC.pack(_MAC.size, MAGIC, MessageId.AUTH_OK, m.server_proof)]


def _enc_partition_request(m: PartitionRequest) -> list[Piece]:
    pid = m.partition_id
    name = pid.dataset_id.encode("utf-8")
    tail = _PR_TAIL.pack(
        pid.partition_index, pid.attempt_id, m.subpartition_index, m.receiver_id, m.initial_credit
    )
    if m.floating_credit is not None:
        tail += _U32.pack(m.floating_credit)
    size = FRAME_HEADER_SIZE + _U16.size + len(name) + len(tail)
    head = _HEADER.pack(size, MAGIC, MessageId.PARTITION_REQUEST) + _U16.pack(len(name))
    return [b"".join((head, name, tail))]


def _enc_add_credit(m: AddCredit) -> list[Piece]:
    return [_ID_U32.pack(_ID_U32.size, MAGIC, MessageId.ADD_CREDIT, m.receiver_id, m.credit)]


def _enc_new_buffer_size(m: NewBufferSize) -> list[Piece]:
    s = _ID_U32
    return [s.pack(s.size, MAGIC, MessageId.NEW_BUFFER_SIZE, m.receiver_id, m.buffer_size)]


def _enc_resume_consumption(m: ResumeConsumption) -> list[Piece]:
    return [_ID.pack(_ID.size, MAGIC, MessageId.RESUME_CONSUMPTION, m.receiver_id)]


def _enc_cancel_partition_request(m: CancelPartitionRequest) -> list[Piece]:
    return [_ID.pack(_ID.size, MAGIC, MessageId.CANCEL_PARTITION_REQUEST, m.receiver_id)]


def _enc_close_request(m: CloseRequest) -> list[Piece]:
    return [_CLOSE_REQUEST_FRAME]


def _enc_ping(m: Ping) -> list[Piece]:
    return [_PING_FRAME]


def _enc_pong(m: Pong) -> list[Piece]:
    return [_PONG_FRAME]


def _enc_error_response(m: ErrorResponse) -> list[Piece]:
    text = m.message.encode("utf-8")
    size = FRAME_HEADER_SIZE + _ERR_FIXED.size + len(text)
    rid = m.receiver_id
    fixed = _ERR_FIXED.pack(m.code, rid is not None, rid or 0, len(text))
    return [b"".join((_HEADER.pack(size, MAGIC, MessageId.ERROR_RESPONSE), fixed, text))]


_ENCODERS: dict[type[Message], Callable[[Any], list[Piece]]] = {
    ClientHello: _enc_client_hello,
    ServerHello: _enc_server_hello,
    AuthResponse: _enc_auth_response,
    AuthOk: _enc_auth_ok,
    PartitionRequest: _enc_partition_request,
    BufferResponse: _enc_buffer_response,
    AddCredit: _enc_add_credit,
    ResumeConsumption: _enc_resume_consumption,
    NewBufferSize: _enc_new_buffer_size,
    CancelPartitionRequest: _enc_cancel_partition_request,
    CloseRequest: _enc_close_request,
    ErrorResponse: _enc_error_response,
    Ping: _enc_ping,
    Pong: _enc_pong,
}


def encode(msg: Message) -> list[Piece]:
    """The frame of ``msg`` as pieces for ``writelines`` (payloads are not copied)."""
    enc = _ENCODERS.get(type(msg))
    if enc is None:
        raise UsageError(f"no encoder registered for {type(msg).__name__}")
    try:
        return enc(msg)
    except struct.error as exc:
        raise UsageError(f"cannot encode {type(msg).__name__}: {exc}") from exc


# -- decoding of bodies -------------------------------------------------------------------
# Each takes the exact body (a read-only memoryview) and rejects anything that does not
# parse exactly. Only ProtocolError may escape: the fuzz tests hold them to it.


def _fixed(body: memoryview, s: struct.Struct, name: str) -> tuple[Any, ...]:
    if len(body) != s.size:
        raise ProtocolError(f"{name} body has {len(body)} bytes, expected {s.size}")
    return s.unpack(body)


def _flag(value: int, what: str) -> bool:
    if value > 1:
        raise ProtocolError(f"{what} must be 0 or 1, got {value}")
    return value == 1


def _utf8(raw: memoryview, what: str) -> str:
    try:
        return str(raw, "utf-8")
    except UnicodeDecodeError as exc:
        raise ProtocolError(f"{what} is not valid UTF-8: {exc}") from None


_CLIENT_HELLO_BODY: Final = struct.Struct(f">H{NONCE_SIZE}s")
_SERVER_HELLO_BODY: Final = struct.Struct(f">HB{NONCE_SIZE}s")
_MAC_BODY: Final = struct.Struct(f">{MAC_SIZE}s")
_ID_U32_BODY: Final = struct.Struct(">QI")
_ID_BODY: Final = struct.Struct(">Q")
_EMPTY_BODY: Final = struct.Struct("")


def _dec_client_hello(body: memoryview) -> Message:
    version, nonce = _fixed(body, _CLIENT_HELLO_BODY, "ClientHello")
    return ClientHello(version, nonce)


def _dec_server_hello(body: memoryview) -> Message:
    version, auth, nonce = _fixed(body, _SERVER_HELLO_BODY, "ServerHello")
    return ServerHello(version, _flag(auth, "ServerHello.auth_required"), nonce)


def _dec_auth_response(body: memoryview) -> Message:
    fixed = _MAC_BODY.size
    if len(body) < fixed + 1:
        raise ProtocolError(f"AuthResponse body of {len(body)} bytes is too short")
    n = body[fixed]
    if len(body) != fixed + 1 + n:
        raise ProtocolError(f"AuthResponse body has {len(body)} bytes, expected {fixed + 1 + n}")
    app_id = _utf8(body[fixed + 1 :], "AuthResponse app_id")
    return AuthResponse(bytes(body[:fixed]), app_id)


def _dec_auth_ok(body: memoryview) -> Message:
    return AuthOk(_fixed(body, _MAC_BODY, "AuthOk")[0])


def _dec_partition_request(body: memoryview) -> Message:
    n = len(body)
    if n < _U16.size + _PR_TAIL.size:
        raise ProtocolError(f"PartitionRequest body of {n} bytes is too short")
    (name_len,) = _U16.unpack_from(body)
    if not 0 < name_len <= MAX_DATASET_ID_BYTES:
        raise ProtocolError(f"PartitionRequest dataset id of {name_len} bytes")
    fixed = _U16.size + name_len + _PR_TAIL.size
    if n not in (fixed, fixed + _U32.size):  # the trailing floating_credit is optional
        raise ProtocolError(
            f"PartitionRequest body has {n} bytes, expected {fixed} or {fixed + _U32.size}"
        )
    dataset_id = _utf8(body[_U16.size : _U16.size + name_len], "dataset id")
    index, attempt, subpartition, receiver, credit = _PR_TAIL.unpack_from(
        body, _U16.size + name_len
    )
    floating = _U32.unpack_from(body, fixed)[0] if n > fixed else None
    pid = ResultPartitionID(dataset_id, index, attempt)
    return PartitionRequest(pid, subpartition, receiver, credit, floating)


def _dec_buffer_response(body: memoryview) -> Message:
    # FrameDecoder._parse inlines these checks on the data path and calls this only to
    # raise the precise error; extension code and the dispatch table see this version.
    n = len(body)
    if n < _BR_BODY.size:
        raise ProtocolError(f"BufferResponse body of {n} bytes is too short")
    rid, seq, backlog, dt, comp, size = _BR_BODY.unpack_from(body)
    if size != n - _BR_BODY.size:
        raise ProtocolError(
            f"BufferResponse declares {size} payload bytes, has {n - _BR_BODY.size}"
        )
    if dt >= _N_DATA_TYPES:
        raise ProtocolError(f"BufferResponse with unknown data type {dt}")
    return BufferResponse(
        rid, seq, backlog, _DATA_TYPES[dt], _flag(comp, "compressed"), body[_BR_BODY.size :]
    )


def _dec_add_credit(body: memoryview) -> Message:
    receiver, credit = _fixed(body, _ID_U32_BODY, "AddCredit")
    if credit == 0:
        raise ProtocolError("AddCredit with zero credit")
    return AddCredit(receiver, credit)


def _dec_new_buffer_size(body: memoryview) -> Message:
    receiver, size = _fixed(body, _ID_U32_BODY, "NewBufferSize")
    if size == 0:
        raise ProtocolError("NewBufferSize of zero bytes")
    return NewBufferSize(receiver, size)


def _dec_resume_consumption(body: memoryview) -> Message:
    return ResumeConsumption(_fixed(body, _ID_BODY, "ResumeConsumption")[0])


def _dec_cancel_partition_request(body: memoryview) -> Message:
    return CancelPartitionRequest(_fixed(body, _ID_BODY, "CancelPartitionRequest")[0])


def _dec_close_request(body: memoryview) -> Message:
    _fixed(body, _EMPTY_BODY, "CloseRequest")
    return _CLOSE_REQUEST


def _dec_ping(body: memoryview) -> Message:
    _fixed(body, _EMPTY_BODY, "Ping")
    return _PING


def _dec_pong(body: memoryview) -> Message:
    _fixed(body, _EMPTY_BODY, "Pong")
    return _PONG


def _dec_error_response(body: memoryview) -> Message:
    n = len(body)
    fixed = _ERR_FIXED.size
    if n < fixed:
        raise ProtocolError(f"ErrorResponse body of {n} bytes is too short")
    raw_code, has_receiver, receiver, text_len = _ERR_FIXED.unpack_from(body)
    code = _ERROR_CODES.get(raw_code)
    if code is None:
        raise ProtocolError(f"ErrorResponse with unknown error code {raw_code}")
    if not _flag(has_receiver, "ErrorResponse.has_receiver") and receiver != 0:
        raise ProtocolError("ErrorResponse without receiver has a non-zero receiver id")
    if text_len > MAX_ERROR_MESSAGE_BYTES:
        raise ProtocolError(
            f"ErrorResponse message of {text_len} bytes exceeds {MAX_ERROR_MESSAGE_BYTES}"
        )
    if n != fixed + text_len:
        raise ProtocolError(f"ErrorResponse body has {n} bytes, expected {fixed + text_len}")
    text = _utf8(body[fixed:], "ErrorResponse message")
    return ErrorResponse(code, text, receiver if has_receiver else None)


_DECODERS: dict[int, Callable[[memoryview], Message]] = {
    MessageId.CLIENT_HELLO: _dec_client_hello,
    MessageId.SERVER_HELLO: _dec_server_hello,
    MessageId.AUTH_RESPONSE: _dec_auth_response,
    MessageId.AUTH_OK: _dec_auth_ok,
    MessageId.PARTITION_REQUEST: _dec_partition_request,
    MessageId.BUFFER_RESPONSE: _dec_buffer_response,
    MessageId.ADD_CREDIT: _dec_add_credit,
    MessageId.RESUME_CONSUMPTION: _dec_resume_consumption,
    MessageId.NEW_BUFFER_SIZE: _dec_new_buffer_size,
    MessageId.CANCEL_PARTITION_REQUEST: _dec_cancel_partition_request,
    MessageId.CLOSE_REQUEST: _dec_close_request,
    MessageId.ERROR_RESPONSE: _dec_error_response,
    MessageId.PING: _dec_ping,
    MessageId.PONG: _dec_pong,
}


# -- extension ----------------------------------------------------------------------------

_EXTENSIONS: dict[int, type[Message]] = {}


def register_message(
    msg_id: int,
    message_type: type[_M],
    decode_body: Callable[[memoryview], _M],
    encode_body: Callable[[_M], Sequence[Piece]],
) -> None:
    """Add a message with an id in ``LOCAL_ENDPOINT_MESSAGE_IDS`` or ``DRIVER_MESSAGE_IDS``
    to ``encode`` and the frame decoder.

    ``decode_body`` gets the exact body as a read-only memoryview (zero-copy when the frame
    arrived in one chunk) and should raise ``ProtocolError`` for a malformed body;
    ``ValueError``, ``LookupError`` and ``struct.error`` are turned into ``ProtocolError``
    too. ``encode_body`` returns the body's pieces; the frame header is added here.
    """
    if msg_id not in LOCAL_ENDPOINT_MESSAGE_IDS and msg_id not in DRIVER_MESSAGE_IDS:
        raise UsageError(
            f"message id {msg_id} outside the reserved ranges "
            f"{LOCAL_ENDPOINT_MESSAGE_IDS.start}..{LOCAL_ENDPOINT_MESSAGE_IDS.stop - 1} and "
            f"{DRIVER_MESSAGE_IDS.start}..{DRIVER_MESSAGE_IDS.stop - 1}"
        )
    if msg_id in _DECODERS:
        raise UsageError(f"message id {msg_id} is already registered")
    if message_type in _ENCODERS:
        raise UsageError(f"{message_type.__name__} is already registered")
    name = message_type.__name__

    def decode(body: memoryview) -> Message:
        try:
            return decode_body(body)
        except ProtocolError:
            raise
        except (ValueError, LookupError, struct.error) as exc:
            raise ProtocolError(f"malformed {name} body: {exc}") from exc

    def encode_frame(msg: _M) -> list[Piece]:
        pieces = list(encode_body(msg))
        size = FRAME_HEADER_SIZE + sum(_piece_size(p) for p in pieces)
        return [_HEADER.pack(size, MAGIC, msg_id), *pieces]

    _DECODERS[msg_id] = decode
    _ENCODERS[message_type] = encode_frame
    _EXTENSIONS[msg_id] = message_type


def unregister_message(msg_id: int) -> None:
    """Remove a message added with ``register_message`` (tests, reloading)."""
    message_type = _EXTENSIONS.pop(msg_id, None)
    if message_type is None:
        raise UsageError(f"message id {msg_id} is not a registered extension")
    del _DECODERS[msg_id]
    del _ENCODERS[message_type]


# -- the decoder --------------------------------------------------------------------------


def _header_error(length: int, magic: int, msg_id: int, limit: int) -> ProtocolError:
    if magic != MAGIC:
        return BadMagicError(magic, MAGIC)
    if length > limit:
        return FrameTooLargeError(length, limit)
    if length < FRAME_HEADER_SIZE:
        return ProtocolError(f"frame length {length} is shorter than the frame header")
    return UnknownMessageError(msg_id)


# -- the in-place decoder (compiled) ---------------------------------------------------------
#
# ``InPlaceFrameDecoder`` is the Cython extension ``exchange.protocol.frame_parser`` (how
# it works is in that module's docstring). Its frames are described here.


@dataclass(frozen=True, slots=True)
class DataFrameSpec:
    """A frame whose payload may land in place: ``prefix_size`` fixed bytes, then payload.

    ``parse(prefix, payload_size)`` gets the fixed fields after the frame header (exactly
    ``prefix_size`` bytes) and returns the header object given to the body sink; it
    raises ``ProtocolError`` when they are malformed (nothing is allocated before).
    """

    prefix_size: int
    parse: Callable[[memoryview, int], Any]


BodySink = Callable[[Any], "memoryview | None"]

# Imported last: the extension takes the tables above from this module.
try:
    from exchange.protocol.frame_parser import (
        DEFAULT_READ_AHEAD,
        BufferResponseHeader,
        InPlaceFrameDecoder,
        PayloadReceived,
        parse_buffer_response,
    )
except ModuleNotFoundError as exc:
    if exc.name != "exchange.protocol.frame_parser":
        raise
    raise ImportError(
        "exchange.protocol.frame_parser is a compiled extension (Cython) and is not built "
        "in this checkout: run `make setup` (or `pip install -e .`) to build it"
    ) from exc

BUFFER_RESPONSE_SPEC: Final = DataFrameSpec(_BR_BODY.size, parse_buffer_response)
