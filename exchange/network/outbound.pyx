# cython: language_level=3, boundscheck=False, wraparound=False
"""OutboundBatch: what a data-port connection writes in one callback, compiled.

``ServerConnection`` (``server_connection.py``) keeps its lifecycle, its input and its
control messages in Python; the per-buffer part of its output lives here:

* ``send_buffer`` (the request queue calls it once per buffer it sends): the
  BufferResponse header written by C into a 31-byte ``bytes``, the header and a
  zero-copy view of the buffer appended to the callback's output (``out``), the buffer
  remembered with the end offset of its frame in the byte stream; a write outside a
  callback (``corked == 0``), or output reaching the batch size, is flushed by the
  connection's ``_flush``. A buffer in the consumer's mapped arena goes as a descriptor
  (``_send_shared``, C: the 30-byte SharedBufferResponse entry packed into a ``bytes``,
  the buffer held by segment index in ``held`` until given back, the descriptors of the
  callback framed as one SharedBufferResponse by ``frame_descriptors``, released by index
  at ``give_back``); a connection that is not established recycles the buffer at once.
* ``recycle`` / ``reap``: the buffers of a flush whose bytes the transport no longer holds
  are released in one C loop; a release that raises (a blocking partition's read-ahead
  callback) fails that receiver's channel (``PartitionRequestQueue.fail_reader``), as the
  Python loop did.

Bad header fields (negative or too large for their wire width, an unknown data type)
raise ``UsageError``, as ``codec.encode_buffer_response_header`` does. There is no Python
version of this module; ``outbound.pyi`` types it for mypy.
"""

from collections import deque

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.string cimport memcpy

from exchange.buffers.buffer cimport Buffer
from exchange.memory.memory_segment cimport MemorySegment

from exchange.buffers.buffer import DataType
from exchange.errors import ProtocolError, UsageError
from exchange.protocol.codec import BUFFER_RESPONSE_HEADER_SIZE, FRAME_HEADER_SIZE, MAGIC
from exchange.protocol.local_messages import (
    MAX_SHARED_BUFFERS,
    SHARED_BUFFER_ENTRY_SIZE,
    SharedBufferResponse,
)
from exchange.protocol.messages import BufferResponse

__all__ = ["OutboundBatch", "buffer_response_header"]

cdef object _DATA_BUFFER = DataType.DATA_BUFFER
cdef Py_ssize_t _N_DATA_TYPES = len(DataType)
cdef Py_ssize_t _HEADER = BUFFER_RESPONSE_HEADER_SIZE
cdef unsigned int _MAGIC_C = MAGIC
cdef unsigned char _MESSAGE_ID = BufferResponse.MESSAGE_ID
cdef unsigned long long _U32 = 0xFFFFFFFF

assert _HEADER == 31  # the layout below: >IIBQIIBBI

cdef Py_ssize_t _ENTRY = SHARED_BUFFER_ENTRY_SIZE
cdef Py_ssize_t _MAX_ENTRIES = MAX_SHARED_BUFFERS
cdef Py_ssize_t _FRAME_HEADER = FRAME_HEADER_SIZE
cdef unsigned char _SHARED_ID = SharedBufferResponse.MESSAGE_ID

assert _ENTRY == 30 and _FRAME_HEADER == 9  # the layouts below: >QIIBBIII, >IIB


cdef inline void _be32(unsigned char* p, unsigned long long v) noexcept:
    p[0] = <unsigned char>(v >> 24)
    p[1] = <unsigned char>(v >> 16)
    p[2] = <unsigned char>(v >> 8)
    p[3] = <unsigned char>v


cdef inline void _be64(unsigned char* p, unsigned long long v) noexcept:
    _be32(p, v >> 32)
    _be32(p + 4, v & _U32)


cdef unsigned long long _field(object value, unsigned long long limit, str name) except? 0:
    cdef unsigned long long v
    try:
        v = value
    except (OverflowError, TypeError) as exc:
        raise UsageError(f"cannot encode BufferResponse header: {name} {value!r}") from exc
    if v > limit:
        raise UsageError(f"cannot encode BufferResponse header: {name} {value!r}")
    return v


