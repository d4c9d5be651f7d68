# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The reader's split of received bytes into records, compiled: ``u32 length | payload``
frames found by a C loop over each fed piece.

``LengthPrefixedDecoder`` is the framing of the default codec (``PickleBatchDecoder``)
and of ``FramedDecoder``: whole frames are handed to ``_deliver`` (the subclass's, in
Python: one call per frame) straight from the fed memory, except, for a decoder made with
``int_pairs=True`` (the default codec's), a frame whose payload starts with
``int_pairs.PAIRS_TAG``: its ``(int, int)`` records are built here in C
(``int_pairs.decode_int_pairs``); only a frame cut by the end of
a piece is copied, once (``memcpy``), into a scratch ``bytearray`` the decoder reuses for
frames up to ``SCRATCH_KEEP`` bytes, or one of the frame's size. A cut frame waits as its
first 1-3 header bytes or, once its length is known (and checked against the limit before
anything is allocated), in that buffer filled up to ``_have`` of ``_need`` bytes.

``DecoderBase`` is what every record decoder shares (the queue of decoded records and a
deferred error); the msgpack decoder subclasses it in Python.

Errors are the project's: ``RecordTooLargeError`` for a length over the limit, raised by
``feed`` through the subclass's ``CorruptRecordError`` handling as before: a
``CorruptRecordError`` is deferred to ``take``, which raises it (again) from then on.
There is no Python version of this module.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_FromStringAndSize
from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.string cimport memcpy

from exchange.buffers.buffer cimport Buffer
from exchange.memory.memory_segment cimport MemorySegment
from exchange.serialization.int_pairs cimport _PAIRS_TAG, decode_int_pairs

from exchange.errors import (
    CorruptRecordError,
    IllegalStateError,
    ProtocolError,
    RecordTooLargeError,
    fresh_error,
)

__all__ = [
    "ITEM_DATA",
    "ITEM_DRAINED",
    "ITEM_OVERTAKEN",
    "SCRATCH_KEEP",
    "DecoderBase",
    "LengthPrefixedDecoder",
    "feed_batch",
]

#: A cut frame up to this size is assembled in a reused scratch buffer.
SCRATCH_KEEP = 256 * 1024
cdef Py_ssize_t _SCRATCH_KEEP = SCRATCH_KEEP


cdef inline Py_ssize_t _u32(const unsigned char* p) noexcept nogil:
    return <Py_ssize_t>(
        ((<unsigned int>p[0]) << 24) | ((<unsigned int>p[1]) << 16)
        | ((<unsigned int>p[2]) << 8) | (<unsigned int>p[3])
    )


cdef inline bytearray _uninitialized(Py_ssize_t n):
    """A bytearray of ``n`` bytes left as malloc gave them: a cut frame's buffer is read
    only up to what was copied into it (``_have``), so zeroing it first is wasted work
    (for a 256 KiB frame, a memset as large as the frame's own copy)."""
    return <bytearray>PyByteArray_FromStringAndSize(NULL, n)


cdef class DecoderBase:
    """Delivery of decoded records and of a deferred error."""

    def __init__(self):
        self._ready = []
        self._error = None

    def take(self):
        ready = self._ready
        if ready:
            self._ready = []
            return ready
        if self._error is not None:
            raise fresh_error(self._error)
        return []

    def __iter__(self):
        while True:
            records = self.take()
            if not records:
                return
            yield from records

    def _fail(self, error):
        self._error = error


cdef class LengthPrefixedDecoder(DecoderBase):
    """Frames of ``u32 length | payload``, each payload handed to ``_deliver``."""

    def __init__(self, max_record_size, *, bint int_pairs=False):
        DecoderBase.__init__(self)
        self._limit = max_record_size
        self._int_pairs = int_pairs
        self._headlen = 0
        self._frame = None
        self._need = 0
        self._have = 0
        self._scratch = bytearray()

    @property
    def has_partial_record(self):
        return self._headlen > 0 or self._frame is not None or self._error is not None

    @property
    def buffered_bytes(self):
        """Bytes of the cut frame received so far (header included)."""
        return self._headlen + (0 if self._frame is None else 4 + self._have)

    def unconsumed_bytes(self):
        """The cut frame's bytes as fed: its header bytes, then the payload bytes so far."""
        if self._error is not None:
            raise fresh_error(self._error)
        if self._frame is None:
            return PyBytes_FromStringAndSize(<char*>self._head, self._headlen)
        return self._need.to_bytes(4, "big") + PyBytes_FromStringAndSize(
            PyByteArray_AS_STRING(self._frame), self._have
        )

    def feed(self, data):
        if self._error is not None:
            raise fresh_error(self._error)
        with memoryview(data) as view:
            try:
                if view.format == "B" and view.c_contiguous:
                    self._feed(view)
                else:
                    with view.cast("B") as flat:
                        self._feed(flat)
            except CorruptRecordError as exc:
                self._fail(exc)

    cdef int _feed(self, object view, Py_ssize_t base=0, Py_ssize_t length=-1) except -1:
        """Split ``view[base : base + length]`` (``length`` -1: to its end) into frames; a
        whole frame's payload goes to ``_deliver`` as a slice of ``view`` itself."""
        cdef Py_buffer pb
        cdef const unsigned char* p
        cdef Py_ssize_t pos = 0, end, n, stop, have
        cdef Py_ssize_t limit = self._limit
        PyObject_GetBuffer(view, &pb, PyBUF_SIMPLE)
        try:
            if length < 0:
                length = pb.len - base
            if base < 0 or base + length > pb.len:
                raise IllegalStateError(
                    f"[{base}, {base + length}) outside a view of {pb.len} bytes"
                )
            p = <const unsigned char*>pb.buf + base
            end = length
            if self._headlen or self._frame is not None:
                pos = self._complete(p, end)
                if pos < 0:
                    return 0
            while end - pos >= 4:
                n = _u32(p + pos)
                if n > limit:
                    raise RecordTooLargeError(n, limit)
                stop = pos + 4 + n
                if stop > end:
                    # the header is known and within the limit: hold the frame's start
                    frame = self._start_frame(n)
                    have = end - pos - 4
                    memcpy(PyByteArray_AS_STRING(frame), p + pos + 4, have)
                    self._have = have
                    return 0
                if self._int_pairs and n and p[pos + 4] == _PAIRS_TAG:
                    self._queue(decode_int_pairs(p + pos + 4, n))
                else:
                    self._deliver(view[base + pos + 4 : base + stop])
                pos = stop
            if pos < end:
                memcpy(self._head, p + pos, end - pos)
                self._headlen = <int>(end - pos)
        finally:
            PyBuffer_Release(&pb)
        return 0

    cdef int _feed_buffer(self, Buffer buf) except -1:
        """``feed(buf.memoryview())`` without the memoryviews: straight from the segment."""
        if self._error is not None:
            raise fresh_error(self._error)
        buf._check_alive()
        try:
            view = (<MemorySegment>buf._segment)._view
            if view is None:
                view = buf._segment.view()  # raises SegmentFreedError
            self._feed(view, buf._offset, buf._size)
        except CorruptRecordError as exc:
            self._fail(exc)
        return 0

    cdef Py_ssize_t _complete(self, const unsigned char* p, Py_ssize_t end) except -2:
        """Move bytes of the piece into the cut frame; its end in the piece, or -1."""
        cdef Py_ssize_t pos = 0, n, have, need, take
        cdef const unsigned char* body
        frame = self._frame
        if frame is None:
            pos = 4 - self._headlen
            if pos > end:
                pos = end
            memcpy(self._head + self._headlen, p, pos)
            self._headlen += <int>pos
            if self._headlen < 4:
                return -1
            n = _u32(self._head)
            if n > self._limit:
                raise RecordTooLargeError(n, self._limit)
            self._headlen = 0
            frame = self._start_frame(n)
            self._have = 0
        have = self._have
        need = self._need
        take = need - have
        if take > end - pos:
            take = end - pos
        memcpy(PyByteArray_AS_STRING(frame) + have, p + pos, take)
        have += take
        if have < need:
            self._have = have
            return -1
        self._frame = None
        self._have = 0
        body = <const unsigned char*>PyByteArray_AS_STRING(frame)
        if self._int_pairs and need and body[0] == _PAIRS_TAG:
            self._queue(decode_int_pairs(body, need))
        else:
            with memoryview(frame) as whole, whole[:need] as payload:
                self._deliver(payload)
        return pos + take

    cdef int _queue(self, list records) except -1:
        """Queue the records of a packed frame after those decoded before."""
        if self._ready:
            self._ready += records
        else:
            self._ready = records
        return 0

    cdef bytearray _start_frame(self, Py_ssize_t n):
        """The buffer for a cut frame of ``n`` payload bytes (``n`` within the limit)."""
        self._need = n
        if n > _SCRATCH_KEEP:
            self._frame = _uninitialized(n)
            return self._frame
        if len(self._scratch) < n:
            self._scratch = _uninitialized(_SCRATCH_KEEP if n > 4096 else 4096)
        self._frame = self._scratch
        return self._frame

    def clear(self):
        self._headlen = 0
        self._frame = None
        self._need = 0
        self._have = 0
        self._ready = []
        self._error = None

    def _deliver(self, payload):
        """Decode one frame's payload and queue what it holds (subclasses)."""
        raise NotImplementedError


#: Kinds of the items of a reader's hand-off batch (``client.consumer``'s ``_Item``:
#: ``(kind, channel, payload)``) that ``feed_batch`` reads: a data buffer, a data buffer a
#: priority barrier overtook (``(Buffer, ids)``), and the marker that only concerns an
#: unaligned barrier handler.
ITEM_DATA = 0
ITEM_OVERTAKEN = 8
ITEM_DRAINED = 10
cdef long _ITEM_DATA = ITEM_DATA
cdef long _ITEM_OVERTAKEN = ITEM_OVERTAKEN
cdef long _ITEM_DRAINED = ITEM_DRAINED


def feed_batch(list decoders, set ended, list batch, list out):
    """Decode a hand-off batch with no barrier handler, in one C loop: each data buffer's
    bytes go to its channel's decoder straight from the segment, and its records (if it
    completed any) are appended to ``out`` as ``(ITEM_DATA, channel, records)``; other
    items are appended as they are (``ITEM_DRAINED`` dropped). Returns the records decoded.
    A channel in ``ended`` (its EndOfData came) sending data is a ProtocolError; a
    decoder's error is raised as ``feed`` / ``take`` raise it. Decoders that are not
    ``LengthPrefixedDecoder`` (written in Python) are fed the buffer's memoryview."""
    cdef Py_ssize_t total = 0
    cdef long kind
    cdef tuple entry
    cdef object ch, buf, dec, records
    for item in batch:
        entry = <tuple?>item
        kind = entry[0]
        if kind == _ITEM_DATA or kind == _ITEM_OVERTAKEN:
            ch = entry[1]
            buf = entry[2] if kind == _ITEM_DATA else entry[2][0]
            if ended and ch in ended:
                raise ProtocolError(f"channel {ch} sent data after its EndOfData")
            dec = decoders[ch]
            if isinstance(dec, LengthPrefixedDecoder):
                (<LengthPrefixedDecoder>dec)._feed_buffer(<Buffer?>buf)
            else:
                with buf.memoryview() as view:
                    dec.feed(view)
            records = dec.take()
            if records:
                total += len(<list?>records)
                out.append((ITEM_DATA, ch, records))
        elif kind != _ITEM_DRAINED:
            out.append(item)
    return total
