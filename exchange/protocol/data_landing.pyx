# cython: language_level=3
"""Where a data-port client's BufferResponse payloads land, and their hand-off, compiled.

``DataLanding`` is the receive path of ``PartitionRequestClientConnection``
(``exchange.protocol.client_connection``): ``sink`` is the frame parser's body sink (a data
payload lands straight in a buffer its channel has credit for) and ``deliver`` hands the
items of one read to their channels in order: each landed payload becomes its buffer
(size, compression flag) given to its channel's ``on_buffer``, each message goes to the
connection's ``on_message``. Both are C calls into the compiled channel
(``exchange.consumer.remote_input_channel``): no Python frame per buffer.

Buffers taken for payloads not handed on yet are held in frame order (one read may
complete several frames); ``release_landing`` gives them back if the connection dies
first. ``accepting`` is False before the handshake and once the connection failed or
closed: a data frame then is read through the parser's scratch and dropped (or refused
by the connection's state).

Shared memory (a connection to this host's daemon, once ``arena_mapped``):
``deliver_shared`` turns a SharedBufferResponse's descriptors into Buffers over views of
the arena, each costing its channel one credit as a BufferResponse does (a credited
buffer of the channel is taken and held unused beside it). Releasing one queues its
segment's index for the next RecycleSegments (``take_give_backs``; the first index
queued calls ``on_give_back_pending``, the I/O side's flush) and returns the credit.
There is no Python version of this module.
"""

from collections import deque

from exchange.buffers.buffer cimport Buffer
from exchange.consumer.remote_input_channel cimport RemoteInputChannel
from exchange.memory.memory_segment cimport MemorySegment
from exchange.protocol.frame_parser cimport BufferResponseHeader, PayloadReceived

from exchange.buffers.buffer import DataType
from exchange.errors import IllegalStateError, ProtocolError

__all__ = ["DataLanding"]

cdef object _DATA_BUFFER = DataType.DATA_BUFFER


