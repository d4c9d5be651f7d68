# The producer task's granted segments and commit packing (exchange/local/segment_writer.pyx);
# Python code sees it through segment_writer.pyi.
from libc.stdint cimport uint32_t

cdef enum:
    _ENTRY = 12  # u32 segment, u32 length, u32 subpartition (big-endian)
    _HEADER = 9  # u32 frame length, u32 magic, u8 message id


cdef class SegmentWriter:
    cdef Py_buffer _arena
    cdef bint _mapped
    cdef Py_ssize_t _segment_size
    cdef Py_ssize_t _num_segments
    # the granted segments: a ring of _cap indexes, _count of them from _head
    cdef uint32_t* _queue
    cdef Py_ssize_t _cap
    cdef Py_ssize_t _head
    cdef Py_ssize_t _count
    # the CommitSegments frame under way: header then _entries entries
    cdef unsigned char* _frame
    cdef Py_ssize_t _frame_cap
    cdef Py_ssize_t _entries
    cdef readonly unsigned long long bytes_shared
    # one flag per segment of the arena: its pages are mapped in this process
    cdef unsigned char* _touched
    cdef bint _populate
    cdef Py_ssize_t _populated

    cdef void _populate_granted(self, Py_ssize_t first) noexcept
    cdef bint _madvise_populate(self, Py_ssize_t start, Py_ssize_t end) noexcept
