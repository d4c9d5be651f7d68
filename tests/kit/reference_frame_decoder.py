"""An independent, pure-Python frame decoder: the oracle the fuzz targets compare the
compiled ``InPlaceFrameDecoder`` with (tests only; production decodes with the compiled one).

How it works, differently from the compiled parser on purpose: a chunk that holds whole
frames is parsed in place, and a ``BufferResponse`` payload is a memoryview into that very
``bytes`` object. The tail of a chunk that does not complete a frame is kept, with its
offset, in a deque; later chunks are appended until the pending frame is complete, then
only that frame's parts are joined. The frame header is checked (magic, length limit,
known id) as soon as its 9 bytes have arrived. The first ``ProtocolError`` poisons the
decoder: every later ``feed`` raises it again.
"""

from __future__ import annotations

from collections import deque

from exchange.errors import ProtocolError, UsageError, fresh_error
from exchange.protocol.codec import (
    _BR_BODY,
    _DATA_TYPES,
    _DECODERS,
    _HEADER,
    _N_DATA_TYPES,
    BUFFER_RESPONSE_HEADER_SIZE,
    DEFAULT_MAX_FRAME_SIZE,
    FRAME_HEADER_SIZE,
    MAGIC,
    MAX_CONTROL_FRAME_SIZE,
    Piece,
    _dec_buffer_response,
    _header_error,
)
from exchange.protocol.messages import BufferResponse, Message

__all__ = ["FrameDecoder"]


class FrameDecoder:
    """Turns a byte stream into messages; feed it whatever the transport delivers."""

    __slots__ = ("_buffered", "_chunks", "_error", "_frame_len", "_max_frame_size", "_offset")

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        if not isinstance(max_frame_size, int) or max_frame_size < MAX_CONTROL_FRAME_SIZE:
            raise UsageError(
                f"max_frame_size must be an int >= {MAX_CONTROL_FRAME_SIZE}, got {max_frame_size!r}"
            )
        self._max_frame_size = max_frame_size
        # Received bytes not yet decoded: the first chunk from ``_offset`` on, then the rest.
        self._chunks: deque[bytes] = deque()
        self._offset = 0
        self._buffered = 0
        # Length of the pending frame once its header has arrived, else -1.
        self._frame_len = -1
        self._error: ProtocolError | None = None

    @property
    def max_frame_size(self) -> int:
        return self._max_frame_size

    @property
    def buffered(self) -> int:
        """Bytes received but not yet decoded (non-zero: the stream ended mid-frame)."""
        return self._buffered

    @property
    def error(self) -> ProtocolError | None:
        """The error that poisoned the decoder, if any."""
        return self._error

    def feed(self, data: bytes | bytearray | memoryview) -> list[Message]:
        """Decode every frame completed by ``data``; raises ``ProtocolError`` (and poisons)."""
        if self._error is not None:
            raise fresh_error(self._error)
        if type(data) is not bytes:
            # The payload views handed out must not change under the caller's feet.
            data = bytes(data)
        out: list[Message] = []
        if not data:
            return out
        try:
            start = self._complete_pending(data, out) if self._chunks else 0
            if start >= 0:
                self._parse(data, start, out)
        except ProtocolError as exc:
            self._error = exc
            self._chunks.clear()
            self._buffered = 0
            raise
        return out

    def _parse(self, data: bytes, pos: int, out: list[Message]) -> None:
        """Decode the whole frames in ``data[pos:]``; keep an incomplete tail."""
        n = len(data)
        limit = self._max_frame_size
        decoders = _DECODERS
        unpack_header = _HEADER.unpack_from
        unpack_br = _BR_BODY.unpack_from
        append = out.append
        view: memoryview | None = None
        while n - pos >= FRAME_HEADER_SIZE:
            length, magic, msg_id = unpack_header(data, pos)
            if magic != MAGIC or not FRAME_HEADER_SIZE <= length <= limit or msg_id not in decoders:
                raise _header_error(length, magic, msg_id, limit)
            end = pos + length
            if end > n:
                self._keep(data, pos, length)
                return
            if view is None:
                view = memoryview(data)
            if msg_id == 11:  # MessageId.BUFFER_RESPONSE; the data path, so inlined
                if length < BUFFER_RESPONSE_HEADER_SIZE:
                    raise ProtocolError(f"BufferResponse frame of {length} bytes is too short")
                rid, seq, backlog, dt, comp, size = unpack_br(data, pos + FRAME_HEADER_SIZE)
                if size != length - BUFFER_RESPONSE_HEADER_SIZE or dt >= _N_DATA_TYPES or comp > 1:
                    _dec_buffer_response(view[pos + FRAME_HEADER_SIZE : end])  # raises
                    raise ProtocolError("malformed BufferResponse")  # pragma: no cover
                append(
                    BufferResponse(
                        rid,
                        seq,
                        backlog,
                        _DATA_TYPES[dt],
                        comp == 1,
                        view[pos + BUFFER_RESPONSE_HEADER_SIZE : end],
                    )
                )
            else:
                append(decoders[msg_id](view[pos + FRAME_HEADER_SIZE : end]))
            pos = end
        if pos < n:
            self._keep(data, pos, -1)

    def _keep(self, data: bytes, pos: int, frame_len: int) -> None:
        self._chunks.append(data)
        self._offset = pos
        self._buffered = len(data) - pos
        self._frame_len = frame_len

    def _complete_pending(self, data: bytes, out: list[Message]) -> int:
        """Finish the frame begun in earlier chunks; where ``data``'s own frames start, or -1."""
        chunks = self._chunks
        n = len(data)
        buffered = self._buffered
        length = self._frame_len
        if length < 0:
            if buffered + n < FRAME_HEADER_SIZE:
                chunks.append(data)
                self._buffered = buffered + n
                return -1
            header = self._peek_header(data)
            length, magic, msg_id = _HEADER.unpack(header)
            limit = self._max_frame_size
            if (
                magic != MAGIC
                or not FRAME_HEADER_SIZE <= length <= limit
                or msg_id not in _DECODERS
            ):
                raise _header_error(length, magic, msg_id, limit)
            self._frame_len = length
        missing = length - buffered
        if missing > n:
            chunks.append(data)
            self._buffered = buffered + n
            return -1
        parts: list[Piece] = [memoryview(chunks.popleft())[self._offset :]]
        parts.extend(chunks)
        parts.append(memoryview(data)[:missing])
        frame = b"".join(parts)
        chunks.clear()
        self._offset = 0
        self._buffered = 0
        self._frame_len = -1
        self._parse(frame, 0, out)
        return missing

    def _peek_header(self, data: bytes) -> bytes:
        need = FRAME_HEADER_SIZE
        parts: list[bytes] = []
        offset = self._offset
        for chunk in self._chunks:
            piece = chunk[offset : offset + need]
            parts.append(piece)
            need -= len(piece)
            offset = 0
            if need == 0:
                break
        if need:
            parts.append(data[:need])
        return b"".join(parts)