cdef class DataLanding:
    """The landing of one connection's data payloads (``channels``: receiver id ->
    channel, the connection's own dict)."""

    def __init__(self, address, dict channels):
        self.address = address
        self.channels = channels
        self._landing = deque()
        self.accepting = False
        self._arena = None
        self._segment_size = 0
        self._segments = []
        self._give_backs = []
        self.sending = False
        self.on_give_back_pending = None
        self.segments_held = 0
        self.bytes_shared = 0

    def sink(self, BufferResponseHeader header):
        """The frame parser's body sink: where a BufferResponse payload lands (a credited
        buffer of its channel), or None (an event, or a receiver no longer here)."""
        if header.data_type is not _DATA_BUFFER or not self.accepting:
            return None  # events are decoded whole; a frame before the handshake is refused
        ch = self.channels.get(header.receiver_id)
        if ch is None:
            return None  # cancelled meanwhile: read through scratch, then dropped
        cdef RemoteInputChannel channel = ch
        cdef Buffer buf = channel.request_buffer()
        if buf is None:
            raise ProtocolError(
                f"daemon {self.address} sent a buffer to receiver {header.receiver_id} "
                "without credit"
            )
        cdef MemorySegment seg = <MemorySegment>buf._segment
        if header.size > seg._size:
            buf.release()
            raise ProtocolError(
                f"buffer of {header.size} bytes exceeds the receiver's {seg._size}-byte "
                "segments; all daemons and clients must use the same segment size"
            )
        self._landing.append((ch, buf))
        return seg.view()[: header.size]

    def deliver(self, list items, on_message):
        """Hand one read's items on in order: payloads to their channels, messages to
        ``on_message``. An error (raised by either) stops the delivery; what is left
        stays landed until ``release_landing``."""
        cdef RemoteInputChannel ch
        cdef Buffer buf
        cdef BufferResponseHeader h
        landing = self._landing
        for item in items:
            if type(item) is PayloadReceived:
                ch, buf = landing.popleft()
                h = <BufferResponseHeader>(<PayloadReceived>item).header
                buf._size = h.size  # checked against the segment by ``sink``
                buf.compressed = h.compressed
                ch.on_buffer(buf, h.sequence_number, h.backlog)
            else:
                on_message(item)

    @property
    def num_landing(self):
        """Buffers taken for payloads not handed to their channel yet."""
        return len(self._landing)

    def release_landing(self):
        """Give back the buffers of payloads not handed on (the connection died)."""
        landing = self._landing
        while landing:
            (<Buffer>landing.popleft()[1]).release()

    # -- shared memory -------------------------------------------------------------------

    @property
    def has_arena(self):
        return self._arena is not None

    def arena_mapped(self, arena, Py_ssize_t segment_size):
        """The offered arena is mapped (``arena``: all of it, segments of ``segment_size``)."""
        if self._arena is not None:
            raise IllegalStateError("arena_mapped twice")
        cdef Py_ssize_t i, n = arena.nbytes
        self._segments = [
            MemorySegment(arena[i : i + segment_size], i // segment_size)
            for i in range(0, n - segment_size + 1, segment_size)
        ]
        self._arena = arena
        self._segment_size = segment_size

    def drop_arena(self):
        """The connection is gone (buffers still held keep their views)."""
        self._segments, self._arena = [], None

    def deliver_shared(self, buffers):
        """A SharedBufferResponse's descriptors, in stream order, to their channels."""
        arena = self._arena
        cdef Py_ssize_t seg_size = self._segment_size
        if arena is None:
            raise ProtocolError(f"SharedBufferResponse from {self.address} before ArenaMapped")
        cdef list segments = self._segments
        cdef dict channels = self.channels
        cdef Py_ssize_t index, offset, size, start
        cdef RemoteInputChannel ch
        cdef Buffer credit, buf
        cdef MemorySegment segment
        for rid, seq, backlog, _, compressed, index, offset, size in buffers:
            if offset + size > seg_size or index >= len(segments):
                raise ProtocolError(
                    f"SharedBufferResponse outside the arena: segment {index}, offset "
                    f"{offset}, size {size} (segments of {seg_size} bytes, arena of "
                    f"{arena.nbytes})"
                )
            self.segments_held += 1
            self.bytes_shared += size
            found = channels.get(rid)
            if found is None:
                self.give_back(index)  # cancelled meanwhile: straight back
                continue
            ch = found
            credit = ch.request_buffer()
            if credit is None:
                self.give_back(index)
                raise ProtocolError(
                    f"daemon {self.address} sent a buffer to receiver {rid} without credit"
                )
            if offset:  # a slice of a segment (the daemon's own buffers): a view of it
                start = index * seg_size + offset
                segment = MemorySegment(arena[start : start + size], index)
            else:
                segment = <MemorySegment>segments[index]
            buf = Buffer(segment, _SharedSegment.make(self, credit), size)
            if compressed:
                buf.compressed = True
            ch.on_buffer(buf, seq, backlog)

    cdef void give_back(self, Py_ssize_t index) except *:
        self.segments_held -= 1
        if not self.sending:
            return  # the daemon is gone (it freed what we held) or we are closing
        pending = self._give_backs
        pending.append(index)
        if len(pending) == 1 and self.on_give_back_pending is not None:
            self.on_give_back_pending()

    def take_give_backs(self):
        """The indices released since the last call (for one RecycleSegments)."""
        pending, self._give_backs = self._give_backs, []
        return pending

    @property
    def has_give_backs(self):
        return bool(self._give_backs)


cdef class _SharedSegment:
    """Recycler of one Buffer over a shared segment: its index goes back to the daemon
    and the credited buffer held beside it returns to its channel (the credit)."""

    cdef DataLanding _landing
    cdef Buffer _credit

    @staticmethod
    cdef _SharedSegment make(DataLanding landing, Buffer credit):
        cdef _SharedSegment r = _SharedSegment.__new__(_SharedSegment)
        r._landing = landing
        r._credit = credit
        return r

    def recycle(self, MemorySegment segment):
        self._landing.give_back(segment.index)
        self._credit.release()
