# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The frame parser over a receive buffer, compiled: many frames per read, payloads in place.

How it works: the transport asks ``get_buffer()`` where to put the next bytes and says how
many came with ``buffer_updated(n)`` (``asyncio.BufferedProtocol``'s pair). Reads go to a
scratch bytearray of ``read_ahead`` bytes, parsed by one C loop per read: every frame
complete in it is handled in that call, a header or a control frame split across reads
is parsed where it lies once the rest has arrived (the pending bytes are moved to the
front of the scratch, never joined from pieces). A *data frame* (an id with a
``DataFrameSpec``) is checked up to the end of its fixed fields (a ``BufferResponse``'s in
C, with no Python call), then handed to the body sink: the sink returns the memoryview
the payload must land in (a credited segment). The payload bytes already read are copied
there (one ``memcpy``); the rest, if any, is received straight into the segment:
``get_buffer()`` returns that view until it is full. When the sink returns None the frame
is decoded like any other one, from the scratch.

Memory: the scratch starts at 4 KiB (``MAX_CONTROL_FRAME_SIZE``) and reads are that
small until the body sink first takes a payload; only then does it grow to
``read_ahead``. So a connection that never receives data (the data port's inbound side,
a peer that has not authenticated, a producer's connection) never holds more.

Hostile input: the frame header is checked (magic, length limit, known and accepted id)
as soon as its 9 bytes are in, before anything is allocated or the sink is asked. Errors,
from the stream or raised by the sink, poison the decoder: every later
``buffer_updated``/``feed`` raises the first one again. The messages and limits are
``exchange.protocol.codec``'s (its ``_DECODERS`` decode control frame bodies).

There is no Python version of this module: a build without a C compiler fails at install
(``tests/protocol/test_frame_parser.py`` checks that the imported module is the built
extension).
"""

from cpython.buffer cimport PyBUF_C_CONTIGUOUS, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytearray cimport PyByteArray_AS_STRING
from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.string cimport memcpy, memmove

from exchange.errors import ProtocolError, UnknownMessageError, UsageError, fresh_error
from exchange.protocol.codec import (
    _DATA_TYPES,
    _DECODERS,
    DEFAULT_MAX_FRAME_SIZE,
    FRAME_HEADER_SIZE as _PY_FRAME_HEADER_SIZE,
    MAGIC as _PY_MAGIC,
    MAX_CONTROL_FRAME_SIZE,
    _header_error,
)

__all__ = [
    "DEFAULT_READ_AHEAD",
    "BufferResponseHeader",
    "InPlaceFrameDecoder",
    "PayloadReceived",
    "parse_buffer_response",
]

cdef enum:
    HEADER = 9  # length u32 | magic u32 | id u8
    BR_PREFIX = 22  # receiver u64 | seq u32 | backlog u32 | type u8 | compressed u8 | size u32
    BUFFER_RESPONSE_ID = 11

assert _PY_FRAME_HEADER_SIZE == HEADER
cdef unsigned int _MAGIC = _PY_MAGIC
cdef Py_ssize_t _N_DATA_TYPES = len(_DATA_TYPES)
cdef tuple _DATA_TYPE_TUPLE = tuple(_DATA_TYPES)
cdef dict _DECODER_TABLE = _DECODERS  # the codec's table itself: register_message adds to it

#: Bytes read per ``get_buffer()`` outside a payload's landing: a batch of frames per read.
DEFAULT_READ_AHEAD = 256 * 1024

cdef object _default_data_frames = None


cdef inline unsigned int _u32(const unsigned char* p) noexcept nogil:
    return ((<unsigned int>p[0]) << 24) | ((<unsigned int>p[1]) << 16) | (
        (<unsigned int>p[2]) << 8) | (<unsigned int>p[3])


cdef inline unsigned long long _u64(const unsigned char* p) noexcept nogil:
    return ((<unsigned long long>_u32(p)) << 32) | (<unsigned long long>_u32(p + 4))


cdef class BufferResponseHeader:
    """The fixed fields of a ``BufferResponse``, checked; ``size`` is the payload's."""

    def __init__(
        self,
        unsigned long long receiver_id,
        unsigned int sequence_number,
        unsigned int backlog,
        object data_type,
        bint compressed,
        Py_ssize_t size,
    ):
        self.receiver_id = receiver_id
        self.sequence_number = sequence_number
        self.backlog = backlog
        self.data_type = data_type
        self.compressed = compressed
        self.size = size

    def _fields(self):
        return (
            self.receiver_id,
            self.sequence_number,
            self.backlog,
            self.data_type,
            self.compressed,
            self.size,
        )

    def __eq__(self, other):
        if type(other) is not BufferResponseHeader:
            return NotImplemented
        return self._fields() == (<BufferResponseHeader>other)._fields()

    def __hash__(self):
        return hash(self._fields())

    def __repr__(self):
        return (
            f"BufferResponseHeader(receiver_id={self.receiver_id}, "
            f"sequence_number={self.sequence_number}, backlog={self.backlog}, "
            f"data_type={self.data_type!r}, compressed={self.compressed!r}, size={self.size})"
        )


cdef BufferResponseHeader _parse_br(const unsigned char* p, Py_ssize_t payload_size):
    cdef unsigned int size = _u32(p + 18)
    cdef unsigned char dt = p[16]
    cdef unsigned char comp = p[17]
    if size != payload_size:
        raise ProtocolError(f"BufferResponse declares {size} payload bytes, has {payload_size}")
    if dt >= _N_DATA_TYPES:
        raise ProtocolError(f"BufferResponse with unknown data type {dt}")
    if comp > 1:
        raise ProtocolError(f"compressed must be 0 or 1, got {comp}")
    cdef BufferResponseHeader h = BufferResponseHeader.__new__(BufferResponseHeader)
    h.receiver_id = _u64(p)
    h.sequence_number = _u32(p + 8)
    h.backlog = _u32(p + 12)
    h.data_type = _DATA_TYPE_TUPLE[dt]
    h.compressed = comp == 1
    h.size = payload_size
    return h


def parse_buffer_response(prefix, Py_ssize_t payload_size):
    """``DataFrameSpec.parse`` of a BufferResponse: its 22 fixed bytes, checked."""
    cdef Py_buffer pb
    PyObject_GetBuffer(prefix, &pb, PyBUF_C_CONTIGUOUS)
    try:
        if pb.len < BR_PREFIX:
            raise ProtocolError(f"BufferResponse fixed fields of {pb.len} bytes, expected 22")
        return _parse_br(<const unsigned char*>pb.buf, payload_size)
    finally:
        PyBuffer_Release(&pb)


cdef class PayloadReceived:
    """A data frame whose payload landed in the view its body sink returned."""

    def __init__(self, header, payload):
        self.header = header
        self.payload = payload

    def __eq__(self, other):
        if type(other) is not PayloadReceived:
            return NotImplemented
        o = <PayloadReceived>other
        return self.header == o.header and self.payload == o.payload

    __hash__ = None

    def __repr__(self):
        return f"PayloadReceived(header={self.header!r}, payload={self.payload!r})"


cdef inline PayloadReceived _received(object header, object payload):
    cdef PayloadReceived r = PayloadReceived.__new__(PayloadReceived)
    r.header = header
    r.payload = payload
    return r


cdef class InPlaceFrameDecoder:
    """Sans-I/O frame decoder for ``BufferedProtocol``: data payloads land in place.

    ``body_sink(header) -> memoryview | None`` is called once per data frame (ids in
    ``data_frames``) with the parsed, checked header: return a writable view of exactly
    the payload's size to receive the payload there (a ``PayloadReceived`` is emitted once
    it is full), or None to have the frame decoded as an ordinary ``Message``. ``accept``
    limits the message ids this side decodes (None: every registered id); any other id is
    an ``UnknownMessageError``. ``read_ahead``: the bytes one read may bring outside a
    payload's landing (frames parsed per call). Errors, from the stream or raised by the
    sink, poison the decoder: every later ``buffer_updated``/``feed`` raises the first one
    again.
    """

    def __init__(
        self,
        max_frame_size=DEFAULT_MAX_FRAME_SIZE,
        *,
        body_sink=None,
        data_frames=None,
        accept=None,
        read_ahead=DEFAULT_READ_AHEAD,
    ):
        global _default_data_frames
        if not isinstance(max_frame_size, int) or max_frame_size < MAX_CONTROL_FRAME_SIZE:
            raise UsageError(
                f"max_frame_size must be an int >= {MAX_CONTROL_FRAME_SIZE}, got {max_frame_size!r}"
            )
        if not isinstance(read_ahead, int) or read_ahead < HEADER:
            raise UsageError(f"read_ahead must be an int >= {HEADER}, got {read_ahead!r}")
        if data_frames is None:
            if _default_data_frames is None:
                from exchange.protocol.codec import BUFFER_RESPONSE_SPEC

                _default_data_frames = {BUFFER_RESPONSE_ID: BUFFER_RESPONSE_SPEC}
            data_frames = _default_data_frames
        self._max_frame_size = max_frame_size
        self._sink = body_sink
        self._data_frames = dict(data_frames) if body_sink else {}
        self._accept = frozenset(accept) if accept is not None else None
        self._read_ahead = read_ahead
        # Reads stay small until the sink first takes a payload (see the module's doc).
        self._want = min(read_ahead, MAX_CONTROL_FRAME_SIZE)
        self._scratch = bytearray(MAX_CONTROL_FRAME_SIZE)
        self._view = memoryview(self._scratch)
        self._start = 0  # first undecoded byte in the scratch
        self._end = 0  # end of the received bytes in the scratch
        self._frame_len = -1  # length of the pending frame once its header is in, else -1
        self._msg_id = 0
        self._inline = False  # the pending data frame is decoded from the scratch
        self._target = None  # where the pending payload lands
        self._target_size = 0
        self._filled = 0
        self._header = None
        self._error = None
        self.bytes_received = 0

    @property
    def max_frame_size(self):
        """The largest frame accepted; settable (a connection that authenticates in its
        first frame raises it once it has): applies to frames whose header has not
        arrived yet."""
        return self._max_frame_size

    @max_frame_size.setter
    def max_frame_size(self, value):
        if not isinstance(value, int) or value < MAX_CONTROL_FRAME_SIZE:
            raise UsageError(
                f"max_frame_size must be an int >= {MAX_CONTROL_FRAME_SIZE}, got {value!r}"
            )
        self._max_frame_size = value

    @property
    def error(self):
        """The error that poisoned the decoder, if any."""
        return self._error

    @property
    def buffered(self):
        """Bytes of an incomplete frame received (non-zero: the stream ended mid-frame)."""
        return self._end - self._start + self._filled

    @property
    def landing(self):
        """True while a payload is being received into a sink's view."""
        return self._target is not None

    def get_buffer(self, Py_ssize_t sizehint=-1):
        """Where the transport should write the next bytes (never empty)."""
        cdef Py_ssize_t start, end, avail, need, want, size
        if self._target is not None:
            return self._target[self._filled:]
        if self._error is not None:
            return self._view  # discarded: the stream is dead
        start = self._start
        end = self._end
        if start == end:
            start = end = self._start = self._end = 0
        avail = end - start
        if self._frame_len < 0:
            need = HEADER - avail
        else:
            spec = self._data_frames.get(self._msg_id) if self._data_frames else None
            if spec is not None and not self._inline:
                need = HEADER + <Py_ssize_t>spec.prefix_size - avail
            else:
                need = self._frame_len - avail
        want = need if need > self._want else self._want
        size = len(self._scratch)
        if size - end < want:
            if start:  # compact: the pending bytes move to the front
                buf = PyByteArray_AS_STRING(self._scratch)
                memmove(buf, buf + start, avail)
                self._start = 0
                self._end = end = avail
            if size - end < need:  # a control frame larger than the scratch
                self._grow(end + need)
                size = len(self._scratch)
            elif size < self._want and size - end < want:  # batching began: read_ahead
                self._grow(self._want)
                size = len(self._scratch)
        return self._view[end : min(end + want, size)]

    cdef void _grow(self, Py_ssize_t size) except *:
        cdef bytearray bigger = bytearray(size)
        memcpy(PyByteArray_AS_STRING(bigger), PyByteArray_AS_STRING(self._scratch), self._end)
        self._view.release()
        self._scratch = bigger
        self._view = memoryview(bigger)

    def buffer_updated(self, Py_ssize_t nbytes):
        """``nbytes`` were written into the last ``get_buffer()``; the frames completed."""
        if self._error is not None:
            raise fresh_error(self._error)
        self.bytes_received += nbytes
        cdef list out = []
        try:
            if self._target is not None:
                self._filled += nbytes
                if self._filled < self._target_size:
                    return out
                self._land(out)
                if self._start == self._end:
                    return out  # the payload ended the received bytes: nothing to parse
            else:
                self._end += nbytes
            self._parse(out)
        except ProtocolError as exc:
            self._poison(exc)
            raise
        except BaseException as exc:
            self._poison(ProtocolError(f"decoding stopped by {type(exc).__name__}: {exc}"))
            raise
        return out

    def feed(self, data):
        """Copy ``data`` in as the transport would and decode (tests, plain Protocols)."""
        cdef list out = []
        src = memoryview(data).cast("B")
        cdef Py_ssize_t pos = 0, n = src.nbytes, k
        if self._error is not None:
            raise fresh_error(self._error)
        while pos < n:
            buf = self.get_buffer()
            k = min(buf.nbytes, n - pos)
            buf[:k] = src[pos : pos + k]
            pos += k
            out.extend(self.buffer_updated(k))
        return out

    def abort(self, error=None):
        """Stop decoding (the connection died): forget any sink view, discard all input.

        A view the sink handed out is never written again after this returns.
        """
        if self._error is None:
            self._poison(error or ProtocolError("the connection was aborted"))

    cdef void _poison(self, object exc):
        self._error = exc
        self._target = None
        self._header = None
        self._start = self._end = self._filled = 0

    cdef void _land(self, list out):
        out.append(_received(self._header, self._target))
        self._target = None
        self._header = None
        self._filled = 0
        self._frame_len = -1

    cdef object _decode_control(self, Py_ssize_t start, Py_ssize_t length, int msg_id):
        cdef char* buf = PyByteArray_AS_STRING(self._scratch)
        body = PyBytes_FromStringAndSize(buf + start + HEADER, length - HEADER)
        return _DECODER_TABLE[msg_id](memoryview(body))

    cdef void _parse(self, list out) except *:
        """Every frame complete in the scratch, in one loop; stops at an incomplete one
        or when a payload lands in its sink's view."""
        cdef const unsigned char* buf = <const unsigned char*>PyByteArray_AS_STRING(
            self._scratch
        )
        cdef Py_ssize_t start = self._start, end = self._end
        cdef Py_ssize_t avail, length, fixed, payload_size, have, pos
        cdef Py_ssize_t limit = self._max_frame_size
        cdef unsigned int magic
        cdef int msg_id
        cdef Py_buffer pb
        cdef dict data_frames = self._data_frames
        while True:
            avail = end - start
            length = self._frame_len
            if length < 0:
                if avail < HEADER:
                    break
                length = _u32(buf + start)
                magic = _u32(buf + start + 4)
                msg_id = buf[start + 8]
                if magic != _MAGIC or length < HEADER or length > limit:
                    raise _header_error(length, magic, msg_id, limit)
                if msg_id not in _DECODER_TABLE or (
                    self._accept is not None and msg_id not in self._accept
                ):
                    raise UnknownMessageError(msg_id)
                self._frame_len = length
                self._msg_id = msg_id
                self._inline = False
            msg_id = self._msg_id
            spec = data_frames.get(msg_id) if data_frames else None
            if spec is not None and not self._inline:
                fixed = HEADER + <Py_ssize_t>spec.prefix_size
                if length < fixed:
                    raise ProtocolError(f"frame {msg_id} of {length} bytes is too short")
                if avail < fixed:
                    break
                payload_size = length - fixed
                parse = spec.parse
                if parse is parse_buffer_response:
                    header = _parse_br(buf + start + HEADER, payload_size)
                else:
                    header = parse(self._view[start + HEADER : start + fixed], payload_size)
                target = self._sink(header)
                if target is None:
                    self._inline = True
                else:
                    have = avail - fixed
                    if have > payload_size:
                        have = payload_size
                    pos = start + fixed
                    PyObject_GetBuffer(target, &pb, PyBUF_C_CONTIGUOUS)
                    try:
                        if pb.len != payload_size or pb.readonly:
                            raise UsageError(
                                f"body sink returned a view of {pb.len} bytes for a "
                                f"{payload_size}-byte payload (writable, exact size needed)"
                            )
                        memcpy(pb.buf, buf + pos, have)
                    finally:
                        PyBuffer_Release(&pb)
                    start = pos + have
                    self._start = start
                    self._want = self._read_ahead  # data flows: read batches from now on
                    self._target = target
                    self._target_size = payload_size
                    self._header = header
                    self._filled = have
                    if have < payload_size:
                        return  # the rest lands straight in the target
                    self._land(out)
                    continue
            if avail < length:
                break
            out.append(self._decode_control(start, length, msg_id))
            start += length
            self._start = start
            self._frame_len = -1
        self._start = start
