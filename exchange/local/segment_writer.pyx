# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The producer task's side of shared memory, per buffer in one C loop (loop thread).

A producer task on its daemon's Unix socket writes each data buffer into the oldest
segment of the shared arena the daemon granted it, and sends only the commit
``(segment, length, subpartition)``; only a committed segment counts (one the task dies
writing is never read, and the daemon takes back every granted segment of a task that
is gone). ``SegmentWriter`` holds the granted segments (a ring of indexes, oldest first)
and the arena's mapping, and ``fill`` does the per-buffer part for a run of data buffers:
take a segment, copy the buffer's pieces into it (the one copy of the path), note whether
the buffer ends inside a record, and append its 12-byte commit entry to the
``CommitSegments`` frame under way, which ``take_commits`` hands out whole (frame header
included: one object per write, no join). Credit, overdraft, events and the writes stay
with ``client.local_connection.LocalConnection``.

Bad input raises the project's typed errors: a granted index outside the arena, or credit
to spend with no segment granted, is the daemon's fault (``ProtocolError``); a buffer
larger than a segment, or whose pieces do not add up to its size, is the caller's
(``UsageError``). There is no Python version of this module.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from cpython.set cimport PySet_Add, PySet_Discard
from libc.stdint cimport uint32_t
from libc.string cimport memcpy, memset

from exchange.buffers.buffer import DataType
from exchange.errors import ProtocolError, UsageError
from exchange.protocol.codec import FRAME_HEADER_SIZE, MAGIC
from exchange.protocol.local_messages import CommitSegments

__all__ = ["COMMIT_ENTRY_SIZE", "SegmentWriter"]

#: Bytes of one commit entry in a CommitSegments frame's body.
COMMIT_ENTRY_SIZE = _ENTRY

assert FRAME_HEADER_SIZE == _HEADER
cdef object _DATA = DataType.DATA_BUFFER
cdef uint32_t _MAGIC = MAGIC
cdef unsigned char _COMMIT_ID = CommitSegments.MESSAGE_ID

cdef extern from "sys/mman.h" nogil:
    int madvise(void* addr, size_t length, int advice)

cdef extern from "unistd.h" nogil:
    long sysconf(int name)
    int _SC_PAGESIZE

# Linux >= 5.14 (the kernel's ABI value: older C headers may not name it)
cdef int _MADV_POPULATE_WRITE = 23
cdef Py_ssize_t _PAGE = sysconf(_SC_PAGESIZE)


cdef inline void _put_be32(unsigned char* p, uint32_t v) noexcept nogil:
    p[0] = <unsigned char>(v >> 24)
    p[1] = <unsigned char>(v >> 16)
    p[2] = <unsigned char>(v >> 8)
    p[3] = <unsigned char>v