cdef bytes _header(
    object receiver_id, object sequence_number, object backlog, object data_type,
    bint compressed, Py_ssize_t size,
):
    cdef unsigned long long rid = _field(receiver_id, 0xFFFFFFFFFFFFFFFF, "receiver id")
    cdef unsigned long long seq = _field(sequence_number, _U32, "sequence number")
    cdef unsigned long long bl = _field(backlog, _U32, "backlog")
    cdef Py_ssize_t dt = data_type
    if not 0 <= dt < _N_DATA_TYPES:
        raise UsageError(f"invalid data_type {data_type!r}")
    if size < 0 or <unsigned long long>size + _HEADER > _U32:
        raise UsageError(f"cannot encode BufferResponse header: payload of {size} bytes")
    cdef bytes out = PyBytes_FromStringAndSize(NULL, _HEADER)
    cdef unsigned char* p = <unsigned char*>PyBytes_AS_STRING(out)
    _be32(p, <unsigned long long>size + _HEADER)
    _be32(p + 4, _MAGIC_C)
    p[8] = _MESSAGE_ID
    _be64(p + 9, rid)
    _be32(p + 17, seq)
    _be32(p + 21, bl)
    p[25] = <unsigned char>dt
    p[26] = 1 if compressed else 0
    _be32(p + 27, <unsigned long long>size)
    return out


cdef bytes _shared_entry(
    object receiver_id, object sequence_number, object backlog, bint compressed,
    object segment, Py_ssize_t offset, Py_ssize_t size,
):
    # local_messages.pack_shared_buffer's bytes (data type 0: data buffers only)
    cdef unsigned long long rid = _field(receiver_id, 0xFFFFFFFFFFFFFFFF, "receiver id")
    cdef unsigned long long seq = _field(sequence_number, _U32, "sequence number")
    cdef unsigned long long bl = _field(backlog, _U32, "backlog")
    cdef unsigned long long index = _field(segment, _U32, "segment")
    if offset < 0 or <unsigned long long>offset > _U32:
        raise UsageError(f"cannot encode SharedBufferResponse entry: offset {offset}")
    if size < 0 or <unsigned long long>size > _U32:
        raise UsageError(f"cannot encode SharedBufferResponse entry: size {size}")
    cdef bytes out = PyBytes_FromStringAndSize(NULL, _ENTRY)
    cdef unsigned char* p = <unsigned char*>PyBytes_AS_STRING(out)
    _be64(p, rid)
    _be32(p + 8, seq)
    _be32(p + 12, bl)
    p[16] = 0
    p[17] = 1 if compressed else 0
    _be32(p + 18, index)
    _be32(p + 22, <unsigned long long>offset)
    _be32(p + 26, <unsigned long long>size)
    return out


def buffer_response_header(
    receiver_id, sequence_number, backlog, data_type, compressed, payload_size
):
    """The BufferResponse header (``codec.encode_buffer_response_header``'s bytes), in C."""
    cdef unsigned long long size = _field(payload_size, _U32 - _HEADER, "payload size")
    return _header(
        receiver_id, sequence_number, backlog, data_type, compressed, <Py_ssize_t>size
    )


