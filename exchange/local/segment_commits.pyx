# cython: language_level=3, boundscheck=False, wraparound=False
"""The per-entry loop of ``ProducerSession.commit_all``, compiled.

A producer task sharing the application's arena commits the segments it filled in
batches (``CommitSegments``: ``(segment, length, subpartition)`` per buffer). Every entry
is checked here against the session's books before its segment is queued, in order:

* the session is open (a FINISHED session: ``ProtocolError``; one released or failed
  meanwhile: the rest of the batch is dropped, the partition is gone);
* the task holds credit, and ``segment`` is the oldest segment granted to it (segments
  are committed in the order they were granted), else ``ProtocolError``;
* ``0 < length <= the segment's size``, else ``ProtocolError``;
* ``subpartition`` is one of the partition's, or ``ALL_SUBPARTITIONS``, else the
  segment goes back to the pool and ``SubpartitionIndexError`` is raised.

Then the segment is queued in place (``ResultPartition.add_buffer``). An error stops the
batch: the entries before it are queued, and the session's credit and counters say so
(``_granted`` is written back before each ``add_buffer``, which may call the session's
listeners; the byte and buffer counts once, at the end). ``ProducerSession`` grants the
segments freed meanwhile once, after the batch. There is no Python version of this
module; ``segment_commits.pyi`` types it for mypy.

``segment_indices``: the arena indices a grant names (``GrantSegments``), read from the
reserved buffers in one C loop (a generator expression ran a Python frame per segment).
"""

from exchange.buffers.buffer cimport Buffer
from exchange.memory.memory_segment cimport MemorySegment

from exchange.errors import ProtocolError, SubpartitionIndexError, UsageError
from exchange.partition.result_partition import ALL_SUBPARTITIONS

__all__ = ["commit_segments", "segment_indices"]

cdef object _ALL = ALL_SUBPARTITIONS


cpdef int commit_segments(object session, object commits) except -1:
    """Queue each ``(segment, length, subpartition)`` of ``commits`` for ``session`` (a
    ``ProducerSession``: its ``_reserved`` deque, ``_granted`` credit, ``state``,
    ``partition`` and counters)."""
    cdef Buffer buf
    cdef MemorySegment seg
    cdef Py_ssize_t granted = session._granted
    cdef long long nbytes = 0
    cdef long long nbuffers = 0
    reserved = session._reserved
    partition = session.partition
    add_buffer = partition.add_buffer
    open_state = type(session.state).OPEN
    finished = type(session.state).FINISHED
    num_subpartitions = len(partition.subpartitions)
    try:
        for segment, size, subpartition in commits:
            state = session.state
            if state is not open_state:
                if state is finished:
                    raise ProtocolError("CommitSegments after FinishPartition")
                return 0  # the partition went while the commit was in flight: dropped
            if granted <= 0:
                raise ProtocolError(f"commit of segment {segment} without credit")
            buf = reserved[0]
            seg = buf._segment
            if seg.index != segment:
                raise ProtocolError(
                    f"commit of segment {segment}; the oldest granted is {seg.index}"
                )
            if not 0 < size <= seg._size:
                raise ProtocolError(f"commit of {size} bytes into a {seg._size}-byte segment")
            granted -= 1
            session._granted = granted
            reserved.popleft()
            buf.set_size(size)
            if not 0 <= subpartition < num_subpartitions and subpartition != _ALL:
                buf.release()
                raise SubpartitionIndexError(
                    subpartition, num_subpartitions, partition.partition_id
                )
            # takes it over, even when it raises; ALL_SUBPARTITIONS: every subpartition
            add_buffer(subpartition, buf)
            nbytes += <long long>size  # what was queued
            nbuffers += 1
    finally:
        if nbuffers:
            session.bytes_received += nbytes
            session.buffers_received += nbuffers
    return 0


cpdef tuple segment_indices(object reserved, Py_ssize_t start, Py_ssize_t stop):
    """The segment indices of ``reserved[start:stop]`` (a deque of ``Buffer``s)."""
    cdef Buffer buf
    cdef Py_ssize_t i
    if not 0 <= start <= stop <= len(reserved):
        raise UsageError(f"segments {start}:{stop} of {len(reserved)} reserved")
    out = []
    for i in range(start, stop):
        buf = reserved[i]
        out.append((<MemorySegment>buf._segment).index)
    return tuple(out)