cdef class SegmentWriter:
    """Granted segments (oldest first) and the arena they are in; see the module."""

    def __cinit__(self) -> None:
        self._cap = 64
        self._queue = <uint32_t*>PyMem_Malloc(self._cap * sizeof(uint32_t))
        self._frame_cap = _HEADER + 64 * _ENTRY
        self._frame = <unsigned char*>PyMem_Malloc(self._frame_cap)
        if self._queue == NULL or self._frame == NULL:
            raise MemoryError()
        self._populate = True

    def __dealloc__(self) -> None:
        if self._mapped:
            PyBuffer_Release(&self._arena)
            self._mapped = False
        PyMem_Free(self._queue)
        PyMem_Free(self._frame)
        PyMem_Free(self._touched)

    @property
    def populated(self) -> int:
        """Segments whose pages were mapped in ahead of their first write (see
        ``grant``)."""
        return self._populated

    @property
    def mapped(self) -> bool:
        """True between ``attach`` and ``detach``: buffers go into the arena."""
        return self._mapped

    @property
    def segment_size(self) -> int:
        return self._segment_size

    def __len__(self) -> int:
        """Granted segments not written yet."""
        return self._count

    def granted(self) -> list:
        """The granted segments not written yet, oldest first (a copy)."""
        return [self._queue[(self._head + k) % self._cap] for k in range(self._count)]

    def attach(self, arena: object, Py_ssize_t segment_size) -> None:
        """Write into ``arena`` (a writable buffer: the mapped shared arena) from now, in
        segments of ``segment_size`` bytes. The segments granted so far must be in it."""
        cdef Py_ssize_t k
        if self._mapped:
            raise UsageError("the segment writer has an arena already")
        if segment_size <= 0:
            raise ProtocolError(f"segment size {segment_size} is not positive")
        PyObject_GetBuffer(arena, &self._arena, PyBUF_WRITABLE)
        self._mapped = True
        self._segment_size = segment_size
        self._num_segments = self._arena.len // segment_size
        for k in range(self._count):
            if self._queue[(self._head + k) % self._cap] >= self._num_segments:
                self.detach()
                raise ProtocolError(
                    f"segment {self._queue[(self._head + k) % self._cap]} granted outside "
                    f"the arena of {self._num_segments} segments"
                )
        PyMem_Free(self._touched)
        self._touched = <unsigned char*>PyMem_Malloc(self._num_segments + 1)
        if self._touched == NULL:
            self.detach()
            raise MemoryError()
        memset(self._touched, 0, self._num_segments + 1)
        self._populate_granted(0)

    def detach(self) -> None:
        """Let go of the arena (the connection unmaps it next); idempotent."""
        if self._mapped:
            PyBuffer_Release(&self._arena)
            self._mapped = False

    def grant(self, segments: object) -> None:
        """Queue segments the daemon granted (after those granted before)."""
        cdef Py_ssize_t need, k
        cdef uint32_t* grown
        cdef uint32_t index
        cdef object s
        cdef tuple seq = segments if type(segments) is tuple else tuple(segments)
        need = self._count + len(seq)
        if need > self._cap:
            grown = <uint32_t*>PyMem_Malloc(2 * need * sizeof(uint32_t))
            if grown == NULL:
                raise MemoryError()
            for k in range(self._count):
                grown[k] = self._queue[(self._head + k) % self._cap]
            PyMem_Free(self._queue)
            self._queue = grown
            self._cap = 2 * need
            self._head = 0
        first = self._count
        for s in seq:
            try:
                index = s  # C conversion: OverflowError below 0 or beyond 32 bits
            except (OverflowError, TypeError):
                raise ProtocolError(f"segment {s!r} granted outside the arena") from None
            if self._mapped and index >= self._num_segments:
                raise ProtocolError(f"segment {s!r} granted outside the arena")
            self._queue[(self._head + self._count) % self._cap] = index
            self._count += 1
        if self._mapped:
            self._populate_granted(first)

    cdef void _populate_granted(self, Py_ssize_t first) noexcept:
        """Map in the pages of the queued segments from the ``first``-th on that this
        process never wrote to (one madvise per run of adjacent ones): a page of the
        shared arena this process has not touched costs a fault on its first write, 8
        faults per 32 KiB segment, which cost more than the copy itself; a task touches
        each segment the daemon's pools hand it once before that. Best effort: where the
        kernel cannot (before 5.14, no memory now), the first write faults them in."""
        cdef Py_ssize_t k, seg, start = -1, end = -1
        if not self._populate:
            return
        for k in range(first, self._count + 1):
            seg = self._queue[(self._head + k) % self._cap] if k < self._count else -1
            if seg >= 0 and self._touched[seg]:
                seg = -1
            if seg >= 0:
                self._touched[seg] = 1
                if seg == end:  # adjacent to the run under way
                    end = seg + 1
                    continue
            if start >= 0 and not self._madvise_populate(start, end):
                return
            start = seg
            end = seg + 1 if seg >= 0 else -1

    cdef bint _madvise_populate(self, Py_ssize_t start, Py_ssize_t end) noexcept:
        cdef Py_ssize_t lo = start * self._segment_size
        cdef Py_ssize_t hi = end * self._segment_size
        cdef char* base = <char*>self._arena.buf
        lo -= lo % _PAGE
        hi = min(hi + (-hi) % _PAGE, self._arena.len)
        if madvise(base + lo, hi - lo, _MADV_POPULATE_WRITE) != 0:
            self._populate = False  # e.g. EINVAL before Linux 5.14: faults from now on
            return False
        self._populated += end - start
        return True

    def fill(self, list outs, Py_ssize_t i, Py_ssize_t credit, set mid_record) -> int:
        """Write ``outs[i:]`` into granted segments, one each, while they are data
        buffers and ``credit`` lasts, adding their commits to the frame under way and
        each target to ``mid_record`` (or out of it) as the buffer ends inside a record
        (or not). Returns the index of the first buffer not written (the caller spends
        that many credits)."""
        cdef Py_ssize_t n = len(outs)
        cdef Py_ssize_t pos, length, size, total
        cdef uint32_t seg, target
        cdef unsigned char* dst
        cdef unsigned char* entry
        cdef unsigned char* grown
        cdef Py_buffer view
        cdef object out, piece, t
        if not self._mapped:
            raise UsageError("no shared arena to write into")
        while i < n and credit > 0:
            out = outs[i]
            if out.data_type is not _DATA:
                break
            if self._count == 0:
                raise ProtocolError("producer credit without a granted segment")
            t = out.target
            target = t
            size = out.size
            if size > self._segment_size:
                raise UsageError(f"a {size}-byte buffer does not fit a {self._segment_size}-byte segment")
            if _HEADER + (self._entries + 1) * _ENTRY > self._frame_cap:
                grown = <unsigned char*>PyMem_Realloc(self._frame, 2 * self._frame_cap)
                if grown == NULL:
                    raise MemoryError()
                self._frame = grown
                self._frame_cap *= 2
            seg = self._queue[self._head]
            dst = <unsigned char*>self._arena.buf + <Py_ssize_t>seg * self._segment_size
            total = 0
            for piece in out.pieces:
                PyObject_GetBuffer(piece, &view, PyBUF_SIMPLE)
                length = view.len
                if total + length > size:
                    PyBuffer_Release(&view)
                    raise UsageError(f"a buffer's pieces exceed its size {size}")
                memcpy(dst + total, view.buf, length)
                PyBuffer_Release(&view)
                total += length
            if total != size:
                raise UsageError(f"a buffer's pieces hold {total} bytes, not its size {size}")
            self._head = (self._head + 1) % self._cap
            self._count -= 1
            if out.ends_mid_record:
                PySet_Add(mid_record, t)
            else:
                PySet_Discard(mid_record, t)
            entry = self._frame + _HEADER + self._entries * _ENTRY
            _put_be32(entry, seg)
            _put_be32(entry + 4, <uint32_t>size)
            _put_be32(entry + 8, target)
            self._entries += 1
            self.bytes_shared += size
            credit -= 1
            i += 1
        return i

    def take_commits(self) -> object:
        """The CommitSegments frame of the buffers written since the last call (header
        and body in one object), or None when there are none."""
        cdef Py_ssize_t length
        if self._entries == 0:
            return None
        length = _HEADER + self._entries * _ENTRY
        _put_be32(self._frame, <uint32_t>length)
        _put_be32(self._frame + 4, _MAGIC)
        self._frame[8] = _COMMIT_ID
        self._entries = 0
        return PyBytes_FromStringAndSize(<char*>self._frame, length)