cdef class OutboundBatch:
    """The output of one connection's current callback, and its buffers in flight."""

    def __init__(self, conn, transport, Py_ssize_t batch_bytes):
        self._conn = conn
        self._transport = transport
        self._fail_reader = None
        self._batch_bytes = batch_bytes
        self.out = []
        self.out_bytes = 0
        self.buffers = []
        self.bytes_written = 0
        self.corked = 0
        self.descriptors = []
        self.established = False
        self._arena = None
        self._arena_segments = None
        self.in_flight = deque()
        self.held = {}
        self.num_held = 0
        self.bytes_shared = 0

    @property
    def arena(self):
        """The arena the consumer mapped (a ``NetworkBufferPool``), or None."""
        return self._arena

    @arena.setter
    def arena(self, arena):
        # its segments' list, fixed for the pool's life: ``NetworkBufferPool.owns`` in C
        self._arena_segments = None if arena is None else arena._segments
        self._arena = arena

    def send_buffer(self, receiver_id, sequence_number, backlog, Buffer buf not None):
        """One BufferResponse: header and zero-copy view into the output, ``buf`` kept
        until its bytes are out (the queue's ``OutboundChannel.send_buffer``)."""
        conn = self._conn
        if not self.established:
            conn._recycle(receiver_id, buf)
            return
        if (
            self._arena_segments is not None
            and buf._data_type is _DATA_BUFFER
            and (<MemorySegment>buf._segment).is_in(self._arena_segments)
        ):
            self._send_shared(receiver_id, sequence_number, backlog, buf)
            return
        if self.descriptors:  # the stream's order: the descriptors before go first
            self.frame_descriptors()
        cdef Py_ssize_t size = buf._size
        header = _header(
            receiver_id, sequence_number, backlog, buf._data_type, buf.compressed, size
        )
        view = buf.memoryview()
        out = self.out
        out.append(header)
        out.append(view)
        self.out_bytes += _HEADER + size
        self.buffers.append((self.bytes_written + self.out_bytes, receiver_id, buf))
        if (
            not self.corked
            or self.out_bytes + <Py_ssize_t>self._transport.get_write_buffer_size()
            >= self._batch_bytes
        ):
            conn._flush()

    cdef int _send_shared(
        self, object receiver_id, object sequence_number, object backlog, Buffer buf
    ) except -1:
        """A SharedBufferResponse entry for ``buf`` (in the consumer's mapped arena):
        held until given back (``ServerConnection.give_back``)."""
        cdef Py_ssize_t size = buf._size
        index = buf._segment.index
        descriptors = self.descriptors
        descriptors.append(
            _shared_entry(
                receiver_id, sequence_number, backlog, buf.compressed, index, buf._offset, size
            )
        )
        held = self.held
        entries = held.get(index)
        if entries is None:
            held[index] = [(receiver_id, buf)]
        else:
            (<list>entries).append((receiver_id, buf))
        self.num_held += 1
        self.bytes_shared += size
        self.out_bytes += _ENTRY
        if not self.corked or len(descriptors) >= _MAX_ENTRIES:
            self.frame_descriptors()
            if not self.corked:
                self._conn._flush()
        return 0

    def give_back(self, segments):
        """The consumer is done with these segments of SharedBufferResponses (one index
        per buffer): each held buffer released (``_release``). ProtocolError for a
        segment it does not hold (those before it are released)."""
        held = self.held
        for index in segments:
            entries = held.get(index)
            if not entries:
                raise ProtocolError(f"segment {index} given back but not held by this consumer")
            entry = (<list>entries).pop()
            if not entries:
                del held[index]
            self.num_held -= 1
            self._release(entry[0], entry[1])

    cpdef frame_descriptors(self):
        """The descriptors gathered so far, as one SharedBufferResponse in ``out``
        (``local_messages.encode_shared_buffers``'s bytes)."""
        descriptors = self.descriptors
        cdef Py_ssize_t n = len(descriptors)
        if n == 0:
            return
        if n > _MAX_ENTRIES:
            raise UsageError(f"SharedBufferResponse of {n} buffers (1 to {_MAX_ENTRIES})")
        self.descriptors = []
        cdef Py_ssize_t total = _FRAME_HEADER + _ENTRY * n
        cdef bytes frame = PyBytes_FromStringAndSize(NULL, total)
        cdef unsigned char* p = <unsigned char*>PyBytes_AS_STRING(frame)
        _be32(p, <unsigned long long>total)
        _be32(p + 4, _MAGIC_C)
        p[8] = _SHARED_ID
        p += _FRAME_HEADER
        cdef bytes entry
        for entry in descriptors:
            memcpy(p, PyBytes_AS_STRING(entry), _ENTRY)
            p += _ENTRY
        self.out.append(frame)
        self.out_bytes += _FRAME_HEADER

    cdef int _release(self, object receiver_id, Buffer buf) except -1:
        # Recycling runs the view's memory callback (a blocking partition's file reader
        # reads ahead into the freed segment), which may raise: that channel's error.
        try:
            buf.release()
        except Exception as exc:
            if self._fail_reader is None:
                self._fail_reader = self._conn.queue.fail_reader
            self._fail_reader(receiver_id, exc)
        return 0

    def recycle(self, list buffers not None):
        """Release each ``(end, receiver id, buffer)`` of ``buffers``."""
        for entry in buffers:
            self._release(entry[1], entry[2])

    def reap(self, long long sent):
        """Release the buffers in flight whose frames ended at or before ``sent``; True if
        any are left."""
        in_flight = self.in_flight
        while in_flight:
            entry = in_flight[0]
            if <long long>entry[0] > sent:
                return True
            in_flight.popleft()
            self._release(entry[1], entry[2])
        return False
